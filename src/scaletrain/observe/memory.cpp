// Predicted vs measured memory of a run. See memory.h, Note [What is measured].
#include "scaletrain/observe/memory.h"

#include <cmath>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>

#include "scaletrain/util/error.h"

namespace scaletrain::observe {
namespace {

// Note [Counting allocator]: each allocation gets a 64-byte header (c10's
// alignment, so the data stays aligned) that records its size; the deleter
// reads it back. Data and context are the same pointer, which keeps
// raw_allocate()/raw_deleter() working for the code that uses them.
constexpr size_t kHeader = 64;
std::atomic<int64_t> g_current{0}, g_peak{0};

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  g_current.fetch_sub(static_cast<int64_t>(*reinterpret_cast<size_t*>(base)), std::memory_order_relaxed);
  c10::free_cpu(base);
}

// libtorch 1.x declares `allocate(size_t) const`, 2.x `allocate(size_t)` and
// a `copy_data` of its own: each overload below overrides the base's virtual
// in the version that declares it, and is a plain member in the other.
struct CountingAllocator final : at::Allocator {
  at::DataPtr allocate(size_t n) { return counted_allocate(n); }
  at::DataPtr allocate(size_t n) const { return counted_allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const { std::memcpy(dest, src, count); }
  at::DeleterFnPtr raw_deleter() const override { return &counted_delete; }

 private:
  static at::DataPtr counted_allocate(size_t n) {
    if (n == 0) return {nullptr, nullptr, &counted_delete, at::Device(at::kCPU)};  // host: the CPU allocator
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<size_t*>(base) = n;
    const int64_t now =
        g_current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    void* data = base + kHeader;
    return {data, data, &counted_delete, at::Device(at::kCPU)};  // host: the CPU allocator
  }
};

CountingAllocator g_counting;
bool g_installed = false;

double status_mb(const char* key) {
  std::ifstream in("/proc/self/status");
  const std::string k(key);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(k, 0) == 0) return std::stod(line.substr(k.size())) / 1024.0;  // kB
  return 0;
}

constexpr double kMiB = 1048576.0;

}  // namespace

bool TensorBytes::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetCPUAllocator(&g_counting, /*priority=*/0);
    g_installed = c10::GetCPUAllocator() == &g_counting;
  });
  return g_installed;
}
bool TensorBytes::installed() { return g_installed; }
int64_t TensorBytes::current() { return g_current.load(std::memory_order_relaxed); }
int64_t TensorBytes::peak() { return g_peak.load(std::memory_order_relaxed); }
void TensorBytes::reset_peak() { g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed); }

double rss_peak_mb() { return status_mb("VmHWM:"); }
double rss_file_mb() { return status_mb("RssFile:"); }
double heap_free_mb() { return static_cast<double>(mallinfo2().fordblks) / kMiB; }

void release_free_heap() { ::malloc_trim(0); }

bool reset_rss_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";  // "reset the peak resident set size to the current one" (Linux >= 4.0)
  out.close();
  return static_cast<bool>(out);
}

namespace {
double mib(double bytes) { return bytes / kMiB; }
std::string fmt(const char* f, double a) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), f, a);
  return buf;
}

// " (40.0 recomputed)" under full recompute: the part of the activations a
// forward does not keep (the measured activations are what it keeps).
std::string recomputed(const estimate::RankEstimate& e) {
  return e.recomputed > 0 ? " (" + fmt("%.1f", mib(e.recomputed)) + " recomputed)" : "";
}
}  // namespace

std::string memory_line(const std::string& phase, const estimate::Layout& layout, const estimate::RankEstimate& e,
                        const MeasuredMemory& m, int ranks) {
  const bool end = phase == "end";
  std::string s = std::string("scaletrain: memory ") + (end ? "at the end" : "after setup") + ", per rank (max of " +
                  std::to_string(ranks) + ", " + estimate::describe(layout, e) + "): predicted " +
                  fmt("%.1f", mib(e.total)) + " MiB = states " + fmt("%.1f", mib(e.model_states())) +
                  " + gathered/buffers " + fmt("%.1f", mib(e.gathered + e.comm_buffers)) + " + activations " +
                  fmt("%.1f", mib(e.activations)) + recomputed(e) + " + workspace " + fmt("%.1f", mib(e.workspace)) +
                  " | measured tensors: states " + fmt("%.1f", mib(m.states));
  if (end) {
    s += ", activations " + (m.activations > 0 ? fmt("%.1f", mib(m.activations)) : std::string("n/a")) + ", peak " +
         fmt("%.1f", mib(m.tensor_peak)) + " (predicted/peak " +
         fmt("%.3f", m.tensor_peak > 0 ? e.total / m.tensor_peak : 0.0) + ")";
    s += " | rss: baseline " + fmt("%.0f", m.rss_baseline_mb) + " MiB, training peak " + fmt("%.0f", m.rss_peak_mb) +
         " (+" + fmt("%.1f", m.rss_peak_mb - m.rss_baseline_mb) + ": tensors, file-backed pages +" +
         fmt("%.1f", m.rss_file_growth_mb) + ", freed heap glibc keeps (" + fmt("%.1f", m.heap_free_mb) +
         " at the end), libraries' own buffers)";
  } else {
    s += ", live now " + fmt("%.1f", mib(m.tensors)) + " | rss: baseline " + fmt("%.0f", m.rss_baseline_mb) +
         " MiB, now " + fmt("%.0f", m.rss_peak_mb);
  }
  return s;
}

nlohmann::json memory_record(const std::string& phase, const estimate::Layout& layout, const estimate::RankEstimate& e,
                             const MeasuredMemory& m, int ranks) {
  return {{"record", "memory"},
          {"phase", phase},
          {"ranks", ranks},
          {"layout", estimate::describe(layout, e)},
          {"predicted_mib",
           {{"params", mib(e.params)},
            {"gradients", mib(e.gradients)},
            {"master", mib(e.master)},
            {"optimizer", mib(e.optimizer)},
            {"gathered", mib(e.gathered)},
            {"comm_buffers", mib(e.comm_buffers)},
            {"activations", mib(e.activations)},
            {"recomputed", mib(e.recomputed)},
            {"workspace", mib(e.workspace)},
            {"states", mib(e.model_states())},
            {"total", mib(e.total)}}},
          {"measured_mib",
           {{"states", mib(m.states)},
            {"activations", mib(m.activations)},
            {"tensors", mib(m.tensors)},
            {"tensor_peak", mib(m.tensor_peak)},
            {"rss_baseline", m.rss_baseline_mb},
            {"rss_peak", m.rss_peak_mb},
            {"rss_file_growth", m.rss_file_growth_mb},
            {"heap_free_end", m.heap_free_mb}}}};
}

void report_memory(const std::string& phase, const estimate::ModelSpec& model, const estimate::Layout& layout,
                   const MeasuredMemory& local, comm::Group& all, bool lead, MetricsSink& sink) {
  auto t = torch::tensor({local.states, local.activations, local.tensors, local.tensor_peak, local.rss_baseline_mb,
                          local.rss_peak_mb, local.rss_file_growth_mb, local.heap_free_mb},
                         torch::kDouble);
  all.all_reduce(t, comm::ReduceOp::Max).wait();
  if (!lead) return;
  const auto v = t.accessor<double, 1>();
  const MeasuredMemory m{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]};
  estimate::RankEstimate e;
  try {
    e = estimate::estimate_rank(model, layout);
  } catch (const UsageError& err) {
    std::printf("scaletrain: memory %s: no estimate (%s)\n", phase.c_str(), err.what());
    std::fflush(stdout);
    return;
  }
  std::printf("%s\n", memory_line(phase, layout, e, m, all.size()).c_str());
  std::fflush(stdout);
  sink.write_record(memory_record(phase, layout, e, m, all.size()).dump());
}

}  // namespace scaletrain::observe

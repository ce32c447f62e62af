// Tiled ("flash") attention against the naive one on the CPU
// (kernels/attention.h): time and extra memory of forward + backward.
//
//   bench_attention [--max-t 8192] [--flash-max-t 16384] [--threads 1,2] [--naive-max-gib 12] [--no-mem]
//
// Shapes: B = 1, H = 8, D = 64, causal, fp32, T in 512, 1024, ..., up to
// --max-t (flash alone continues up to --flash-max-t). For each T and thread
// count: the median of a few forward + backward runs after one warm-up (the
// backward from a random gradient of out), for both kernels. The naive one
// is skipped where its score-sized tensors (about 5 of [B, H, T, T] floats)
// would pass --naive-max-gib.
//
// Memory, measured in a fresh process per (T, kernel) at 1 thread (this
// binary re-runs itself with --mem-child), after a small warm-up run and with
// the inputs and the upstream gradient already allocated:
//   alloc MiB: the peak, during forward + backward, of the bytes held by
//     tensors from c10's CPU allocator beyond what was held before (outputs
//     and gradients included; the kernel's per-thread tile scratch, a few
//     tens of KiB from std::vector, is not counted), via a
//     c10::MemoryReportingInfoBase installed as the thread's profiler state;
//   hwm MiB: VmHWM - VmRSS from /proc/self/status, with the high-water mark
//     reset (clear_refs 5) just before the run.
//
// Threads: at::set_num_threads(n) and, when the BLAS is OpenBLAS, its own
// thread count too (openblas_set_num_threads, looked up with dlsym), as
// train/metrics.cpp's set_compute_threads does: the naive kernel's big
// products are threaded only by the BLAS.
#include <dlfcn.h>
#include <unistd.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/kernels/attention.h"

namespace kn = scaletrain::kernels;

namespace {

constexpr int64_t kB = 1, kH = 8, kD = 64;

struct Args {
  int64_t max_t = 8192, flash_max_t = 0;  // 0: max_t
  std::vector<int> threads{1, 2};
  double naive_max_gib = 12;
  bool mem = true;
  // --mem-child T kernel: measure one case and print "MEM alloc_bytes hwm_bytes".
  int64_t child_t = 0;
  std::string child_kernel;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + f);
      return argv[++i];
    };
    if (f == "--max-t") {
      a.max_t = std::stoll(next());
    } else if (f == "--flash-max-t") {
      a.flash_max_t = std::stoll(next());
    } else if (f == "--threads") {
      a.threads.clear();
      std::stringstream s(next());
      for (std::string x; std::getline(s, x, ',');) a.threads.push_back(std::stoi(x));
    } else if (f == "--naive-max-gib") {
      a.naive_max_gib = std::stod(next());
    } else if (f == "--no-mem") {
      a.mem = false;
    } else if (f == "--mem-child") {
      a.child_t = std::stoll(next());
      a.child_kernel = next();
    } else {
      throw std::runtime_error("unknown flag " + f);
    }
  }
  if (a.flash_max_t == 0) a.flash_max_t = a.max_t;
  return a;
}

void set_threads(int n) {
  at::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
}

using Kernel = std::tuple<torch::Tensor, torch::Tensor> (*)(const torch::Tensor&, const torch::Tensor&,
                                                            const torch::Tensor&, const kn::AttentionMask&);

Kernel kernel_named(const std::string& name) { return name == "flash" ? kn::flash_attention : kn::naive_attention; }

struct Inputs {
  torch::Tensor q, k, v, gout;
  explicit Inputs(int64_t T)
      : q(torch::randn({kB, kH, T, kD})),
        k(torch::randn({kB, kH, T, kD})),
        v(torch::randn({kB, kH, T, kD})),
        gout(torch::randn({kB, kH, T, kD})) {}
};

// One forward + backward; returns nothing, keeps nothing.
void step(Kernel fn, const Inputs& in) {
  auto q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(), v = in.v.detach().requires_grad_();
  auto out = std::get<0>(fn(q, k, v, kn::AttentionMask{}));
  torch::autograd::grad({out}, {q, k, v}, {in.gout});
}

double median_ms(Kernel fn, const Inputs& in, int reps) {
  step(fn, in);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    step(fn, in);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Peak bytes held by tensors from the CPU allocator while installed.
struct PeakTracker final : c10::MemoryReportingInfoBase {
  std::atomic<int64_t> now{0}, peak{0};
  void reportMemoryUsage(void*, int64_t size, int64_t, int64_t, c10::Device) override {
    const int64_t v = now.fetch_add(size) + size;
    for (int64_t p = peak.load(); v > p && !peak.compare_exchange_weak(p, v);) {
    }
  }
  bool memoryProfilingEnabled() const override { return true; }
};

int64_t status_kib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

int mem_child(const Args& a) {
  set_threads(1);
  const Kernel fn = kernel_named(a.child_kernel);
  step(fn, Inputs(64));  // libraries' own first-use buffers are not the kernel's
  const Inputs in(a.child_t);
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  const int64_t rss0 = status_kib("VmRSS");
  auto tracker = std::make_shared<PeakTracker>();
  {
    c10::DebugInfoGuard guard(c10::DebugInfoKind::PROFILER_STATE, tracker);
    step(fn, in);
  }
  const int64_t hwm = status_kib("VmHWM");
  std::printf("MEM %lld %lld\n", static_cast<long long>(tracker->peak.load()),
              static_cast<long long>((hwm - rss0) * 1024));
  return 0;
}

struct Memory {
  double alloc_mib = -1, hwm_mib = -1;
};

Memory measure_in_child(int64_t T, const std::string& kernel) {
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return {};
  const std::string cmd = std::string(self) + " --mem-child " + std::to_string(T) + " " + kernel;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {};
  Memory m;
  long long alloc = 0, hwm = 0;
  char line[256];
  while (std::fgets(line, sizeof line, p) != nullptr)
    if (std::sscanf(line, "MEM %lld %lld", &alloc, &hwm) == 2) m = {alloc / 1048576.0, hwm / 1048576.0};
  pclose(p);
  return m;
}

int reps_for(int64_t T) { return T <= 1024 ? 5 : T <= 4096 ? 3 : 1; }

std::string cell(double x, const char* fmt) {
  if (x < 0) return "-";
  char b[64];
  std::snprintf(b, sizeof b, fmt, x);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.child_t > 0) return mem_child(a);
  torch::manual_seed(0);
  std::printf("B=%lld H=%lld D=%lld causal fp32; ms: median fwd+bwd; MiB: extra memory (alloc / hwm), 1 thread\n",
              (long long)kB, (long long)kH, (long long)kD);
  std::printf("%6s %7s %10s %10s %8s %17s %17s\n", "T", "threads", "naive ms", "flash ms", "speedup",
              "naive MiB a/hwm", "flash MiB a/hwm");
  for (int64_t T = 512; T <= std::max(a.max_t, a.flash_max_t); T *= 2) {
    const double naive_gib = 5.0 * kB * kH * T * T * 4 / (1 << 30);
    const bool run_naive = T <= a.max_t && naive_gib <= a.naive_max_gib;
    const bool run_flash = T <= a.flash_max_t;
    Memory nm, fm;
    if (a.mem && run_naive) nm = measure_in_child(T, "naive");
    if (a.mem && run_flash) fm = measure_in_child(T, "flash");
    const Inputs in(T);
    for (int threads : a.threads) {
      set_threads(threads);
      const double naive = run_naive ? median_ms(kn::naive_attention, in, reps_for(T)) : -1;
      const double flash = run_flash ? median_ms(kn::flash_attention, in, reps_for(T)) : -1;
      std::printf("%6lld %7d %10s %10s %8s %8s/%-8s %8s/%-8s\n", (long long)T, threads, cell(naive, "%.1f").c_str(),
                  cell(flash, "%.1f").c_str(), cell(naive > 0 && flash > 0 ? naive / flash : -1, "%.2fx").c_str(),
                  cell(nm.alloc_mib, "%.1f").c_str(), cell(nm.hwm_mib, "%.1f").c_str(),
                  cell(fm.alloc_mib, "%.1f").c_str(), cell(fm.hwm_mib, "%.1f").c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

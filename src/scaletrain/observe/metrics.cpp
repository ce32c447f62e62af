#include "scaletrain/observe/metrics.h"

#include <torch/cuda.h>

#include <filesystem>
#include <fstream>

#include <dlfcn.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

#include "scaletrain/util/error.h"

namespace scaletrain::observe {

MetricsSink::MetricsSink(const std::string& path, int64_t total_steps, bool progress, bool append)
    : total_(total_steps), bar_(progress && isatty(STDOUT_FILENO)) {
  if (!path.empty()) {
    // Its directory is made as a checkpoint directory is (runs/<name>/ of the examples).
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    std::error_code ignored;  // a directory that cannot be made fails the open below, which names the path
    if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
    file_.open(path, std::ios::out | (append ? std::ios::app : std::ios::trunc));
    if (!file_) throw UsageError("metrics.path " + path + " cannot be written");
  }
}

MetricsSink::~MetricsSink() {
  if (bar_) std::printf("\n");
}

void MetricsSink::write(const StepMetrics& m, bool log_line) {
  if (file_.is_open()) {
    nlohmann::json j = {{"step", m.step},
                        {"loss", m.loss},
                        {"lr", m.lr},
                        {"step_ms", m.step_ms},
                        {"samples_per_s", m.samples_per_s},
                        {"peak_rss_mb", m.peak_rss_mb},
                        {"comm_wait_ms", m.comm_wait_ms},
                        {"grad_norm", m.grad_norm},
                        {"loss_scale", m.loss_scale},
                        {"skipped_steps", m.skipped_steps}};
    if (m.tokens_per_s >= 0) {
      j["tokens_per_s"] = m.tokens_per_s;
      j["mfu"] = m.mfu;
    }
    if (m.device_max_allocated_mb >= 0) {
      j["device_max_allocated_mb"] = m.device_max_allocated_mb;
      j["device_max_reserved_mb"] = m.device_max_reserved_mb;
    }
    if (!m.moe_tokens_per_expert.empty()) {
      j["moe_aux_loss"] = m.moe_aux_loss;
      j["moe_z_loss"] = m.moe_z_loss;
      j["moe_tokens_per_expert"] = m.moe_tokens_per_expert;
      j["moe_dropped"] = m.moe_dropped;
    }
    file_ << j.dump() << "\n";
    file_.flush();
  }
  if (bar_) std::printf("\r\033[K");
  if (log_line && m.tokens_per_s < 0) {
    std::printf("step %5lld | loss %.6f | lr %.3e | grad norm %.4f | %7.1f ms | %8.0f samples/s | rss %6.0f MB | comm "
                "wait %6.1f ms\n",
                static_cast<long long>(m.step), m.loss, m.lr, m.grad_norm, m.step_ms, m.samples_per_s, m.peak_rss_mb,
                m.comm_wait_ms);
  } else if (log_line) {
    std::printf(
        "step %5lld | loss %.4f | lr %.2e | %7.1f ms | %8.0f tok/s | mfu %5.1f%% | rss %6.0f MB | comm wait %6.1f ms\n",
        static_cast<long long>(m.step), m.loss, m.lr, m.step_ms, m.tokens_per_s, 100.0 * m.mfu, m.peak_rss_mb,
        m.comm_wait_ms);
    if (m.device_max_allocated_mb >= 0)
      std::printf("           device max allocated %.0f MB | max reserved %.0f MB\n", m.device_max_allocated_mb,
                  m.device_max_reserved_mb);
    if (!m.moe_tokens_per_expert.empty()) {
      int64_t lo = m.moe_tokens_per_expert.front(), hi = lo;
      for (int64_t n : m.moe_tokens_per_expert) lo = std::min(lo, n), hi = std::max(hi, n);
      std::printf("           moe aux loss %.4f | z loss %.4f | tokens per expert %lld..%lld | dropped %lld\n",
                  m.moe_aux_loss, m.moe_z_loss, static_cast<long long>(lo), static_cast<long long>(hi),
                  static_cast<long long>(m.moe_dropped));
    }
  }
  if (bar_) {
    const int width = 30;
    const int filled = static_cast<int>(width * m.step / std::max<int64_t>(1, total_));
    std::printf("[%s%s] %lld/%lld loss %.4f", std::string(filled, '#').c_str(),
                std::string(width - filled, '.').c_str(), static_cast<long long>(m.step),
                static_cast<long long>(total_), m.loss);
  }
  std::fflush(stdout);
}

void MetricsSink::write_record(const std::string& json) {
  if (!file_.is_open()) return;
  file_ << json << "\n";
  file_.flush();
}

double peak_rss_mb() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

double current_rss_mb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // in kB
  return 0;
}

void set_compute_threads(int n) {
  torch::set_num_threads(n);
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(n);
}

std::string blas_threading() {
  using GetParallel = int (*)();
  const auto f = reinterpret_cast<GetParallel>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  if (!f) return "";
  switch (f()) {
    case 0:
      return "sequential";
    case 1:
      return "pthreads";
    default:
      return "openmp";
  }
}

double measure_device_gemm_flops(int64_t n, int reps) {
  torch::NoGradGuard no_grad;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::Device(torch::DeviceType::CUDA));
  auto a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  auto c = torch::mm(a, b);  // warm-up
  torch::cuda::synchronize();
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    torch::cuda::synchronize();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / *std::min_element(secs.begin(), secs.end());
}

double measure_gemm_flops(int64_t n, int reps) {
  torch::NoGradGuard no_grad;
  auto a = torch::randn({n, n}), b = torch::randn({n, n});
  auto c = torch::mm(a, b);  // warm-up
  std::vector<double> secs;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // The fastest repetition: a peak is what the machine can do, and anything
  // else running at the same time only ever slows a repetition down.
  return 2.0 * n * n * n / *std::min_element(secs.begin(), secs.end());
}

}  // namespace scaletrain::observe

// Benchmark: output projection + cross-entropy, fused (chunked) vs unfused.
//
// For each case (features C, tokens N, threads, path) a forked child builds
// hidden [N, C] and weight [V, C] (both requiring grad) and int64 targets,
// then runs forward + backward of `sum / count` once as a warm-up and `reps`
// more times, timing each. Time is the median of the timed runs.
//
// Memory: the child resets its peak-RSS counter (writing "5" to
// /proc/self/clear_refs) after the inputs exist, and reports
// VmHWM - VmRSS(before) over the warm-up run: the largest amount of memory the
// head + loss (forward, backward, gradients) held beyond its inputs. If the
// reset is refused the baseline is the VmHWM before the run (printed as
// method "hwm-delta" instead of "reset").
//
// Usage: bench_linear_ce [--features 256] [--tokens 512,4096] [--threads 1,2]
//                        [--paths unfused,fused,fused:64] [--reps 3] [--vocab 128256]
// A path "fused:K" uses chunk_tokens = K; "fused" the automatic size.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/kernels/linear_cross_entropy.h"

namespace {

namespace k = scaletrain::kernels;

struct Args {
  std::vector<int64_t> features{256};
  std::vector<int64_t> tokens{512, 4096};
  std::vector<int64_t> threads{1, 2};
  std::vector<std::string> paths{"unfused", "fused"};
  int64_t reps = 3;
  int64_t vocab = 128256;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  for (const auto& item : split(s)) out.push_back(std::stoll(item));
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--features") a.features = split_ints(value);
    else if (key == "--tokens") a.tokens = split_ints(value);
    else if (key == "--threads") a.threads = split_ints(value);
    else if (key == "--paths") a.paths = split(value);
    else if (key == "--reps") a.reps = std::stoll(value);
    else if (key == "--vocab") a.vocab = std::stoll(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  return a;
}

// A "VmXXX:  1234 kB" field of /proc/self/status, in MiB.
double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  return -1;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return bool(out);
}

// OpenBLAS (pthread build) keeps its own pool; ATen's setting does not reach it.
void set_threads(int64_t n) {
  at::set_num_threads(int(n));
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(int(n));
}

struct Case {
  int64_t features, tokens, threads;
  std::string path;
};

// One forward + backward; returns the loss value.
double step(const Case& c, torch::Tensor& h, torch::Tensor& w, const torch::Tensor& t) {
  h.mutable_grad() = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  k::LinearCrossEntropyOptions o;
  std::tuple<torch::Tensor, torch::Tensor> r;
  if (c.path == "unfused") {
    r = k::linear_cross_entropy_unfused(h, w, {}, t, o);
  } else {
    if (c.path.rfind("fused:", 0) == 0) o.chunk_tokens = std::stoll(c.path.substr(6));
    r = k::linear_cross_entropy(h, w, {}, t, o);
  }
  auto loss = std::get<0>(r) / std::get<1>(r).clamp_min(1).to(torch::kFloat);
  loss.backward();
  return loss.item<double>();
}

// Runs in the forked child: prints one table row.
void run_case(const Case& c, const Args& a) {
  set_threads(c.threads);
  torch::manual_seed(0);
  auto h = torch::randn({c.tokens, c.features}).requires_grad_(true);
  auto w = (torch::randn({a.vocab, c.features}) * 0.02).requires_grad_(true);
  auto t = torch::randint(0, a.vocab, {c.tokens}, torch::kLong);
  t.narrow(0, 0, c.tokens / 10).fill_(-100);

  const bool reset = reset_peak_rss();
  const double base = reset ? status_mib("VmRSS") : status_mib("VmHWM");
  const double loss = step(c, h, w, t);
  const double peak = status_mib("VmHWM") - base;

  std::vector<double> secs;
  for (int64_t i = 0; i < a.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step(c, h, w, t);
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(secs.begin(), secs.end());
  const double median = secs.empty() ? 0 : secs[secs.size() / 2];
  std::printf("| %5lld | %5lld | %7lld | %-10s | %9.3f | %9.3f | %9.3f | %10.1f | %-9s | %.6f |\n",
              (long long)c.features, (long long)c.tokens, (long long)c.threads, c.path.c_str(), median,
              secs.front(), secs.back(), peak, reset ? "reset" : "hwm-delta", loss);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::printf("V=%lld, fp32, loss = sum/count, fwd+bwd w.r.t. hidden and weight, %lld timed reps after 1 warm-up\n",
              (long long)a.vocab, (long long)a.reps);
  std::printf("| C     | N     | threads | path       | median s  | min s     | max s     | peak MiB   | mem       | loss     |\n");
  std::printf("|-------|-------|---------|------------|-----------|-----------|-----------|------------|-----------|----------|\n");
  std::fflush(stdout);
  for (int64_t features : a.features)
    for (int64_t tokens : a.tokens)
      for (int64_t threads : a.threads)
        for (const auto& path : a.paths) {
          const pid_t pid = fork();
          if (pid == 0) {
            run_case({features, tokens, threads, path}, a);
            std::_Exit(0);
          }
          int status = 0;
          waitpid(pid, &status, 0);
          if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            std::printf("| %5lld | %5lld | %7lld | %-10s | failed (status %d) |\n", (long long)features,
                        (long long)tokens, (long long)threads, path.c_str(), status);
        }
  return 0;
}

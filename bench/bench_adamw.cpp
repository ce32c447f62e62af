// Benchmark: one AdamW step over a flat fp32 buffer of N elements, the fused
// kernel (kernels::fused_adamw_step) against the ATen ops it replaces
// (kernels::adamw_step_unfused), the whole buffer decayed.
//
// Each path has its own p, m, v (same start) and both get the same gradient.
// A rep times one unfused step, then one fused step (the paths alternate, so
// that a disturbance hits both); the figures are medians of `reps` reps after
// `warmup` untimed ones. "fused GB/s" counts the bytes the fused step must
// move: p, g, m, v read and p, m, v written, 7 x 4 bytes per element.
//
// Usage: bench_adamw [--sizes 1048576,16777216] [--threads 1,2] [--reps 7] [--warmup 1]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/kernels/adamw.h"

namespace {

namespace k = scaletrain::kernels;
using torch::Tensor;

struct Args {
  std::vector<int64_t> sizes{1 << 20, 1 << 24};
  std::vector<int64_t> threads{1, 2};
  int64_t reps = 7;
  int64_t warmup = 1;
};

std::vector<int64_t> split_ints(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--sizes")
      a.sizes = split_ints(value);
    else if (key == "--threads")
      a.threads = split_ints(value);
    else if (key == "--reps")
      a.reps = std::stoll(value);
    else if (key == "--warmup")
      a.warmup = std::stoll(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  return a;
}

struct State {
  Tensor p, m, v;
};

// The scalars of step t at the usual LLM settings.
k::AdamWStep step_scalars(int64_t t) {
  k::AdamWStep s;
  s.lr = 3e-4;
  s.weight_decay = 0.1;
  s.bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(t));
  s.bias_correction2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, static_cast<double>(t)));
  return s;
}

double time_ms(bool fused, State& st, const Tensor& g, int64_t t) {
  const k::AdamWStep s = step_scalars(t);
  const auto t0 = std::chrono::steady_clock::now();
  if (fused)
    k::fused_adamw_step(st.p, g, st.m, st.v, st.p.numel(), s);
  else
    k::adamw_step_unfused(st.p, g, st.m, st.v, st.p.numel(), s);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_size(int64_t n, const Args& a) {
  torch::manual_seed(0);
  const Tensor p0 = torch::randn({n}), g = torch::randn({n}) * 1e-2;
  for (int64_t threads : a.threads) {
    at::set_num_threads(static_cast<int>(threads));
    State unfused{p0.clone(), torch::zeros({n}), torch::zeros({n})};
    State fused{p0.clone(), torch::zeros({n}), torch::zeros({n})};
    std::vector<double> u_ms, f_ms;
    for (int64_t r = 0; r < a.warmup + a.reps; ++r) {
      const double u = time_ms(false, unfused, g, r + 1), f = time_ms(true, fused, g, r + 1);
      if (r < a.warmup) continue;
      u_ms.push_back(u);
      f_ms.push_back(f);
    }
    auto bits = [](const Tensor& t) { return t.view(at::kInt); };
    const bool same = torch::equal(bits(unfused.p), bits(fused.p)) && torch::equal(bits(unfused.m), bits(fused.m)) &&
                      torch::equal(bits(unfused.v), bits(fused.v));
    const double u = median(u_ms), f = median(f_ms);
    std::printf("| %10lld | %7lld | %10.2f | %8.2f | %6.2fx | %10.1f | %-9s |\n", (long long)n, (long long)threads, u, f,
                u / f, 28.0 * double(n) / (f * 1e6), same ? "yes" : "NO");
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::printf("AdamW step, flat fp32 buffer, all decayed; median of %lld after %lld warm-up, paths alternating\n",
              (long long)a.reps, (long long)a.warmup);
  std::printf("| N          | threads | unfused ms | fused ms | speedup | fused GB/s | same bits |\n");
  std::printf("|------------|---------|------------|----------|---------|------------|-----------|\n");
  for (int64_t n : a.sizes) run_size(n, a);
  return 0;
}

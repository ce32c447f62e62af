// Benchmark: fused RMSNorm, residual-add + RMSNorm and SwiGLU
// (norm_activation.h), and fused LayerNorm, residual-add + LayerNorm and tanh
// GELU (layer_norm_gelu.h), against their unfused ATen references, fp32,
// forward + backward.
//
// For each case (op, width, threads, path) the inputs are built once as leaves
// that require grad, with fixed random upstream gradients for every output
// (both outputs of add_rms_norm and add_layer_norm). One step is the forward call followed by
// torch::autograd::grad for all inputs. The time is the median of `reps`
// steps after `warmup` untimed ones.
//
// Memory kept for backward is given two ways:
//  - "saved MiB", by construction: the sum of the sizes of the distinct
//    tensors the graph saves, inputs and outputs included, counted from what
//    each op saves (see saved_bytes below);
//  - "graph MiB", measured: heap in use (glibc mallinfo2: uordblks + hblkhd)
//    after a forward with autograd minus after the same forward without it,
//    outputs alive in both. That is what the graph holds beyond the inputs and
//    outputs, and checks the first column's non-input, non-output part.
//
// Usage: bench_norm_activation [--rows 4096] [--norm-widths 384,2048]
//          [--glu-widths 1024,5632] [--ln-widths 128,384] [--gelu-widths 512,1536]
//          [--threads 1,2] [--reps 7] [--warmup 1]
//          [--ops rms_norm,add_rms_norm,swiglu,layer_norm,add_layer_norm,gelu_tanh]
// (--norm-widths and --glu-widths are RMSNorm's and SwiGLU's, --ln-widths
// LayerNorm's, --gelu-widths GELU's; --ops picks the ops, all by default).
#include <malloc.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "scaletrain/kernels/layer_norm_gelu.h"
#include "scaletrain/kernels/norm_activation.h"

namespace {

namespace k = scaletrain::kernels;
using torch::Tensor;

struct Args {
  int64_t rows = 4096;
  std::vector<int64_t> norm_widths{384, 2048};
  std::vector<int64_t> glu_widths{1024, 5632};
  std::vector<int64_t> ln_widths{128, 384};
  std::vector<int64_t> gelu_widths{512, 1536};
  std::vector<std::string> ops{"rms_norm", "add_rms_norm", "swiglu", "layer_norm", "add_layer_norm", "gelu_tanh"};
  std::vector<int64_t> threads{1, 2};
  int64_t reps = 7;
  int64_t warmup = 1;
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
    if (key == "--rows") a.rows = std::stoll(value);
    else if (key == "--norm-widths") a.norm_widths = split_ints(value);
    else if (key == "--glu-widths") a.glu_widths = split_ints(value);
    else if (key == "--ln-widths") a.ln_widths = split_ints(value);
    else if (key == "--gelu-widths") a.gelu_widths = split_ints(value);
    else if (key == "--ops") a.ops = split(value);
    else if (key == "--threads") a.threads = split_ints(value);
    else if (key == "--reps") a.reps = std::stoll(value);
    else if (key == "--warmup") a.warmup = std::stoll(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  return a;
}

constexpr double kEps = 1e-5;
constexpr double kMiB = 1024.0 * 1024.0;

enum class Op { kRmsNorm, kAddRmsNorm, kSwiglu, kLayerNorm, kAddLayerNorm, kGeluTanh };

const char* name(Op op) {
  switch (op) {
    case Op::kRmsNorm: return "rms_norm";
    case Op::kAddRmsNorm: return "add_rms_norm";
    case Op::kSwiglu: return "swiglu";
    case Op::kLayerNorm: return "layer_norm";
    case Op::kAddLayerNorm: return "add_layer_norm";
    default: return "gelu_tanh";
  }
}

bool is_add(Op op) { return op == Op::kAddRmsNorm || op == Op::kAddLayerNorm; }
bool is_layer_norm(Op op) { return op == Op::kLayerNorm || op == Op::kAddLayerNorm; }
bool is_activation(Op op) { return op == Op::kSwiglu || op == Op::kGeluTanh; }

// The outputs of one forward call.
std::vector<Tensor> forward(Op op, bool fused, const std::vector<Tensor>& in) {
  switch (op) {
    case Op::kRmsNorm:
      return {fused ? k::rms_norm(in[0], in[1], kEps) : k::rms_norm_unfused(in[0], in[1], kEps)};
    case Op::kAddRmsNorm: {
      auto o = fused ? k::add_rms_norm(in[0], in[1], in[2], kEps) : k::add_rms_norm_unfused(in[0], in[1], in[2], kEps);
      return {std::get<0>(o), std::get<1>(o)};
    }
    case Op::kSwiglu:
      return {fused ? k::swiglu(in[0], in[1]) : k::swiglu_unfused(in[0], in[1])};
    case Op::kLayerNorm:
      return {fused ? k::layer_norm(in[0], in[1], in[2], kEps) : k::layer_norm_unfused(in[0], in[1], in[2], kEps)};
    case Op::kAddLayerNorm: {
      auto o = fused ? k::add_layer_norm(in[0], in[1], in[2], in[3], kEps)
                     : k::add_layer_norm_unfused(in[0], in[1], in[2], in[3], kEps);
      return {std::get<0>(o), std::get<1>(o)};
    }
    default:
      return {fused ? k::gelu_tanh(in[0]) : k::gelu_tanh_unfused(in[0])};
  }
}

// Bytes autograd keeps for backward, fp32, by construction (N rows, width C),
// from the saved members of libtorch 1.13's generated autograd nodes
// (torch/csrc/autograd/generated/Functions.h):
//  rms_norm unfused: h = x.to(float) is x itself. PowBackward0 saves x;
//    MeanBackward1 saves its input, the [N, C] square; RsqrtBackward0 saves
//    its [N, 1] result; the product with rsqrt saves x and that result; the
//    weight product saves the weight and the normalised [N, C]:
//                                            3 N C + N + C floats.
//  rms_norm fused: x, rstd [N], weight:      N C + N + C floats.
//  add_rms_norm: the same with s = x + residual in place of x (the add saves
//    nothing); s is also an output.
//  swiglu unfused: silu saves gate, the product saves silu(gate) and up: 3 N C.
//  swiglu fused: gate and up:                2 N C.
//  layer_norm unfused: NativeLayerNormBackward0 saves x, weight, bias and
//    its [N, 1] mean and rstd:               N C + 2 N + 2 C floats.
//  layer_norm fused: x, weight, mean, rstd:  N C + 2 N + C floats.
//  add_layer_norm: the same with s = x + residual in place of x.
//  gelu_tanh, both: x:                       N C.
double saved_bytes(Op op, bool fused, int64_t n, int64_t c) {
  const double f = sizeof(float);
  const double nc = double(n) * c;
  if (op == Op::kSwiglu) return (fused ? 2 : 3) * nc * f;
  if (op == Op::kGeluTanh) return nc * f;
  if (is_layer_norm(op)) return (nc + 2.0 * n + (fused ? 1 : 2) * c) * f;
  return ((fused ? 1 : 3) * nc + n + c) * f;
}

double heap_in_use() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<double>(mi.uordblks + mi.hblkhd);
}

// Heap the graph of one forward holds beyond its inputs and outputs.
double graph_bytes(Op op, bool fused, const std::vector<Tensor>& in) {
  double without = 0, with = 0;
  {
    torch::NoGradGuard no_grad;
    const double base = heap_in_use();
    const auto out = forward(op, fused, in);
    without = heap_in_use() - base;
  }
  {
    const double base = heap_in_use();
    const auto out = forward(op, fused, in);
    with = heap_in_use() - base;
  }
  return with - without;
}

struct Timing {
  double median_ms = 0, min_ms = 0;
};

Timing time_steps(Op op, bool fused, const std::vector<Tensor>& in, const std::vector<Tensor>& ups, const Args& a) {
  auto step = [&] {
    const auto out = forward(op, fused, in);
    const auto grads = torch::autograd::grad(out, in, ups);
    return grads.size();
  };
  for (int64_t i = 0; i < a.warmup; ++i) step();
  std::vector<double> ms;
  for (int64_t i = 0; i < a.reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

void run_width(Op op, int64_t width, const Args& a) {
  torch::manual_seed(0);
  const int64_t n = a.rows;
  // x; the residual (add_*) or up (swiglu); the weight; the bias (LayerNorm).
  std::vector<Tensor> in{torch::randn({n, width}).requires_grad_(true)};
  if (is_add(op) || op == Op::kSwiglu) in.push_back(torch::randn({n, width}).requires_grad_(true));
  if (!is_activation(op)) in.push_back((1 + 0.1 * torch::randn({width})).requires_grad_(true));
  if (is_layer_norm(op)) in.push_back((0.1 * torch::randn({width})).requires_grad_(true));
  std::vector<Tensor> ups{torch::randn({n, width})};
  if (is_add(op)) ups.push_back(torch::randn({n, width}));

  for (int64_t threads : a.threads) {
    at::set_num_threads(static_cast<int>(threads));
    double unfused_ms = 0;
    for (bool fused : {false, true}) {
      const Timing t = time_steps(op, fused, in, ups, a);
      const double graph = graph_bytes(op, fused, in);
      if (!fused) unfused_ms = t.median_ms;
      char speedup[32] = "";
      if (fused) std::snprintf(speedup, sizeof speedup, "%.2fx", unfused_ms / t.median_ms);
      std::printf("| %-14s | %5lld | %7lld | %-7s | %9.2f | %9.2f | %7s | %9.1f | %9.1f |\n", name(op),
                  (long long)width, (long long)threads, fused ? "fused" : "unfused", t.median_ms, t.min_ms, speedup,
                  saved_bytes(op, fused, n, width) / kMiB, graph / kMiB);
      std::fflush(stdout);
    }
  }
}

// The widths --ops's op runs at.
const std::vector<int64_t>& widths_of(Op op, const Args& a) {
  if (op == Op::kSwiglu) return a.glu_widths;
  if (op == Op::kGeluTanh) return a.gelu_widths;
  return is_layer_norm(op) ? a.ln_widths : a.norm_widths;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const Op all[] = {Op::kRmsNorm, Op::kAddRmsNorm, Op::kSwiglu, Op::kLayerNorm, Op::kAddLayerNorm, Op::kGeluTanh};
  for (const auto& op : a.ops)
    if (std::none_of(std::begin(all), std::end(all), [&](Op o) { return op == name(o); })) {
      std::fprintf(stderr, "unknown op %s\n", op.c_str());
      return 2;
    }
  std::printf("rows=%lld, fp32, forward + backward (all inputs), median of %lld after %lld warm-up\n",
              (long long)a.rows, (long long)a.reps, (long long)a.warmup);
  std::printf("| op             | width | threads | path    | median ms | min ms    | speedup | saved MiB | graph MiB |\n");
  std::printf("|----------------|-------|---------|---------|-----------|-----------|---------|-----------|-----------|\n");
  for (Op op : all)
    if (std::find(a.ops.begin(), a.ops.end(), name(op)) != a.ops.end())
      for (int64_t c : widths_of(op, a)) run_width(op, c, a);
  return 0;
}

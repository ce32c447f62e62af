// Fused LayerNorm, residual-add + LayerNorm and tanh GELU on the CPU: the row
// and element kernels, their autograd wrappers, the unfused references, and
// the input checks both paths share.
//
// Note [LayerNorm and GELU kernels]
// LayerNorm of a row x of C values, with mu = sum(x) / C, the biased variance
// var = sum((x - mu)^2) / C, r = 1 / sqrt(var + eps) and xhat = (x - mu) r, is
// y = xhat w + b. Forward reads the row once for mu and twice more, from
// cache, for var (two passes rather than sum(x^2) - mu^2, which cancels for
// rows far from zero) and for y; it keeps mu and r per row. Each sum over a
// row is kept as 16 partial sums (row_sum), added in a fixed order at the
// end: a single running sum makes the vector loop one chain of dependent
// additions, whose latency bounds it (forward took 1.7x as long at C = 384).
// Backward, with
// g = w dy:
//   dx = r (g - mean(g) - xhat mean(g xhat)),
//   dw = sum over rows of dy xhat,   db = sum over rows of dy.
// dx needs the two sums of its row (two sweeps from cache) and one more sweep,
// which also adds the row's dy xhat and dy into the weight and bias sums.
// Those are sums over rows, which threads would otherwise race on. Rows are
// cut into blocks whose size depends only on the number of rows (never on
// the thread count); each block sums its rows in order into its own slices of
// two [blocks, C] buffers, and the slices are added in block order afterwards.
// dw and db are therefore the same bits for any number of threads (ATen's are
// not: its per-thread buffers follow the thread count).
//
// add_layer_norm first writes s = x + residual over the row (rounded to x's
// dtype, as ATen's add does) and normalises s from cache; it keeps s (an
// output, which the caller holds anyway) instead of x. Since d(x + residual)
// passes the gradient through unchanged, both inputs get dx_norm + ds, where
// ds is the gradient arriving at s.
//
// GELU (tanh approximation): with u = k (x + a x^3), k = sqrt(2/pi),
// a = 0.044715, 0.5 (1 + tanh(u)) = sigmoid(2u), so y = x s with s =
// sigmoid(2u), and
//   dy/dx = s + x 2 s (1 - s) u',   u' = k (1 + 3 a x^2).
// Backward recomputes s from the saved x. sigmoid_of (vec_math.h) builds the
// sigmoid from a polynomial exponential and integer masks, so the float loops
// vectorise (std::exp and std::tanh do not without -ffast-math); its relative
// error is about 1e-7. For |x| large, s saturates at 0 or 1 and y at 0 or x
// without overflow; no finite input below about 1e19 in magnitude gives NaN.
//
// Vector width. The project compiles for plain x86-64, whose SSE2 vectors
// hold 4 floats. The float kernels are compiled a second time for AVX2 (8
// floats; run_avx2), taken at run time on a CPU that has it: about 2x faster
// for GELU. That build leaves FMA out on purpose: without fused multiply-adds
// both builds perform the same IEEE operations on each element in the same
// order (the partial sums are fixed by row_sum, not by the vector width), so
// they give the same bits, and cancellations the formulas rely on stay exact
// (at C = 1, g - mean(g) is exactly 0, where fma(w, dy, -mean(g)) leaves the
// product's rounding error times r, 3e-5 at eps = 1e-5).
//
// Dtypes. weight and bias have x's dtype (ATen's CPU LayerNorm requires it).
// All arithmetic runs in float, or double for double input: bfloat16 and half
// are converted element by element as they are read, and results and
// gradients are rounded once, to x's dtype, as they are written. mu and r are
// kept in float (double for double input).
//
// Threads: at::parallel_for over rows (LayerNorm forward), row blocks
// (LayerNorm backward) or elements (GELU). Every output element is computed by
// exactly one thread from the same operands in the same order, so all results
// are independent of the thread count.
#include "scaletrain/kernels/layer_norm_gelu.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "scaletrain/kernels/checks.h"
#include "scaletrain/kernels/norm_activation.h"
#include "scaletrain/kernels/vec_math.h"
#include "scaletrain/util/error.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define SCALETRAIN_LN_GELU_X86 1
#else
#define SCALETRAIN_LN_GELU_X86 0
#endif

namespace scaletrain::kernels {
namespace {

using detail::sigmoid_of;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrainElements = 16384;  // elements per parallel_for chunk, at least
constexpr int64_t kMaxParamBlocks = 64;    // most row blocks of the weight and bias gradients
constexpr int64_t kMinBlockRows = 8;       // fewest rows per block
constexpr int64_t kLanes = 16;             // partial sums of a row reduction

constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

// Arithmetic dtype for input dtype X: double for double, else float.
template <typename X>
using acc_t = std::conditional_t<std::is_same_v<X, double>, double, float>;

using detail::check_floating;
using detail::dtype_of;
using detail::fail;
using detail::str;

// ---- checks ----------------------------------------------------------------

// weight or bias (`name`) against x [..., C].
void check_param(const char* op, const Tensor& x, const Tensor& p, const char* name) {
  const int64_t C = x.size(-1);
  if (p.dim() != 1 || p.size(0) != C)
    fail(op, std::string(name) + " must be [" + std::to_string(C) + "] to match x " + str(x.sizes()) + ", got " +
                 str(p.sizes()));
  if (p.scalar_type() != x.scalar_type())
    fail(op, std::string(name) + " (" + str(p.scalar_type()) + ") must have x's dtype (" + str(x.scalar_type()) + ")");
  if (p.device() != x.device())
    fail(op, std::string(name) + " is on " + str(p.device()) + " but x is on " + str(x.device()));
}

void check_norm(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  if (!x.defined() || !weight.defined() || !bias.defined()) fail(op, "x, weight and bias must be defined");
  if (x.dim() < 1) fail(op, "x must have at least one dimension, got a 0-dim tensor");
  check_floating(op, x, "x");
  if (x.size(-1) < 1) fail(op, "x " + str(x.sizes()) + " has an empty last dimension");
  check_param(op, x, weight, "weight");
  check_param(op, x, bias, "bias");
  if (!(eps > 0) || !std::isfinite(eps)) fail(op, "eps must be a finite number > 0, got " + str(eps));
}

void check_add_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps) {
  const char* op = "add_layer_norm";
  check_norm(op, x, weight, bias, eps);
  if (!residual.defined()) fail(op, "residual must be defined");
  if (residual.sizes() != x.sizes() || residual.scalar_type() != x.scalar_type())
    fail(op, "residual " + str(residual.sizes()) + " " + str(residual.scalar_type()) + " must match x " +
                 str(x.sizes()) + " " + str(x.scalar_type()) + " in shape and dtype");
  if (residual.device() != x.device())
    fail(op, "residual is on " + str(residual.device()) + " but x is on " + str(x.device()));
}

void check_gelu(const Tensor& x) {
  if (!x.defined()) fail("gelu_tanh", "x must be defined");
  check_floating("gelu_tanh", x, "x");
}

// ATen 1.13 implements neither LayerNorm nor GELU for half on the CPU.
bool needs_float_reference(const Tensor& x) { return x.scalar_type() == at::kHalf && x.device().is_cpu(); }

// ---- running the loops -----------------------------------------------------

#if SCALETRAIN_LN_GELU_X86
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// kernel(begin, end) compiled for AVX2 (without FMA: see the Note). The
// kernels' loops are forced inline, so they are vectorised here for 8 floats
// at a time.
template <typename Kernel>
__attribute__((target("avx2"))) void run_avx2(const Kernel& kernel, int64_t begin, int64_t end) {
  kernel(begin, end);
}
#endif

// kernel(begin, end), through run_avx2 for float on a CPU with AVX2, else as
// compiled for the project's target.
template <typename X, typename Kernel>
void run_range(const Kernel& kernel, int64_t begin, int64_t end) {
#if SCALETRAIN_LN_GELU_X86
  if constexpr (std::is_same_v<X, float>)
    if (has_avx2()) return run_avx2(kernel, begin, end);
#endif
  kernel(begin, end);
}

// ---- LayerNorm rows --------------------------------------------------------

// The sum of term(c) over c < C, in A, kept as kLanes partial sums so that the
// vectorised loop runs several independent chains of additions rather than
// one (whose latency would bound it), then added in a fixed order.
template <typename A, typename Term>
C10_ALWAYS_INLINE A row_sum(int64_t C, const Term& term) {
  A part[kLanes] = {};
  const int64_t body = C - C % kLanes;
  for (int64_t c = 0; c < body; c += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) part[j] += term(c + j);
  }
  for (int64_t c = body; c < C; ++c) part[c - body] += term(c);
  A total = 0;
  for (int64_t j = 0; j < kLanes; ++j) total += part[j];
  return total;
}

// Forward over rows [begin, end) of C values. With `res` set, first writes
// sum = x + res (in X) and normalises that; y, mean and rstd are always
// written. w and b are in the arithmetic dtype A.
template <typename X, typename A = acc_t<X>>
struct LnForwardRows {
  const X* x;
  const X* res;
  X* sum;
  const A* w;
  const A* b;
  X* y;
  A* mean;
  A* rstd;
  int64_t C;
  A eps;

  C10_ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    for (int64_t i = begin; i < end; ++i) {
      const X* src = x + i * C;
      if (res != nullptr) {
        const X* ri = res + i * C;
        X* si = sum + i * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) si[c] = static_cast<X>(static_cast<A>(src[c]) + static_cast<A>(ri[c]));
        src = si;
      }
      const A mu = row_sum<A>(C, [&](int64_t c) { return static_cast<A>(src[c]); }) / static_cast<A>(C);
      const A squares = row_sum<A>(C, [&](int64_t c) {
        const A d = static_cast<A>(src[c]) - mu;
        return d * d;
      });
      const A r = A(1) / std::sqrt(squares / static_cast<A>(C) + eps);
      mean[i] = mu;
      rstd[i] = r;
      X* yi = y + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yi[c] = static_cast<X>((static_cast<A>(src[c]) - mu) * r * w[c] + b[c]);
    }
  }
};

// Rows per block of the weight and bias gradients: depends on `rows` only.
int64_t param_block_rows(int64_t rows) {
  return std::max(kMinBlockRows, (rows + kMaxParamBlocks - 1) / kMaxParamBlocks);
}

int64_t param_blocks(int64_t rows) { return (rows + param_block_rows(rows) - 1) / param_block_rows(rows); }

// Backward over row blocks [b_begin, b_end). dx (may be null) gets the input
// gradient, plus ds when ds is set; dw_parts and db_parts (both null or both
// set) are zeroed [blocks, C] buffers that receive each block's share of the
// weight and bias gradients.
template <typename X, typename A = acc_t<X>>
struct LnBackwardBlocks {
  const X* x;
  const X* dy;
  const X* ds;
  const A* mean;
  const A* rstd;
  const A* w;
  X* dx;
  A* dw_parts;
  A* db_parts;
  int64_t rows, C;

  C10_ALWAYS_INLINE void operator()(int64_t b_begin, int64_t b_end) const {
    const int64_t block = param_block_rows(rows);
    for (int64_t b = b_begin; b < b_end; ++b) {
      A* pw = dw_parts != nullptr ? dw_parts + b * C : nullptr;
      A* pb = db_parts != nullptr ? db_parts + b * C : nullptr;
      for (int64_t i = b * block; i < std::min(rows, (b + 1) * block); ++i) row(i, pw, pb);
    }
  }

  // One row: the two sums of dx (if wanted), then one sweep that writes dx
  // and adds the row's share to pw and pb (if set).
  C10_ALWAYS_INLINE void row(int64_t i, A* pw, A* pb) const {
    const X* xi = x + i * C;
    const X* gi = dy + i * C;
    const A mu = mean[i], r = rstd[i];
    auto xhat = [&](int64_t c) { return (static_cast<A>(xi[c]) - mu) * r; };
    if (dx == nullptr) {
      if (pw == nullptr) return;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        pw[c] += static_cast<A>(gi[c]) * xhat(c);
        pb[c] += static_cast<A>(gi[c]);
      }
      return;
    }
    const A mean_g = row_sum<A>(C, [&](int64_t c) { return w[c] * static_cast<A>(gi[c]); }) / static_cast<A>(C);
    const A mean_gx =
        row_sum<A>(C, [&](int64_t c) { return w[c] * static_cast<A>(gi[c]) * xhat(c); }) / static_cast<A>(C);
    const X* dsi = ds != nullptr ? ds + i * C : nullptr;
    X* dxi = dx + i * C;
    auto input_grad = [&](int64_t c) {
      const A extra = dsi != nullptr ? static_cast<A>(dsi[c]) : A(0);
      return static_cast<X>(r * (w[c] * static_cast<A>(gi[c]) - mean_g - xhat(c) * mean_gx) + extra);
    };
    if (pw == nullptr) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxi[c] = input_grad(c);
      return;
    }
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      dxi[c] = input_grad(c);
      pw[c] += static_cast<A>(gi[c]) * xhat(c);
      pb[c] += static_cast<A>(gi[c]);
    }
  }
};

// Adds the [blocks, C] partial sums in block order into a [C] tensor of
// dtype `out`.
template <typename A>
Tensor reduce_blocks(const Tensor& parts, at::ScalarType out) {
  const int64_t blocks = parts.size(0), C = parts.size(1);
  auto sum = at::zeros({C}, parts.options());
  A* s = sum.data_ptr<A>();
  const A* p = parts.data_ptr<A>();
  for (int64_t b = 0; b < blocks; ++b) {
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) s[c] += p[b * C + c];
  }
  return sum.to(out);
}

struct NormForward {
  Tensor y, sum, mean, rstd;  // sum only for add_layer_norm
};

// x (and residual) contiguous and checked.
NormForward ln_forward(const Tensor& x, const Tensor& residual, const Tensor& weight, const Tensor& bias, double eps) {
  const int64_t C = x.size(-1);
  const int64_t rows = x.numel() / C;
  NormForward f;
  f.y = at::empty(x.sizes(), x.options());
  if (residual.defined()) f.sum = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_forward", [&] {
    using A = acc_t<scalar_t>;
    f.mean = at::empty({rows}, x.options().dtype(dtype_of<A>()));
    f.rstd = at::empty({rows}, x.options().dtype(dtype_of<A>()));
    const Tensor w = weight.to(dtype_of<A>()).contiguous();
    const Tensor b = bias.to(dtype_of<A>()).contiguous();
    const LnForwardRows<scalar_t> kernel{x.data_ptr<scalar_t>(),
                                         residual.defined() ? residual.data_ptr<scalar_t>() : nullptr,
                                         f.sum.defined() ? f.sum.data_ptr<scalar_t>() : nullptr,
                                         w.data_ptr<A>(),
                                         b.data_ptr<A>(),
                                         f.y.data_ptr<scalar_t>(),
                                         f.mean.data_ptr<A>(),
                                         f.rstd.data_ptr<A>(),
                                         C,
                                         static_cast<A>(eps)};
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / C),
                     [&](int64_t begin, int64_t end) { run_range<scalar_t>(kernel, begin, end); });
  });
  return f;
}

struct NormGrads {
  Tensor dx, dw, db;
};

// x: the saved (contiguous) normalised input; dy: gradient of y; ds: gradient
// of the sum for add_layer_norm, else undefined.
NormGrads ln_backward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                      const Tensor& dy_in, const Tensor& ds_in, bool want_x, bool want_w, bool want_b) {
  const int64_t C = x.size(-1);
  const int64_t rows = x.numel() / C;
  const auto type = x.scalar_type();
  const auto dy = dy_in.to(type).contiguous();
  const auto ds = ds_in.defined() ? ds_in.to(type).contiguous() : ds_in;
  const bool want_params = want_w || want_b;  // both are formed when either is wanted
  NormGrads g;
  if (want_x) g.dx = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "layer_norm_backward", [&] {
    using A = acc_t<scalar_t>;
    const Tensor w = weight.to(dtype_of<A>()).contiguous();
    const auto part_options = x.options().dtype(dtype_of<A>());
    const Tensor dw_parts = want_params ? at::zeros({param_blocks(rows), C}, part_options) : Tensor();
    const Tensor db_parts = want_params ? at::zeros({param_blocks(rows), C}, part_options) : Tensor();
    const LnBackwardBlocks<scalar_t> kernel{x.data_ptr<scalar_t>(),
                                            dy.data_ptr<scalar_t>(),
                                            ds.defined() ? ds.data_ptr<scalar_t>() : nullptr,
                                            mean.data_ptr<A>(),
                                            rstd.data_ptr<A>(),
                                            w.data_ptr<A>(),
                                            want_x ? g.dx.data_ptr<scalar_t>() : nullptr,
                                            want_params ? dw_parts.data_ptr<A>() : nullptr,
                                            want_params ? db_parts.data_ptr<A>() : nullptr,
                                            rows,
                                            C};
    const int64_t grain = std::max<int64_t>(1, kGrainElements / (C * param_block_rows(rows)));
    at::parallel_for(0, param_blocks(rows), grain,
                     [&](int64_t begin, int64_t end) { run_range<scalar_t>(kernel, begin, end); });
    if (want_w) g.dw = reduce_blocks<A>(dw_parts, weight.scalar_type());
    if (want_b) g.db = reduce_blocks<A>(db_parts, weight.scalar_type());
  });
  return g;
}

// ---- GELU elements ---------------------------------------------------------

// y = x sigmoid(2u) over elements [begin, end); u = k (x + a x^3) is
// computed as k x (1 + a x^2).
template <typename X>
struct GeluForward {
  const X* x;
  X* y;

  C10_ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    using A = acc_t<X>;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A v = static_cast<A>(x[i]);
      const A two_u = A(2 * kGeluK) * v * (A(1) + A(kGeluA) * v * v);
      y[i] = static_cast<X>(v * sigmoid_of(two_u));
    }
  }
};

// dx = dy (s + 2 x s (1 - s) u') over elements [begin, end).
template <typename X>
struct GeluBackward {
  const X* x;
  const X* dy;
  X* dx;

  C10_ALWAYS_INLINE void operator()(int64_t begin, int64_t end) const {
    using A = acc_t<X>;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A v = static_cast<A>(x[i]);
      const A v2 = v * v;
      const A s = sigmoid_of(A(2 * kGeluK) * v * (A(1) + A(kGeluA) * v2));
      const A du = A(kGeluK) * (A(1) + A(3 * kGeluA) * v2);
      dx[i] = static_cast<X>(static_cast<A>(dy[i]) * (s + A(2) * v * s * (A(1) - s) * du));
    }
  }
};

template <typename X, typename Kernel>
void run_elements(const Kernel& kernel, int64_t n) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) { run_range<X>(kernel, begin, end); });
}

// ---- autograd --------------------------------------------------------------

struct LayerNormFn : public torch::autograd::Function<LayerNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
    const auto xc = x.contiguous();
    auto f = ln_forward(xc, Tensor(), weight, bias, eps);
    ctx->save_for_backward({xc, weight, f.mean, f.rstd});
    return f.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto g = ln_backward(saved[0], saved[1], saved[2], saved[3], grads[0], Tensor(), ctx->needs_input_grad(0),
                         ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    return {g.dx, g.dw, g.db, Tensor()};
  }
};

// Saves the sum s (an output) instead of x and residual.
struct AddLayerNormFn : public torch::autograd::Function<AddLayerNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               const Tensor& bias, double eps) {
    auto f = ln_forward(x.contiguous(), residual.contiguous(), weight, bias, eps);
    ctx->save_for_backward({f.sum, weight, f.mean, f.rstd});
    return {f.y, f.sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool want_x = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    auto g = ln_backward(saved[0], saved[1], saved[2], saved[3], grads[0], grads[1], want_x, ctx->needs_input_grad(2),
                         ctx->needs_input_grad(3));
    return {ctx->needs_input_grad(0) ? g.dx : Tensor(), ctx->needs_input_grad(1) ? g.dx : Tensor(), g.dw, g.db,
            Tensor()};
  }
};

struct GeluTanhFn : public torch::autograd::Function<GeluTanhFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    const auto xc = x.contiguous();
    auto y = at::empty(xc.sizes(), xc.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "gelu_tanh_forward", [&] {
      run_elements<scalar_t>(GeluForward<scalar_t>{xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>()}, xc.numel());
    });
    ctx->save_for_backward({xc});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    const auto dy = grads[0].to(x.scalar_type()).contiguous();
    auto dx = at::empty(x.sizes(), x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_tanh_backward", [&] {
      const GeluBackward<scalar_t> kernel{x.data_ptr<scalar_t>(), dy.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>()};
      run_elements<scalar_t>(kernel, x.numel());
    });
    return {dx};
  }
};

// torch::layer_norm over the last dim; checked input.
Tensor reference_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  if (needs_float_reference(x))
    return reference_layer_norm(x.to(at::kFloat), weight.to(at::kFloat), bias.to(at::kFloat), eps).to(at::kHalf);
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps);
}

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  if (!fused_norm_activation_applies(x)) return layer_norm_unfused(x, weight, bias, eps);
  check_norm("layer_norm", x, weight, bias, eps);
  return LayerNormFn::apply(x, weight, bias, eps);
}

std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                          const Tensor& bias, double eps) {
  if (!fused_norm_activation_applies(x)) return add_layer_norm_unfused(x, residual, weight, bias, eps);
  check_add_norm(x, residual, weight, bias, eps);
  auto out = AddLayerNormFn::apply(x, residual, weight, bias, eps);
  return {out[0], out[1]};
}

Tensor gelu_tanh(const Tensor& x) {
  if (!fused_norm_activation_applies(x)) return gelu_tanh_unfused(x);
  check_gelu(x);
  return GeluTanhFn::apply(x);
}

Tensor layer_norm_unfused(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_norm("layer_norm", x, weight, bias, eps);
  return reference_layer_norm(x, weight, bias, eps);
}

std::tuple<Tensor, Tensor> add_layer_norm_unfused(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                                  const Tensor& bias, double eps) {
  check_add_norm(x, residual, weight, bias, eps);
  auto s = x + residual;
  return {reference_layer_norm(s, weight, bias, eps), s};
}

Tensor gelu_tanh_unfused(const Tensor& x) {
  check_gelu(x);
  if (needs_float_reference(x)) return torch::gelu(x.to(at::kFloat), "tanh").to(at::kHalf);
  return torch::gelu(x, "tanh");
}

}  // namespace scaletrain::kernels

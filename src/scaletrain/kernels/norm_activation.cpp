// Fused RMSNorm, residual-add + RMSNorm and SwiGLU on the CPU: the row and
// element kernels, their autograd wrappers, the unfused references, and the
// input checks both paths share.
//
// Note [Norm and activation kernels]
// RMSNorm of a row x of C values, with r = 1 / sqrt(sum(x^2) / C + eps) and
// xhat = x r, is y = round(xhat) w, where round() casts back to x's dtype (a
// no-op for float and double; it is what models/llama.cpp's RMSNorm does for
// 16-bit inputs). Forward reads the row once for the sum of squares and once
// more, from cache, for y; it keeps r per row. Backward, with g = w dy:
//   dx = r (g - xhat mean(g xhat)),   dw = sum over rows of dy round(xhat).
// The first needs one dot product per row and then one more sweep; the
// second is a sum over rows, which threads would otherwise race on. Rows are
// cut into blocks whose size depends only on the number of rows (never on the
// thread count); each block sums its rows in order into its own slice of a
// [blocks, C] buffer, and the slices are added in block order afterwards. The
// weight gradient is therefore the same bits for any number of threads.
//
// add_rms_norm forms s = x + residual in the same sweep as the sum of squares
// and keeps s (an output, which the caller holds anyway) instead of x. Since
// d(x + residual) passes the gradient through unchanged, both inputs get
// dx_norm + ds, where ds is the gradient arriving at s.
//
// SwiGLU, y = g sigmoid(g) u, keeps g and u and recomputes sigmoid(g) in
// backward: dg = dy u s (1 + g (1 - s)), du = dy g s with s = sigmoid(g).
// The float exponential is a short polynomial (exp_neg in vec_math.h) that
// the compiler vectorises; std::exp does not vectorise without -ffast-math.
// Its relative error is about 1e-7, at the level of float rounding.
//
// Dtypes. The normalisation runs in float, or double for double input. The
// product with the weight and all of backward run in double when the result
// is double (x or weight double), else in float. bfloat16 and half are
// converted element by element as they are read; results and gradients are
// written in the dtypes of the tensors they belong to.
//
// Threads: at::parallel_for over rows (RMSNorm) or elements (SwiGLU). Every
// output element is computed by exactly one thread from the same operands in
// the same order, so all results are independent of the thread count.
#include "scaletrain/kernels/norm_activation.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "scaletrain/kernels/checks.h"
#include "scaletrain/kernels/vec_math.h"
#include "scaletrain/util/error.h"

namespace scaletrain::kernels {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrainElements = 16384;  // elements per parallel_for chunk, at least
constexpr int64_t kMaxWeightBlocks = 64;   // most row blocks of the weight gradient
constexpr int64_t kMinBlockRows = 8;       // fewest rows per block

// ---- dtypes ----------------------------------------------------------------

// Dtype of the normalisation for input dtype X.
template <typename X>
using norm_t = std::conditional_t<std::is_same_v<X, double>, double, float>;
// Dtype of the weight product and of backward for result dtype O.
template <typename O>
using math_t = std::conditional_t<std::is_same_v<O, double>, double, float>;

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<X>, Tag<O>) for input dtype `in` and result dtype `out`, where
// out is `in`, float or double (the only results promote_types can give).
template <typename X, typename F>
void with_result_type(at::ScalarType out, const F& f) {
  if (out == c10::CppTypeToScalarType<X>::value) return f(Tag<X>{}, Tag<X>{});
  if (out == at::kFloat) return f(Tag<X>{}, Tag<float>{});
  if (out == at::kDouble) return f(Tag<X>{}, Tag<double>{});
  throw std::logic_error("norm_activation: no kernel for result dtype " + std::string(c10::toString(out)));
}

template <typename F>
void with_types(at::ScalarType in, at::ScalarType out, const F& f) {
  switch (in) {
    case at::kFloat: return with_result_type<float>(out, f);
    case at::kDouble: return with_result_type<double>(out, f);
    case at::kBFloat16: return with_result_type<c10::BFloat16>(out, f);
    case at::kHalf: return with_result_type<c10::Half>(out, f);
    default: throw std::logic_error("norm_activation: no kernel for dtype " + std::string(c10::toString(in)));
  }
}

using detail::check_floating;
using detail::dtype_of;
using detail::fail;
using detail::str;

// ---- checks ----------------------------------------------------------------

void check_norm(const char* op, const Tensor& x, const Tensor& weight, double eps) {
  if (!x.defined() || !weight.defined()) fail(op, "x and weight must be defined");
  if (x.dim() < 1) fail(op, "x must have at least one dimension, got a 0-dim tensor");
  check_floating(op, x, "x");
  check_floating(op, weight, "weight");
  const int64_t C = x.size(-1);
  if (C < 1) fail(op, "x " + str(x.sizes()) + " has an empty last dimension");
  if (weight.dim() != 1 || weight.size(0) != C)
    fail(op, "weight must be [" + std::to_string(C) + "] to match x " + str(x.sizes()) + ", got " +
                 str(weight.sizes()));
  if (weight.device() != x.device())
    fail(op, "weight is on " + str(weight.device()) + " but x is on " + str(x.device()));
  if (!(eps > 0) || !std::isfinite(eps)) fail(op, "eps must be a finite number > 0, got " + str(eps));
}

void check_add_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm";
  check_norm(op, x, weight, eps);
  if (!residual.defined()) fail(op, "residual must be defined");
  if (residual.sizes() != x.sizes() || residual.scalar_type() != x.scalar_type())
    fail(op, "residual " + str(residual.sizes()) + " " + str(residual.scalar_type()) + " must match x " +
                 str(x.sizes()) + " " + str(x.scalar_type()) + " in shape and dtype");
  if (residual.device() != x.device())
    fail(op, "residual is on " + str(residual.device()) + " but x is on " + str(x.device()));
}

void check_swiglu(const Tensor& gate, const Tensor& up) {
  const char* op = "swiglu";
  if (!gate.defined() || !up.defined()) fail(op, "gate and up must be defined");
  check_floating(op, gate, "gate");
  check_floating(op, up, "up");
  if (gate.sizes() != up.sizes())
    fail(op, "gate " + str(gate.sizes()) + " and up " + str(up.sizes()) + " must have the same shape");
  if (gate.scalar_type() != up.scalar_type())
    fail(op, "gate (" + str(gate.scalar_type()) + ") and up (" + str(up.scalar_type()) + ") must have the same dtype");
  if (gate.device() != up.device())
    fail(op, "gate is on " + str(gate.device()) + " but up is on " + str(up.device()));
}

// ---- RMSNorm rows ----------------------------------------------------------

// round(xhat) as forward computes it, in the math dtype M.
template <typename X, typename M>
C10_ALWAYS_INLINE M rounded_xhat(X v, norm_t<X> r) {
  return static_cast<M>(static_cast<X>(static_cast<norm_t<X>>(v) * r));
}

// Forward over `rows` rows of C values. With `res` set, first writes
// sum = x + res (in X) and normalises that; y and rstd are always written.
template <typename X, typename O>
void rms_forward_rows(const X* x, const X* res, X* sum, const math_t<O>* w, O* y, norm_t<X>* rstd, int64_t rows,
                      int64_t C, double eps) {
  using A = norm_t<X>;
  using M = math_t<O>;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / C);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const X* src = x + i * C;
      A squares = 0;
      if (res != nullptr) {
        const X* ri = res + i * C;
        X* si = sum + i * C;
#pragma omp simd reduction(+ : squares)
        for (int64_t c = 0; c < C; ++c) {
          const X s = static_cast<X>(static_cast<A>(src[c]) + static_cast<A>(ri[c]));
          si[c] = s;
          squares += static_cast<A>(s) * static_cast<A>(s);
        }
        src = si;
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t c = 0; c < C; ++c) squares += static_cast<A>(src[c]) * static_cast<A>(src[c]);
      }
      const A r = A(1) / std::sqrt(squares / static_cast<A>(C) + static_cast<A>(eps));
      rstd[i] = r;
      O* yi = y + i * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yi[c] = static_cast<O>(rounded_xhat<X, M>(src[c], r) * w[c]);
    }
  });
}

// Rows per block of the weight gradient: depends on `rows` only.
int64_t weight_block_rows(int64_t rows) {
  return std::max(kMinBlockRows, (rows + kMaxWeightBlocks - 1) / kMaxWeightBlocks);
}

// Backward over the rows. dx (may be null) gets the input gradient, plus ds
// when ds is set; dw_parts (may be null) is a zeroed [blocks, C] buffer that
// receives each block's share of the weight gradient.
template <typename X, typename O>
void rms_backward_rows(const X* x, const O* dy, const X* ds, const norm_t<X>* rstd, const math_t<O>* w, X* dx,
                       math_t<O>* dw_parts, int64_t rows, int64_t C) {
  using M = math_t<O>;
  const int64_t block = weight_block_rows(rows);
  const int64_t blocks = (rows + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / (C * block));
  at::parallel_for(0, blocks, grain, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      M* part = dw_parts != nullptr ? dw_parts + b * C : nullptr;
      for (int64_t i = b * block; i < std::min(rows, (b + 1) * block); ++i) {
        const X* xi = x + i * C;
        const O* gi = dy + i * C;
        const M r = static_cast<M>(rstd[i]);
        if (dx != nullptr) {
          M dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < C; ++c) dot += w[c] * static_cast<M>(gi[c]) * (static_cast<M>(xi[c]) * r);
          const M mean = dot / static_cast<M>(C);
          X* dxi = dx + i * C;
          const X* dsi = ds != nullptr ? ds + i * C : nullptr;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) {
            const M xhat = static_cast<M>(xi[c]) * r;
            const M extra = dsi != nullptr ? static_cast<M>(dsi[c]) : M(0);
            dxi[c] = static_cast<X>(r * (w[c] * static_cast<M>(gi[c]) - xhat * mean) + extra);
          }
        }
        if (part != nullptr) {
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) part[c] += static_cast<M>(gi[c]) * rounded_xhat<X, M>(xi[c], rstd[i]);
        }
      }
    }
  });
}

// Adds the [blocks, C] partial sums in block order.
template <typename M>
void reduce_blocks(const M* parts, M* out, int64_t blocks, int64_t C) {
  std::fill(out, out + C, M(0));
  for (int64_t b = 0; b < blocks; ++b) {
    const M* p = parts + b * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] += p[c];
  }
}

struct NormForward {
  Tensor y, sum, rstd;  // sum only for add_rms_norm
};

// x (and residual) contiguous and checked.
NormForward rms_forward(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  const int64_t C = x.size(-1);
  const int64_t rows = x.numel() / C;
  const auto in = x.scalar_type();
  const auto out = at::promote_types(in, weight.scalar_type());
  NormForward f;
  f.y = at::empty(x.sizes(), x.options().dtype(out));
  f.rstd = at::empty({rows}, x.options().dtype(in == at::kDouble ? at::kDouble : at::kFloat));
  if (residual.defined()) f.sum = at::empty(x.sizes(), x.options());
  with_types(in, out, [&](auto xt, auto ot) {
    using X = typename decltype(xt)::type;
    using O = typename decltype(ot)::type;
    using M = math_t<O>;
    const Tensor w = weight.to(dtype_of<M>()).contiguous();
    rms_forward_rows<X, O>(x.data_ptr<X>(), residual.defined() ? residual.data_ptr<X>() : nullptr,
                           f.sum.defined() ? f.sum.data_ptr<X>() : nullptr, w.data_ptr<M>(), f.y.data_ptr<O>(),
                           f.rstd.data_ptr<norm_t<X>>(), rows, C, eps);
  });
  return f;
}

struct NormGrads {
  Tensor dx, dw;
};

// x: the saved (contiguous) normalised input; dy: gradient of y; ds: gradient
// of the sum for add_rms_norm, else undefined.
NormGrads rms_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy_in,
                       const Tensor& ds_in, bool want_x, bool want_w) {
  const int64_t C = x.size(-1);
  const int64_t rows = x.numel() / C;
  const auto in = x.scalar_type();
  const auto out = at::promote_types(in, weight.scalar_type());
  const auto dy = dy_in.to(out).contiguous();
  const auto ds = ds_in.defined() ? ds_in.to(in).contiguous() : ds_in;
  NormGrads g;
  if (want_x) g.dx = at::empty(x.sizes(), x.options());
  with_types(in, out, [&](auto xt, auto ot) {
    using X = typename decltype(xt)::type;
    using O = typename decltype(ot)::type;
    using M = math_t<O>;
    const Tensor w = weight.to(dtype_of<M>()).contiguous();
    const int64_t blocks = (rows + weight_block_rows(rows) - 1) / weight_block_rows(rows);
    Tensor parts;
    if (want_w) parts = at::zeros({blocks, C}, x.options().dtype(dtype_of<M>()));
    rms_backward_rows<X, O>(x.data_ptr<X>(), dy.data_ptr<O>(), ds.defined() ? ds.data_ptr<X>() : nullptr,
                            rstd.data_ptr<norm_t<X>>(), w.data_ptr<M>(), want_x ? g.dx.data_ptr<X>() : nullptr,
                            want_w ? parts.data_ptr<M>() : nullptr, rows, C);
    if (want_w) {
      auto dw = at::empty({C}, parts.options());
      reduce_blocks<M>(parts.data_ptr<M>(), dw.data_ptr<M>(), blocks, C);
      g.dw = dw.to(weight.scalar_type());
    }
  });
  return g;
}

// ---- SwiGLU elements -------------------------------------------------------

// sigmoid_of (float and double) is in vec_math.h.
using detail::sigmoid_of;

template <typename X>
void swiglu_forward_elements(const X* gate, const X* up, X* y, int64_t n) {
  using A = norm_t<X>;
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A g = static_cast<A>(gate[i]);
      y[i] = static_cast<X>(g * sigmoid_of(g) * static_cast<A>(up[i]));
    }
  });
}

// One loop per combination of wanted gradients, so none of them branches.
template <typename X, bool kGate, bool kUp>
void swiglu_backward_elements(const X* gate, const X* up, const X* dy, X* dgate, X* dup, int64_t n) {
  using A = norm_t<X>;
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A g = static_cast<A>(gate[i]);
      const A d = static_cast<A>(dy[i]);
      const A s = sigmoid_of(g);
      if constexpr (kGate) dgate[i] = static_cast<X>(d * static_cast<A>(up[i]) * (s * (A(1) + g * (A(1) - s))));
      if constexpr (kUp) dup[i] = static_cast<X>(d * g * s);
    }
  });
}

// ---- autograd --------------------------------------------------------------

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, double eps) {
    const auto xc = x.contiguous();
    auto f = rms_forward(xc, Tensor(), weight, eps);
    ctx->save_for_backward({xc, weight, f.rstd});
    return f.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto g = rms_backward(saved[0], saved[1], saved[2], grads[0], Tensor(), ctx->needs_input_grad(0),
                          ctx->needs_input_grad(1));
    return {g.dx, g.dw, Tensor()};
  }
};

// Saves the sum s (an output) instead of x and residual.
struct AddRmsNormFn : public torch::autograd::Function<AddRmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& weight,
                               double eps) {
    auto f = rms_forward(x.contiguous(), residual.contiguous(), weight, eps);
    ctx->save_for_backward({f.sum, weight, f.rstd});
    return {f.y, f.sum};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool want_x = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
    auto g = rms_backward(saved[0], saved[1], saved[2], grads[0], grads[1], want_x, ctx->needs_input_grad(2));
    return {ctx->needs_input_grad(0) ? g.dx : Tensor(), ctx->needs_input_grad(1) ? g.dx : Tensor(), g.dw, Tensor()};
  }
};

struct SwigluFn : public torch::autograd::Function<SwigluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up) {
    const auto g = gate.contiguous();
    const auto u = up.contiguous();
    auto y = at::empty(g.sizes(), g.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "swiglu_forward", [&] {
      swiglu_forward_elements<scalar_t>(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                        g.numel());
    });
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& g = saved[0];
    const auto& u = saved[1];
    const bool want_g = ctx->needs_input_grad(0), want_u = ctx->needs_input_grad(1);
    const auto dy = grads[0].to(g.scalar_type()).contiguous();
    Tensor dg = want_g ? at::empty(g.sizes(), g.options()) : Tensor();
    Tensor du = want_u ? at::empty(g.sizes(), g.options()) : Tensor();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "swiglu_backward", [&] {
      const scalar_t* gp = g.data_ptr<scalar_t>();
      const scalar_t* up = u.data_ptr<scalar_t>();
      const scalar_t* dyp = dy.data_ptr<scalar_t>();
      scalar_t* dgp = want_g ? dg.data_ptr<scalar_t>() : nullptr;
      scalar_t* dup = want_u ? du.data_ptr<scalar_t>() : nullptr;
      if (want_g && want_u) swiglu_backward_elements<scalar_t, true, true>(gp, up, dyp, dgp, dup, g.numel());
      else if (want_g) swiglu_backward_elements<scalar_t, true, false>(gp, up, dyp, dgp, dup, g.numel());
      else if (want_u) swiglu_backward_elements<scalar_t, false, true>(gp, up, dyp, dgp, dup, g.numel());
    });
    return {dg, du};
  }
};

// models/llama.cpp's RMSNorm, operation for operation.
Tensor reference_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const auto in = x.scalar_type();
  auto h = x.to(in == at::kDouble ? at::kDouble : at::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(in);
}

}  // namespace

bool fused_norm_activation_applies(const torch::Tensor& x) {
  if (!x.defined() || !x.device().is_cpu() || x.layout() != torch::kStrided) return false;
  const auto t = x.scalar_type();
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  if (!fused_norm_activation_applies(x)) return rms_norm_unfused(x, weight, eps);
  check_norm("rms_norm", x, weight, eps);
  return RmsNormFn::apply(x, weight, eps);
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  if (!fused_norm_activation_applies(x)) return add_rms_norm_unfused(x, residual, weight, eps);
  check_add_norm(x, residual, weight, eps);
  auto out = AddRmsNormFn::apply(x, residual, weight, eps);
  return {out[0], out[1]};
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  if (!fused_norm_activation_applies(gate)) return swiglu_unfused(gate, up);
  check_swiglu(gate, up);
  return SwigluFn::apply(gate, up);
}

Tensor rms_norm_unfused(const Tensor& x, const Tensor& weight, double eps) {
  check_norm("rms_norm", x, weight, eps);
  return reference_rms_norm(x, weight, eps);
}

std::tuple<Tensor, Tensor> add_rms_norm_unfused(const Tensor& x, const Tensor& residual, const Tensor& weight,
                                                double eps) {
  check_add_norm(x, residual, weight, eps);
  auto s = x + residual;
  return {reference_rms_norm(s, weight, eps), s};
}

Tensor swiglu_unfused(const Tensor& gate, const Tensor& up) {
  check_swiglu(gate, up);
  return torch::silu(gate) * up;
}

}  // namespace scaletrain::kernels

#pragma once
// Fused RMSNorm (optionally with the residual add in front of it) and fused
// SwiGLU for the CPU, forward and backward.
//
// Built from ATen ops, RMSNorm is five passes over the activations (square,
// mean, scale, cast, weight) and autograd keeps the normalized tensor alive
// for the weight's gradient, next to the input it keeps anyway; SwiGLU keeps
// silu(gate) next to gate and up. The fused kernels make one trip through
// memory per row in each direction and save only what backward cannot cheaply
// rebuild: RMSNorm keeps its input (for add_rms_norm the sum, which is an
// output the caller holds anyway) and one reciprocal RMS per row; SwiGLU
// keeps gate and up and recomputes the sigmoid. See Note [Norm and activation
// kernels] in the .cpp file for the arithmetic, the dtypes and the threading.
//
// The `_unfused` functions are the same contracts as plain ATen ops. They are
// the reference for the tests and the path taken for tensors the fused
// kernels do not handle (CUDA and every other device, non-strided layouts;
// see `fused_norm_activation_applies`). Both paths validate their input the
// same way and throw scaletrain::UsageError with a one-line message.
//
// The fused functions are differentiable to first order (backward is not
// itself differentiable).
#include <torch/torch.h>

#include <tuple>

namespace scaletrain::kernels {

// True when the fused CPU kernels take this tensor: defined, on the CPU,
// strided, and float, double, bfloat16 or half. False sends a call to the
// unfused path.
bool fused_norm_activation_applies(const torch::Tensor& x);

// y = x * rsqrt(mean(x^2 over the last dim) + eps), cast back to x's dtype,
// times weight; x [..., C], weight [C], eps > 0. The normalisation runs in
// float (double for double input), as models/llama.cpp's RMSNorm does, and
// the product with the weight is in promote_types(x, weight), which is also
// the result's dtype. Gradients come back in x's and weight's dtypes.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// s = x + residual (same shape and dtype); returns {rms_norm(s, weight, eps), s}.
// s is the new residual stream. Upstream gradients of both results reach x
// and residual (which receive the same gradient).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps);

// silu(gate) * up elementwise; gate and up have the same shape and dtype, and
// so does the result. bfloat16/half are computed in float.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

// The same three contracts through ATen ops.
torch::Tensor rms_norm_unfused(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_unfused(const torch::Tensor& x, const torch::Tensor& residual,
                                                              const torch::Tensor& weight, double eps);
torch::Tensor swiglu_unfused(const torch::Tensor& gate, const torch::Tensor& up);

}  // namespace scaletrain::kernels

#pragma once
// Fused LayerNorm (optionally with the residual add in front of it) and the
// tanh-approximated GELU for the CPU, forward and backward: GPT-2's
// normalisation and activation.
//
// ATen's LayerNorm is one kernel each way already, but the residual add in
// front of it is another pass over the activations, and its backward sums the
// weight and bias gradients in an order that depends on the thread count.
// ATen's tanh GELU is built on tanh in both directions; the fused GELU
// computes the same function as x sigmoid(2u) with a polynomial exponential
// (vec_math.h), so that each direction is one vectorised loop. Both keep only
// what backward cannot cheaply rebuild: LayerNorm its input (for
// add_layer_norm the sum, which is an output the caller holds anyway) and a
// mean and reciprocal standard deviation per row; GELU its input. Float runs
// 8 lanes wide on a CPU with AVX2, with the same bits as the 4-lane build.
// See Note [LayerNorm and GELU kernels] in the .cpp file for the arithmetic,
// the vector width, the dtypes and the threading.
//
// The fused path takes the tensors that `fused_norm_activation_applies`
// (norm_activation.h) accepts: defined, on the CPU, strided, float, double,
// bfloat16 or half. Any other call goes to the `_unfused` functions, which
// are the same contracts as plain ATen ops (torch::layer_norm, torch::gelu
// with approximate="tanh") and the reference of the tests. Both paths
// validate their input the same way and throw scaletrain::UsageError with a
// one-line message.
//
// The fused functions are differentiable to first order (backward is not
// itself differentiable). Gradients are computed only for the inputs that
// require them (a frozen weight or bias, an input that needs no gradient).
#include <torch/torch.h>

#include <tuple>

namespace scaletrain::kernels {

// (x - mean) / sqrt(var + eps) * weight + bias over the last dim of x [..., C]
// (biased variance), with weight and bias [C] of x's dtype, both defined, and
// eps > 0. Mean and variance are computed in float (double for double
// input); the result has x's dtype.
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps);

// s = x + residual (same shape and dtype); returns {layer_norm(s, weight,
// bias, eps), s}. s is the new residual stream. Upstream gradients of both
// results reach x and residual (which receive the same gradient).
std::tuple<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                                        double eps);

// GELU with the tanh approximation, 0.5 x (1 + tanh(u)) with
// u = sqrt(2/pi) (x + 0.044715 x^3), computed as the equal x sigmoid(2u).
// The result has x's dtype; bfloat16 and half are computed in float.
torch::Tensor gelu_tanh(const torch::Tensor& x);

// The same three contracts through ATen ops. Half on the CPU, which ATen
// 1.13 implements for neither op, is computed in float and rounded back.
torch::Tensor layer_norm_unfused(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                 double eps);
std::tuple<torch::Tensor, torch::Tensor> add_layer_norm_unfused(const torch::Tensor& x, const torch::Tensor& residual,
                                                                const torch::Tensor& weight, const torch::Tensor& bias,
                                                                double eps);
torch::Tensor gelu_tanh_unfused(const torch::Tensor& x);

}  // namespace scaletrain::kernels

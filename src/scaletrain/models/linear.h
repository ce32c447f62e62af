#pragma once
// The linear layer of every family: torch's Linear (weight [out, in], an
// optional bias) that can carry a low-rank adapter (LoRA, models/lora.h).
// Without an adapter it computes exactly what torch::nn::Linear does, and
// is initialized with the same random draws. For QLoRA its frozen weight can
// be kept in NF4 (precision/nf4.h) instead.
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/nf4.h"

namespace scaletrain::models {

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in, int64_t out, bool bias);
  // x W^T + b, plus the adapter's term when there is one.
  torch::Tensor forward(const torch::Tensor& x);
  // x W^T alone: in FP8 when the layer has FP8 state (Note [FP8 linears]).
  torch::Tensor product(const torch::Tensor& x);

  // The adapter's term scaling * B(A(dropout(x))); undefined without an
  // adapter. `middle`, when given, is applied to A(dropout(x)) before B: a
  // row-parallel layer reduces that low-rank product across ranks there,
  // as it reduces x W^T.
  torch::Tensor adapter(const torch::Tensor& x, const std::function<torch::Tensor(const torch::Tensor&)>& middle = {});

  // Attaches an adapter of rank r: lora_A.weight [r, in] and lora_B.weight
  // [out, r] (PEFT's names under this layer), its output scaled by
  // `scaling`, with dropout `dropout` on its input in training. The new
  // parameters are zeros; models/lora.h initializes them.
  void add_adapter(int64_t r, double scaling, double dropout);
  bool has_adapter() const { return lora_A.defined(); }
  double scaling() const { return scaling_; }
  int64_t in_features() const { return quantized() ? nf4_shape_[1] : weight.size(1); }
  int64_t out_features() const { return quantized() ? nf4_shape_[0] : weight.size(0); }

  // Note [NF4 parameters]: QLoRA keeps the frozen weight as four uint8
  // parameters, so that every engine shards, gathers and broadcasts them
  // like any other frozen parameter and no dtype conversion touches them:
  //   weight_nf4            packed codes, two per byte ([ceil(numel / 2)])
  //   weight_absmax         per-block absmax: double-quantized codes
  //                         ([n_blocks]), or its fp32 bytes without double quant
  //   weight_absmax_scale   fp32 bytes of the double-quant scales (empty without)
  //   weight_absmax_offset  fp32 bytes of the double-quant offset ([4]; empty without)
  // `weight` is removed. forward() dequantizes one layer at a time
  // (precision::nf4_linear). A weight without bytes (interfaces/deferred.h)
  // becomes parameters without bytes of the right sizes, filled later from
  // nf4_parameter_bytes().
  void quantize(const precision::NF4Options& o);
  bool quantized() const { return weight_nf4.defined(); }
  // The NF4Weight the four parameters hold (their bytes must be present).
  precision::NF4Weight nf4_weight() const;
  const precision::NF4Options& nf4_options() const { return nf4_options_; }
  // The weight's dtype (before quantization, for a quantized layer).
  at::ScalarType base_dtype() const { return quantized() ? base_dtype_ : weight.scalar_type(); }

  torch::Tensor weight, bias;    // bias undefined when the layer has none; weight undefined once quantized
  precision::Fp8LinearPtr fp8;   // set: x W^T is computed in FP8 (use_fp8)
  torch::Tensor lora_A, lora_B;  // undefined without an adapter
  torch::Tensor weight_nf4, weight_absmax, weight_absmax_scale, weight_absmax_offset;  // quantized only

 private:
  double scaling_ = 0.0, dropout_ = 0.0;
  std::vector<int64_t> nf4_shape_;
  precision::NF4Options nf4_options_;
  at::ScalarType base_dtype_ = at::kFloat;  // the dtype the weight had before quantization
};
TORCH_MODULE(Linear);

// Gives every models::Linear under `root` (the linears of the transformer
// blocks: embeddings and heads are not models::Linear) and every LoraLinear
// (a user module's, models/lora_linear.h) FP8 state of its own; returns them
// in module order, the same on every rank that built the same model. A
// quantized (NF4) layer is refused.
std::vector<precision::Fp8LinearPtr> use_fp8(torch::nn::Module& root, const precision::Fp8LinearOptions& o);
// The names (relative to `root`) of the weights use_fp8 would cast: what
// MS-AMP's O3 gathers as FP8 (Note [FP8 weight gathers] in parallel/fsdp).
std::vector<std::string> fp8_weight_names(torch::nn::Module& root);

// The suffixes of Note [NF4 parameters], in registration order.
const std::vector<std::string>& nf4_parameter_suffixes();
// The bytes of the NF4 parameter `suffix` ("weight_nf4", ...) of a quantized `w`.
at::Tensor nf4_parameter_bytes(const precision::NF4Weight& w, const std::string& suffix);

}  // namespace scaletrain::models

#pragma once
// LoRA for any module: LoraLinear, a torch::nn::Linear that can carry an
// adapter, and add_lora_adapters, PEFT's get_peft_model for a user's module.
//
// Note [Adapters in a user's module]: PEFT swaps each targeted nn.Linear for
// a LoRA layer from outside. A C++ module calls its submodules through its
// own fields (a torch::nn::Linear holder always runs LinearImpl's forward),
// so nothing can swap them from outside, and C++ modules have no forward
// hooks through which to add B A x to a layer's output. So a module
// declares LoraLinear where it may want adapters: the same options, the
// same initialization and the same parameter names as torch::nn::Linear
// (weight, bias), so it computes what Linear computes and loads Linear's
// state dicts, until add_lora_adapters gives it an adapter (or models::use_fp8
// FP8 state, models/linear.h) (models/lora.h:
// y = W x + b + scaling * B A dropout(x), A [r, in] kaiming-uniform from a
// generator seeded by (seed, parameter name), B [out, r] zero). The adapter
// is two children, lora_A and lora_B, each holding `weight`, so parameter
// names are PEFT's ("<path>.lora_A.weight") and hub::write_adapter_files
// with family "module" writes a PEFT adapter directory of them.
#include <torch/nn/cloneable.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

#include "scaletrain/models/lora.h"
#include "scaletrain/precision/fp8.h"

namespace scaletrain::models {

// One factor of an adapter: a matrix named `weight`.
class LoraFactorImpl : public torch::nn::Cloneable<LoraFactorImpl> {
 public:
  LoraFactorImpl(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::zeros({rows_, cols_})); }
  at::Tensor weight;

 private:
  int64_t rows_, cols_;
};
TORCH_MODULE(LoraFactor);

class LoraLinearImpl : public torch::nn::Cloneable<LoraLinearImpl> {
 public:
  LoraLinearImpl(int64_t in_features, int64_t out_features)
      : LoraLinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  explicit LoraLinearImpl(const torch::nn::LinearOptions& options);
  void reset() override;
  void reset_parameters();  // as torch::nn::Linear's
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& input);

  // Gives the layer an adapter of `o` (r, alpha, rslora, dropout, init,
  // seed); `path` is the layer's module path, which seeds A's values. In
  // the dtype and on the device of `weight`.
  void add_adapter(const LoraOptions& o, const std::string& path);
  bool has_adapter() const { return static_cast<bool>(lora_A); }
  double scaling() const { return scaling_; }

  torch::nn::LinearOptions options;
  at::Tensor weight, bias;
  LoraFactor lora_A{nullptr}, lora_B{nullptr};
  // Set (models::use_fp8): x W^T is computed in emulated FP8 (Note [FP8
  // linears] in precision/fp8.h), the bias and any adapter added outside.
  precision::Fp8LinearPtr fp8;

 private:
  double scaling_ = 0, dropout_ = 0;
};
TORCH_MODULE(LoraLinear);

// PEFT's get_peft_model for any module: an adapter on every LoraLinear whose
// module path equals a target or ends in "." + target ("all-linear": every
// LoraLinear), and every other parameter frozen (requires_grad false).
// Returns the adapted paths in registration order. UsageError, naming it,
// for r < 1, a target that matches no layer, a targeted plain
// torch::nn::Linear (which no function can give an adapter: declare it as
// LoraLinear), or a layer that has an adapter already.
std::vector<std::string> add_lora_adapters(torch::nn::Module& module, const LoraOptions& o);

}  // namespace scaletrain::models

#pragma once
// The linear layer of every family: torch's Linear (weight [out, in], an
// optional bias) that can carry a low-rank adapter (LoRA, models/lora.h).
// Without an adapter it computes exactly what torch::nn::Linear does, and
// is initialized with the same random draws.
#include <torch/torch.h>

#include <functional>

namespace scaletrain::models {

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in, int64_t out, bool bias);
  // x W^T + b, plus the adapter's term when there is one.
  torch::Tensor forward(const torch::Tensor& x);

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
  int64_t in_features() const { return weight.size(1); }
  int64_t out_features() const { return weight.size(0); }

  torch::Tensor weight, bias;    // bias undefined when the layer has none
  torch::Tensor lora_A, lora_B;  // undefined without an adapter

 private:
  double scaling_ = 0.0, dropout_ = 0.0;
};
TORCH_MODULE(Linear);

}  // namespace scaletrain::models

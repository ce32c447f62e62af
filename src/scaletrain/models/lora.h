#pragma once
// Low-rank adapters (LoRA) as PEFT defines them: a chosen linear layer
// y = W x + b becomes y = W x + b + scaling * B(A(dropout(x))) with A [r, in]
// and B [out, r] trained and everything else frozen (requires_grad false:
// no gradient, no optimizer state, no gradient communication). scaling is
// alpha / r, or alpha / sqrt(r) with rsLoRA. A starts kaiming-uniform with
// a = sqrt(5) (uniform in +-1/sqrt(in), what torch gives a Linear) or, with
// gaussian init, normal with standard deviation 1/r; B starts at zero, so
// the adapted model first computes exactly what the base model does.
//
// Layers are chosen by their own name (the last part of the module path:
// "q_proj", "c_attn", ...), or all of them with "all-linear": every
// models::Linear, which the output heads are not.
//
// Adapter values are drawn from a generator seeded by (seed, parameter
// name), not the global one: every rank and every layout, materializing
// parameters in any order (interfaces/deferred.h), gets the same adapters.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/interfaces/deferred.h"

namespace scaletrain::models {

struct LoraOptions {
  int64_t r = 8;
  double alpha = 8.0;
  bool rslora = false;   // scaling alpha / sqrt(r) instead of alpha / r
  double dropout = 0.0;  // on the adapter's input, in training
  std::vector<std::string> target_modules;  // layer names, or {"all-linear"}
  bool gaussian_init = false;               // A ~ N(0, 1/r^2) instead of kaiming-uniform
  uint64_t seed = 0;

  double scaling() const;
};

// Adds an adapter to every targeted layer of `model` and freezes every
// other parameter. A deferred model (built without bytes) gets deferred
// adapters, initialized later through with_adapter_init(); an eager one gets
// their initial values now. Throws UsageError when r < 1, a target name
// matches no linear layer, or the model has none. Returns the adapted
// layers' module paths, in order.
std::vector<std::string> apply_lora(CausalLM& model, const LoraOptions& o);

// "…lora_A.weight" / "…lora_B.weight".
bool is_adapter_parameter(const std::string& name);

// Note [LoRA under tensor parallelism]: an adapter splits with its layer so
// that each rank computes its part of B A x from what it already holds.
//   column-parallel layer (W split over output rows, input x replicated):
//     A [r, in] replicated, B [out, r] split over its rows like W (blocks
//     included: a fused q|k|v's B in three). Each rank's A x is the same and
//     B_r A x is its rows of the output. A's gradient sums over every output
//     row, which each rank holds only a part of: A is marked partial_grad and
//     its gradient is all-reduced over tp before accumulation. x's gradient
//     is already partial and summed by the layer's input operator (f).
//   row-parallel layer (W split over input columns, x split):
//     A [r, in] split over its columns like W, B [out, r] replicated. A_r x_r
//     is a partial sum, reduced over tp (or reduce-scattered along the
//     sequence) exactly as x_r W_r^T is, before B: the same operator in the
//     middle (LinearImpl::adapter). B then sees the full low-rank product;
//     its gradient is full on every rank (partial over tokens only under
//     sequence parallelism, like the row-parallel bias).
// The extra communication per adapted layer is one all-reduce of [B, T, r]
// forward for row layers, and A's gradient (r x in) per step for column layers.
TensorParallelSplit adapter_split(const std::string& name, const TensorParallelSplit& weight);

// The initial value of adapter parameter `name` into `out` (its shape, any dtype).
void init_adapter(const std::string& name, at::Tensor& out, const LoraOptions& o);

// `base` for every other parameter, init_adapter for adapters.
interfaces::InitFn with_adapter_init(interfaces::InitFn base, LoraOptions o);

}  // namespace scaletrain::models

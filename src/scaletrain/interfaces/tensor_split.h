#pragma once
// What tensor parallelism (parallel/tensor's parallelize_tensor) needs from a
// module that splits its own layers: how each parameter is cut, and hooks the
// module calls at the boundaries of Megatron's column-parallel / row-parallel
// pairs. Our families implement it (models/causal_lm.h); a user module can
// too, or use parallelize_module (parallel/tensor/parallelize_module.h),
// which needs nothing from the module. It lives below both parallel/ and
// models/ so that the engine does not include a family's header.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace scaletrain::interfaces {

// How a layer-splitting strategy takes part in the forward without a second
// model class. The model stays free of communication: the strategy fills
// these in and the modules call them at the boundaries. No hooks (null) is
// the plain single-process model.
using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;
struct TensorParallelHooks {
  // Input of a column-parallel linear: the f operator (identity forward,
  // all-reduce backward) or, under sequence parallelism, the all-gather
  // along the sequence.
  TensorFn column_input;
  // Output of a row-parallel linear before its bias: the g operator
  // (all-reduce) or, under sequence parallelism, the reduce-scatter.
  TensorFn row_output;
  // Token ids [B, T] and this rank's rows of the embedding -> the token
  // embedding [B, T, C] (or its sequence shard [B, T/tp, C]).
  std::function<torch::Tensor(const torch::Tensor& idx, const torch::Tensor& weight)> embed_tokens;
  // First position of this rank's part of a sequence whose local length is
  // `n` (0 unless sequence parallel): what a position embedding adds.
  std::function<int64_t(int64_t n)> sequence_offset;
  // Final hidden states and this rank's vocabulary rows of the head -> full
  // logits [B, T, V] (gathered; for forward() and generate(), not the loss).
  std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& head)> logits;
  // Final hidden states, head rows and targets -> mean next-token
  // cross-entropy, with logits that stay sharded over the vocabulary.
  std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& head, const torch::Tensor& targets)> loss;
  // For a module that fuses its head with the loss instead of calling
  // `loss` (kernels::VocabShard): this rank's index in the group, and the
  // in-place elementwise maximum and sum of a tensor over the group.
  int rank = 0;
  std::function<void(torch::Tensor&)> max_across, sum_across;
  // Token ids sampled by generate() [B, 1] -> the ids every rank continues
  // with (tp rank 0's): the ranks of a split model must feed the same tokens.
  TensorFn broadcast_tokens;
  // The hooks generate() runs with instead of these; null: these. Sequence
  // parallelism cannot split a sampled context of any length, and without
  // autograd it saves nothing, so its hooks name plain tensor-parallel ones.
  std::shared_ptr<const TensorParallelHooks> sampling;
};
using TensorParallelHooksPtr = std::shared_ptr<const TensorParallelHooks>;

// How a parameter is cut across a tensor-parallel group. dim -1: replicated.
// The split dimension holds `blocks` equal parts split separately (a fused
// q|k|v weight: 3), so each rank keeps part r of every block. A replicated
// parameter may still see a different part of the computation on each rank
// (partial_grad: a column-parallel layer's LoRA A, Note [LoRA under tensor
// parallelism] in models/lora.h): its gradient is then summed over tp.
struct TensorParallelSplit {
  int64_t dim = -1;
  int64_t blocks = 1;
  bool partial_grad = false;
};

// A module that tensor parallelism splits by its own plan.
class TensorSplittable {
 public:
  virtual ~TensorSplittable() = default;
  // The module whose named_parameters() the splits name.
  virtual torch::nn::Module& split_module() = 0;
  // How parameter `name` is cut.
  virtual TensorParallelSplit parameter_split(const std::string& name) const = 0;
  // What degree `tp` cannot split, one line each; empty: it can.
  virtual std::vector<std::string> split_problems(int tp) const = 0;
  // Installs the hooks in every layer (null: removes them).
  virtual void set_tensor_parallel(TensorParallelHooksPtr hooks) = 0;
  virtual const TensorParallelHooksPtr& tensor_parallel() const = 0;
};

// The target id a loss skips (as torch's ignore_index).
inline constexpr int64_t kIgnoreTarget = -100;

// The mean of per-token losses over the positions whose target is not
// kIgnoreTarget: the sum divided by their count (at least 1).
inline torch::Tensor mean_over_targets(const torch::Tensor& per_token, const torch::Tensor& targets) {
  const auto valid = (targets != kIgnoreTarget).reshape(per_token.sizes());
  return (per_token * valid.to(per_token.scalar_type())).sum() / valid.sum().clamp_min(1).to(per_token.scalar_type());
}

}  // namespace scaletrain::interfaces

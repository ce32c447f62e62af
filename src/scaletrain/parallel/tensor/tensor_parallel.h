#pragma once
// Tensor parallelism (Megatron-LM style) applied to a model in place:
// parallelize_tensor() splits the weights of the full, initialized model as
// the model's plan says (interfaces::TensorSplittable::parameter_split, which
// our families implement) and installs interfaces::TensorParallelHooks, so
// the same module tree computes with 1/tp of the weights and of the
// attention heads per rank. For a module without such a plan,
// parallelize_module (parallelize_module.h) splits Linear and Embedding
// layers by name.
//
//   split                          Megatron role
//   vocabulary rows (dim 0)        vocab-parallel embedding and head,
//                                  vocab-parallel cross-entropy
//   output rows (dim 0)            column-parallel (q, k, v, MLP input);
//                                  a fused q|k|v in blocks (Note [Fused qkv split])
//   input columns (dim 1)          row-parallel (attention output, MLP output;
//                                  bias replicated)
//   none                           replicated (norms, position embeddings)
//
// Composition: parallelize_tensor() comes first; DDP or the sharded engine
// (ZeRO/FSDP: Note [Sharding tensor-parallel parameters] in parallel/fsdp)
// then wraps the split model over the data-parallel group of each tp rank.
// Checkpoints describe every shard as pieces of the full tensor
// (train::tensor_parallel_layout), so they reload under any layout.
//
// Per block, forward and backward each cost two all-reduces of [B, T, C]
// (attention and MLP), or under sequence parallelism two all-gathers and two
// reduce-scatters of the same bytes.
//
// Note [Sequence-parallel gradients]: under sequence parallelism the regions
// between a row-parallel and the next column-parallel linear (residual adds,
// LayerNorm, dropout, the row-parallel bias, the position embedding) run on
// this rank's T/tp tokens only. Their parameters are still replicated, but the
// gradient a rank computes for them sums over its own tokens only: a partial
// sum. A hook on each such parameter all-reduces its gradient over tp in
// backward (before it is accumulated, so DDP over another group and
// gradient accumulation see the full gradient). Without sequence parallelism
// these parameters see replicated inputs and replicated output gradients (f
// all-reduces the gradient entering them), so every rank already computes the
// full, identical gradient and nothing is communicated.
//
// Note [Tensor-parallel dropout]: every rank of tp draws the same random
// numbers (same seed, same sequence of draws), which is what replicated
// regions need (identical masks). Inside the split regions (the local heads'
// attention probabilities, and everything under sequence parallelism) the
// ranks' masks are then equal copies rather than independent draws: still a
// valid dropout per element, but correlated across ranks. Megatron keeps a
// separate generator per tp rank for those regions; we do not yet.
//
// Every dimension the plan splits must divide by tp: parallelize_tensor throws a
// one-line UsageError naming the degree and the dimension. We do not pad the
// vocabulary: padding changes the model (its shape, its checkpoints and its
// softmax), which would break parity with the single-process reference.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/interfaces/tensor_split.h"

namespace scaletrain::parallel::tensor {

struct TensorParallelOptions {
  // Shard the activations between the parallel linears (residual stream,
  // LayerNorm, dropout) along the sequence: all-gather before each
  // column-parallel linear, reduce-scatter after each row-parallel one. The
  // sequence length must then be divisible by tp. See Note
  // [Sequence-parallel gradients].
  bool sequence_parallel = false;
  // Broadcast the full weights from tp rank 0 before splitting, so every
  // rank splits the same model even if their initializations differed.
  bool broadcast_initial_weights = true;
  // The model was built without parameter bytes (interfaces/deferred.h): only
  // the shapes are split here, and the values arrive later through the
  // function tensor_parallel_init() makes (Note [Deferred tensor-parallel init]).
  bool deferred = false;
};

// How one parameter is laid out across the tp group.
struct ParamLayout {
  std::string name;                 // as in named_parameters()
  std::vector<int64_t> full_shape;  // shape in the single-process model
  int64_t dim = -1;                 // split dimension; -1: replicated on every rank
  // The split dimension holds `blocks` equal parts that are split separately
  // (c_attn's fused q, k, v: 3), so each rank keeps part r of every block.
  int64_t blocks = 1;
  // Replicated, but each rank computes a partial gradient that is all-reduced
  // over tp in backward (sequence parallelism, see the Note above; a
  // column-parallel layer's LoRA A, Note [LoRA under tensor parallelism]).
  bool partial_grad = false;

  bool sharded() const { return dim >= 0; }
};

// What parallelize_tensor did; needed to clip, gather and checkpoint.
struct TensorParallelPlan {
  comm::Group* tp = nullptr;
  TensorParallelOptions options;
  std::vector<ParamLayout> params;  // in named_parameters() order

  // The layout of parameter `name`; throws std::out_of_range naming it.
  const ParamLayout& layout(const std::string& name) const;
};

// Splits the weights of `model` (full and initialized, the same on every
// rank: build it with the same seed everywhere) and installs the hooks. Call
// it before creating the optimizer or wrapping the model (DDP over another
// group): parameters keep their identity but change shape. `tp` must outlive
// the model.
// Throws a one-line UsageError naming every dimension tp does not divide
// (TensorSplittable::split_problems; models::check_tensor_parallel says the
// same of a config before any model is built).
TensorParallelPlan parallelize_tensor(interfaces::TensorSplittable& model, comm::Group& tp,
                                      TensorParallelOptions options = {});

// Rank `rank`'s part of a full tensor laid out as `layout`, and the inverse
// (an all-gather over tp; every rank gets the full tensor).
at::Tensor split_parameter(const at::Tensor& full, const ParamLayout& layout, int rank, int size);
at::Tensor gather_parameter(const at::Tensor& shard, const ParamLayout& layout, comm::Group& tp);
// The full parameters of a parallelized model, in named_parameters() order
// (collective over tp).
std::vector<at::Tensor> gather_full_parameters(torch::nn::Module& model, const TensorParallelPlan& plan);

// Where part of a shard lies in the full tensor. Elements [begin, begin +
// numel) of rank `rank`'s flattened shard are, in the flattened full tensor,
// a few contiguous runs: one per row block of the split dimension (a
// row-split matrix's shard is one run per q/k/v block, a column-split one is
// one run per row). Replicated parameters map onto themselves.
struct FullRun {
  int64_t full_offset = 0;   // first element in the flattened full tensor
  int64_t local_offset = 0;  // first element in the flattened shard
  int64_t numel = 0;
};
std::vector<FullRun> full_runs(const ParamLayout& layout, int rank, int size, int64_t begin, int64_t numel);

// Note [Deferred tensor-parallel init]: a model built without bytes is split
// in shape only; `full_init` (the model's initialization of a whole
// parameter) is wrapped so that each call draws the *full* tensor, exactly as
// a single process would (same shape, same random draws in the same order),
// and keeps this rank's part. With broadcast_initial_weights the full tensor
// comes from tp rank 0; that broadcast is a collective over tp inside the
// init function, so every rank of a tp group must call the function equally
// often: true for the sharded engine, which calls it on all ranks or on the
// data-parallel rank 0 of every tp rank (one whole tp group).
interfaces::InitFn tensor_parallel_init(interfaces::InitFn full_init, const TensorParallelPlan& plan);

// Parameters by how they enter the global gradient norm: each split
// parameter's shards are disjoint parts of it (their squared norms add up over
// tp), each replicated parameter has the same full gradient on every rank
// (counted once, not tp times).
struct GradNormParams {
  std::vector<at::Tensor> sharded;
  std::vector<at::Tensor> replicated;
};
GradNormParams grad_norm_params(torch::nn::Module& model, const TensorParallelPlan& plan);

// Scales the gradients so that the global L2 norm (of the single-process
// model's gradient) is at most max_norm; returns the norm before clipping.
// Collective over tp. Gradients must already be reduced over data parallelism.
double clip_grad_norm(const GradNormParams& params, double max_norm, comm::Group& tp);

}  // namespace scaletrain::parallel::tensor

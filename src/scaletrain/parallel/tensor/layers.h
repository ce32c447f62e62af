#pragma once
// Megatron's tensor-parallel layers as functions of (input, this rank's
// shard of the weights, the tp group). parallelize_tensor() applies them to
// the model's own modules through interfaces::TensorParallelHooks; they are also
// usable on their own (and tested so) for any model.
//
// Activations are [B, T, ...]: batch first, the sequence in dimension 1
// (kSequenceDim), which is where sequence parallelism shards them.
//
//   column-parallel  Y_r = X W_r^T + b_r     W split over its output rows; X
//                                            replicated (f before) or, under
//                                            SP, all-gathered along T
//   row-parallel     Y = sum_r X_r W_r^T + b  W split over its input columns;
//                                            the sum is g (all-reduce) or,
//                                            under SP, a reduce-scatter along
//                                            T; b is added once, after it
//   vocab-parallel   rank r holds rows [r V/tp, (r+1) V/tp) of the table
//   embedding        (see vocab_parallel_embedding)
//   vocab-parallel   logits stay sharded over the vocabulary (see
//   cross-entropy    Note [Vocab-parallel cross-entropy])
#include <torch/torch.h>

#include "scaletrain/comm/group.h"

namespace scaletrain::parallel::tensor {

constexpr int64_t kSequenceDim = 1;  // activations are [B, T, C]

// weight: [out/tp, in], bias: [out/tp] or undefined. x: [B, T, in], or its
// sequence shard [B, T/tp, in] under sequence_parallel. Returns [B, T,
// out/tp]; with gather_output the full [B, T, out] (all-gathered).
torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                     comm::Group& tp, bool sequence_parallel, bool gather_output = false);

// weight: [out, in/tp], bias: [out] (replicated) or undefined. x: [B, T,
// in/tp] (a column-parallel output). Returns [B, T, out], or its sequence
// shard [B, T/tp, out] under sequence_parallel.
torch::Tensor row_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  comm::Group& tp, bool sequence_parallel);

// idx: [B, T] ids in [0, V); weight: rows [r V/tp, (r+1) V/tp) of the
// [V, C] table. Ids outside this rank's rows look up row 0 and are zeroed
// (masked), so each rank contributes exactly the embeddings of its ids, and
// the partial results are summed over tp: all-reduce -> [B, T, C], or under
// sequence_parallel reduce-scatter -> [B, T/tp, C].
torch::Tensor vocab_parallel_embedding(const torch::Tensor& idx, const torch::Tensor& weight, comm::Group& tp,
                                       bool sequence_parallel);

// logits: [..., V/tp], this rank's vocabulary shard (rows [r V/tp, (r+1)
// V/tp)); targets: [...] ids in [0, V) (no ignore index). Returns the
// per-token loss [...], identical on every rank of tp. Computed in the
// logits' dtype: upcast 16-bit logits first.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, comm::Group& tp);

}  // namespace scaletrain::parallel::tensor

#pragma once
// Communication of tensor parallelism: Megatron's f / g operators and their
// sequence-parallel counterparts, as autograd functions over a comm::Group.
//
// Each operator is a pair (forward collective, backward collective) whose
// backward is the adjoint of its forward:
//
//   operator                      forward                 backward
//   copy_to_tp_region (f)         identity                all-reduce
//   reduce_from_tp_region (g)     all-reduce              identity
//   gather_from_sequence          all-gather along dim    reduce-scatter along dim
//   reduce_scatter_to_sequence    reduce-scatter on dim   all-gather along dim
//   scatter_to_tp_region          keep this rank's chunk  all-gather along dim
//   gather_from_tp_region         all-gather along dim    keep this rank's chunk
//
// f sits before a column-parallel linear (its input is replicated, its
// weight split over the outputs: each rank's input gradient is partial), g
// after a row-parallel one (each rank's output is a partial sum). Under
// sequence parallelism the replicated activations between the pairs are
// sharded along the sequence instead, and f / g become the all-gather /
// reduce-scatter pair: the same bytes as one all-reduce, but LayerNorm and
// dropout then run on 1/tp of the tokens (Korthikanti et al., 2022).
//
// Every rank of the group must call the same operators in the same order
// (the forward is the same program everywhere, so its backward is too). The
// group must outlive every graph built with it: backward uses it.
//
// Dimensions split along must be divisible by the group size; a violation is
// a one-line error naming both. Tensors of any shape; collectives run on
// contiguous copies.
#include <torch/torch.h>

#include "scaletrain/comm/group.h"

namespace scaletrain::parallel::tensor {

// f: identity forward, all-reduce (sum) of the gradient backward.
torch::Tensor copy_to_tp_region(const torch::Tensor& x, comm::Group& tp);
// g: all-reduce (sum) forward, identity backward.
torch::Tensor reduce_from_tp_region(const torch::Tensor& x, comm::Group& tp);
// Sequence parallelism's f: all-gather of the shards along `dim` forward,
// reduce-scatter of the gradient along `dim` backward.
torch::Tensor gather_from_sequence(const torch::Tensor& x, comm::Group& tp, int64_t dim);
// Sequence parallelism's g: reduce-scatter along `dim` forward (each rank
// keeps the sum of its chunk), all-gather of the gradient backward.
torch::Tensor reduce_scatter_to_sequence(const torch::Tensor& x, comm::Group& tp, int64_t dim);
// Keeps this rank's chunk along `dim`; backward all-gathers the gradient.
torch::Tensor scatter_to_tp_region(const torch::Tensor& x, comm::Group& tp, int64_t dim);
// All-gathers the chunks along `dim`; backward keeps this rank's chunk.
torch::Tensor gather_from_tp_region(const torch::Tensor& x, comm::Group& tp, int64_t dim);

// The plain collectives underneath (no autograd), along a dimension.
torch::Tensor all_gather_along(const torch::Tensor& x, comm::Group& g, int64_t dim);
torch::Tensor reduce_scatter_along(const torch::Tensor& x, comm::Group& g, int64_t dim);
// This rank's chunk of `x` along `dim` (a contiguous copy).
torch::Tensor chunk_of(const torch::Tensor& x, int64_t dim, int rank, int size);
// Sum over the group, in place, synchronously.
void all_reduce_(torch::Tensor& x, comm::Group& g, comm::ReduceOp op = comm::ReduceOp::Sum);

}  // namespace scaletrain::parallel::tensor

#include "scaletrain/parallel/tensor/layers.h"

#include "scaletrain/parallel/tensor/tp_comm.h"

namespace scaletrain::parallel::tensor {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor column_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                     comm::Group& tp, bool sequence_parallel, bool gather_output) {
  auto in = sequence_parallel ? gather_from_sequence(x, tp, kSequenceDim) : copy_to_tp_region(x, tp);
  auto out = torch::linear(in, weight, bias);
  return gather_output ? gather_from_tp_region(out, tp, -1) : out;
}

torch::Tensor row_parallel_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                                  comm::Group& tp, bool sequence_parallel) {
  auto partial = torch::linear(x, weight);
  auto out =
      sequence_parallel ? reduce_scatter_to_sequence(partial, tp, kSequenceDim) : reduce_from_tp_region(partial, tp);
  // The bias is replicated: added after the reduction it counts once, not tp times.
  return bias.defined() ? out + bias : out;
}

torch::Tensor vocab_parallel_embedding(const torch::Tensor& idx, const torch::Tensor& weight, comm::Group& tp,
                                       bool sequence_parallel) {
  const int64_t rows = weight.size(0), start = tp.rank() * rows;
  auto outside = (idx < start).logical_or(idx >= start + rows);
  auto local = (idx - start).masked_fill(outside, 0);
  auto partial = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel ? reduce_scatter_to_sequence(partial, tp, kSequenceDim) : reduce_from_tp_region(partial, tp);
}

namespace {

// Note [Vocab-parallel cross-entropy]: with logits z sharded over the
// vocabulary, loss = log(sum_v exp(z_v)) - z_target needs three global
// quantities per token, each obtained by an all-reduce of a local partial
// rather than by gathering the [N, V] logits (Megatron's cross_entropy.py):
//   1. m = max_v z_v (all-reduce MAX). Subtracting it keeps exp() finite; it
//      must be the *same* m on every rank or the partial sums below would be
//      on different scales. It carries no gradient (the loss does not depend
//      on it).
//   2. the target's logit z_t - m: only the rank holding the target's row
//      has it, the others contribute 0 (all-reduce SUM);
//   3. S = sum_v exp(z_v - m): each rank sums its rows (all-reduce SUM).
// 2 and 3 travel in one all-reduce of a [2, N] tensor, so a loss costs two
// latency-bound collectives of O(N) elements instead of one of O(N V).
// loss = log S - (z_t - m). Backward is local: d loss / d z_v = softmax_v -
// [v == t], with softmax_v = exp(z_v - m) / S on this rank's rows, so the
// forward keeps the local softmax and the local target index.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               comm::Group* tp) {
    const int64_t rows = logits.size(-1), start = tp->rank() * rows;
    auto z = logits.reshape({-1, rows});
    auto t = targets.reshape({-1});
    TORCH_CHECK(z.size(0) == t.size(0), "vocab_parallel_cross_entropy: ", z.size(0), " logit rows for ", t.size(0),
                " targets");
    auto max = std::get<0>(z.max(-1)).contiguous();
    all_reduce_(max, *tp, comm::ReduceOp::Max);
    auto shifted = z - max.unsqueeze(-1);
    auto outside = (t < start).logical_or(t >= start + rows);
    auto local_t = (t - start).masked_fill(outside, 0);
    auto stats = torch::empty({2, z.size(0)}, z.options());
    stats[0] = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0);
    auto softmax = shifted.exp_();  // shifted is ours: exponentiate in place
    stats[1] = softmax.sum(-1);
    all_reduce_(stats, *tp);
    auto loss = stats[1].log() - stats[0];
    softmax.div_(stats[1].unsqueeze(-1));
    ctx->save_for_backward({softmax, local_t, outside});
    ctx->saved_data["shape"] = logits.sizes().vec();
    return {loss.view(targets.sizes())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    auto softmax = saved[0], local_t = saved[1], outside = saved[2];
    // softmax - one_hot(target) on the rank that holds the target's row.
    auto g = softmax.clone();
    g.scatter_add_(-1, local_t.unsqueeze(-1), outside.logical_not().to(g.scalar_type()).neg().unsqueeze(-1));
    g.mul_(grad[0].reshape({-1, 1}));
    return {g.view(ctx->saved_data["shape"].toIntVector()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets, comm::Group& tp) {
  return VocabParallelCrossEntropy::apply(logits, targets, &tp)[0];
}

}  // namespace scaletrain::parallel::tensor

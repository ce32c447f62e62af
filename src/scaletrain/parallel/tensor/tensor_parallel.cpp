#include "scaletrain/parallel/tensor/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <unordered_map>

#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/tensor/layers.h"
#include "scaletrain/parallel/tensor/tp_comm.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::tensor {

namespace {

// Each parameter's split, as the model's plan says (Note [Fused qkv split]).
ParamLayout layout_of(const interfaces::TensorSplittable& model, const std::string& name, const at::Tensor& p,
                      bool sequence_parallel) {
  ParamLayout l;
  l.name = name;
  l.full_shape = p.sizes().vec();
  const interfaces::TensorParallelSplit split = model.parameter_split(name);
  l.dim = split.dim;
  l.blocks = split.blocks;
  // Replicated parameters (norms, position embeddings, row-parallel biases)
  // see this rank's tokens only under sequence parallelism (Note
  // [Sequence-parallel gradients]); a column-parallel layer's LoRA A sees
  // this rank's output rows only, always.
  if (!l.sharded()) l.partial_grad = sequence_parallel || split.partial_grad;
  return l;
}

// Note [Fused qkv split]: a fused q|k|v weight is [3C, C],
// the rows of q, then k, then v, each C = n_head x head_size rows in head
// order. Splitting its rows into tp contiguous chunks would give rank 0 all of
// q and part of k. Each rank must keep the rows of *its* heads in each of q, k
// and v: the model's plan says blocks = 3, the row dimension is viewed as
// [3, tp, C/tp] and rank r keeps [:, r, :], so its local weight is [q_r; k_r;
// v_r] ([3C/tp, C]) and the attention, which splits the output in three
// equal parts, computes heads [r H/tp, (r+1) H/tp).
std::vector<int64_t> blocked_sizes(std::vector<int64_t> sizes, const ParamLayout& l, int size) {
  const int64_t n = sizes[l.dim] / (l.blocks * size);
  sizes[l.dim] = n;
  sizes.insert(sizes.begin() + l.dim, size);
  sizes.insert(sizes.begin() + l.dim, l.blocks);
  return sizes;  // [..., blocks, size, n, ...]
}

// Builds the hooks through which the model's own modules run tensor-parallel.
interfaces::TensorParallelHooksPtr make_hooks(comm::Group* g, bool sp) {
  auto hooks = std::make_shared<interfaces::TensorParallelHooks>();
  auto column_input = [g, sp](const torch::Tensor& x) {
    return sp ? gather_from_sequence(x, *g, kSequenceDim) : copy_to_tp_region(x, *g);
  };
  hooks->column_input = column_input;
  hooks->row_output = [g, sp](const torch::Tensor& x) {
    return sp ? reduce_scatter_to_sequence(x, *g, kSequenceDim) : reduce_from_tp_region(x, *g);
  };
  hooks->embed_tokens = [g, sp](const torch::Tensor& idx, const torch::Tensor& weight) {
    return vocab_parallel_embedding(idx, weight, *g, sp);
  };
  hooks->sequence_offset = [g, sp](int64_t n) -> int64_t { return sp ? g->rank() * n : 0; };
  // The head is a column-parallel linear over the vocabulary: this rank's
  // rows of the head (or of the tied embedding) as its weight.
  auto local_logits = [column_input](const torch::Tensor& x, const torch::Tensor& head) {
    return torch::matmul(column_input(x), head.t());
  };
  hooks->logits = [g, local_logits](const torch::Tensor& x, const torch::Tensor& head) {
    return gather_from_tp_region(local_logits(x, head), *g, -1);
  };
  hooks->loss = [g, local_logits](const torch::Tensor& x, const torch::Tensor& head, const torch::Tensor& targets) {
    auto logits = local_logits(x, head);
    // As the single-process loss: 16-bit logits are upcast for the softmax.
    if (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kHalf)
      logits = logits.to(torch::kFloat);
    // Targets the loss skips (interfaces::kIgnoreTarget) add nothing and are not counted.
    return interfaces::mean_over_targets(vocab_parallel_cross_entropy(logits, targets, *g), targets);
  };
  hooks->rank = g->rank();
  hooks->max_across = [g](torch::Tensor& t) { all_reduce_(t, *g, comm::ReduceOp::Max); };
  hooks->sum_across = [g](torch::Tensor& t) { all_reduce_(t, *g); };
  // Sampling: every rank computed the same full logits and drew with the
  // same seed, but a rank that drew differently (another BLAS, another
  // rounding) would go on with another sequence: tp rank 0's tokens decide.
  hooks->broadcast_tokens = [g](const torch::Tensor& ids) {
    auto out = ids.contiguous().clone();
    if (g->size() > 1) g->broadcast(out, 0).wait();
    return out;
  };
  if (sp) hooks->sampling = make_hooks(g, false);
  return hooks;
}

// A one-line UsageError naming every dimension tp does not divide.
void check_splits(const interfaces::TensorSplittable& model, int tp) {
  const auto problems = model.split_problems(tp);
  if (problems.empty()) return;
  std::string line;
  for (const auto& p : problems) line += (line.empty() ? "" : "; ") + p;
  throw UsageError(line);
}

}  // namespace

at::Tensor split_parameter(const at::Tensor& full, const ParamLayout& l, int rank, int size) {
  if (!l.sharded()) return full.clone();
  auto shard_sizes = full.sizes().vec();
  shard_sizes[l.dim] /= size;
  return full.reshape(blocked_sizes(full.sizes().vec(), l, size))
      .select(l.dim + 1, rank)
      .reshape(shard_sizes)
      .contiguous();
}

at::Tensor gather_parameter(const at::Tensor& shard, const ParamLayout& l, comm::Group& tp) {
  if (!l.sharded()) return shard.clone();
  torch::NoGradGuard no_grad;
  auto s = shard.contiguous();
  auto all = torch::empty({tp.size() * s.numel()}, s.options());
  tp.all_gather(s, all).wait();
  // all: [tp, ..., blocks, n, ...] -> [..., blocks, tp, n, ...] -> full.
  auto sizes = s.sizes().vec();
  sizes[l.dim] /= l.blocks;
  sizes.insert(sizes.begin() + l.dim, l.blocks);
  sizes.insert(sizes.begin(), tp.size());
  return all.view(sizes).movedim(0, l.dim + 1).reshape(l.full_shape);
}

TensorParallelPlan parallelize_tensor(interfaces::TensorSplittable& model, comm::Group& tp,
                                      TensorParallelOptions options) {
  check_splits(model, tp.size());
  if (model.tensor_parallel()) throw UsageError("parallelize_tensor: the model is already tensor-parallel");
  TensorParallelPlan plan;
  plan.tp = &tp;
  plan.options = options;
  torch::NoGradGuard no_grad;
  for (auto& item : model.split_module().named_parameters()) {
    at::Tensor p = item.value();
    const bool empty = !p.defined() || p.storage().nbytes() == 0;
    if (empty != options.deferred)
      throw UsageError(std::string("parallelize_tensor: '") + item.key() + "' " +
                       (empty ? "has no data (set TensorParallelOptions::deferred for a deferred model)"
                              : "has data but the options say the model is deferred"));
    ParamLayout l = layout_of(model, item.key(), p, options.sequence_parallel);
    if (options.deferred) {
      // Shape only (Note [Deferred tensor-parallel init]).
      if (l.sharded()) {
        auto sizes = p.sizes().vec();
        sizes[l.dim] /= tp.size();
        at::Tensor shell = at::empty(sizes, p.options().requires_grad(false));
        interfaces::free_storage(shell);
        p.set_data(shell);
      }
    } else {
      if (options.broadcast_initial_weights && tp.size() > 1) tp.broadcast(p.data(), 0).wait();
      if (l.sharded()) p.set_data(split_parameter(p.data(), l, tp.rank(), tp.size()));
    }
    if (l.partial_grad && tp.size() > 1 && p.requires_grad()) {  // frozen: no gradient to sum
      // Note [Sequence-parallel gradients]: sum the per-rank partial gradient
      // before it is accumulated.
      comm::Group* g = &tp;
      p.register_hook([g](const at::Tensor& grad) {
        at::Tensor full = grad.contiguous().clone();
        all_reduce_(full, *g);
        return full;
      });
    }
    plan.params.push_back(std::move(l));
  }
  model.set_tensor_parallel(make_hooks(&tp, options.sequence_parallel));
  return plan;
}

const ParamLayout& TensorParallelPlan::layout(const std::string& name) const {
  for (const auto& l : params)
    if (l.name == name) return l;
  throw std::out_of_range("tensor-parallel plan has no parameter '" + name + "'");
}

std::vector<FullRun> full_runs(const ParamLayout& l, int rank, int size, int64_t begin, int64_t numel) {
  if (!l.sharded() || size == 1) return {{begin, begin, numel}};
  // The full tensor as [outer, blocks, size, n, inner] and the shard as
  // [outer, blocks, n, inner] (Note [Fused qkv split]): a run is one
  // (outer, block) row of n * inner elements.
  int64_t inner = 1;
  for (size_t d = l.dim + 1; d < l.full_shape.size(); ++d) inner *= l.full_shape[d];
  const int64_t run = l.full_shape[l.dim] / (l.blocks * size) * inner;
  std::vector<FullRun> out;
  for (int64_t pos = begin, end = begin + numel; pos < end;) {
    const int64_t row = pos / run, within = pos % run, len = std::min(run - within, end - pos);
    out.push_back({(row * size + rank) * run + within, pos, len});
    pos += len;
  }
  return out;
}

interfaces::InitFn tensor_parallel_init(interfaces::InitFn full_init, const TensorParallelPlan& plan) {
  return [full_init = std::move(full_init), plan](const std::string& name, at::Tensor& out) {
    const ParamLayout& l = plan.layout(name);
    comm::Group& tp = *plan.tp;
    at::Tensor full = at::empty(l.full_shape, out.options());
    full_init(name, full);
    if (plan.options.broadcast_initial_weights && tp.size() > 1) tp.broadcast(full, 0).wait();
    torch::NoGradGuard no_grad;
    out.copy_(split_parameter(full, l, tp.rank(), tp.size()));
  };
}

std::vector<at::Tensor> gather_full_parameters(torch::nn::Module& model, const TensorParallelPlan& plan) {
  auto params = model.named_parameters();
  TORCH_CHECK(params.size() == plan.params.size(), "gather_full_parameters: the plan has ", plan.params.size(),
              " parameters, the model ", params.size());
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i)
    out.push_back(gather_parameter(params[i].value().detach(), plan.params[i], *plan.tp));
  return out;
}

GradNormParams grad_norm_params(torch::nn::Module& model, const TensorParallelPlan& plan) {
  std::unordered_map<std::string, const ParamLayout*> by_name;
  for (auto& l : plan.params) by_name[l.name] = &l;
  GradNormParams out;
  for (auto& item : model.named_parameters()) {
    auto it = by_name.find(item.key());
    TORCH_CHECK(it != by_name.end(), "grad_norm_params: '", item.key(), "' is not in the tensor-parallel plan");
    (it->second->sharded() ? out.sharded : out.replicated).push_back(item.value());
  }
  return out;
}

double clip_grad_norm(const GradNormParams& params, double max_norm, comm::Group& tp) {
  torch::NoGradGuard no_grad;
  // Shards are disjoint pieces of their parameters: their squares add over tp.
  at::Tensor sq = optim::grad_square_sum(params.sharded);
  all_reduce_(sq, tp);
  // Replicated gradients are equal on every rank: counted once.
  sq.add_(optim::grad_square_sum(params.replicated).to(sq.device()));
  const double norm = std::sqrt(sq.item<double>());  // one host sync
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);  // as optim::clip_grad_norm
    for (auto* list : {&params.sharded, &params.replicated})
      for (auto& p : *list)
        if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

}  // namespace scaletrain::parallel::tensor

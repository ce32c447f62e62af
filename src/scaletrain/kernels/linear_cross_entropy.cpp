// Chunked linear + cross-entropy: the fused CPU kernel, its autograd wrappers,
// the unfused reference, and the input checks both share.
//
// Note [Chunked linear cross-entropy]
// For token i with hidden row h_i, target t_i and logits z_i = W h_i + b, the
// loss is lse(z_i) - z_i[t_i], and its gradient w.r.t. z_i is
// g_i = softmax(z_i) - onehot(t_i). The gradients of the inputs are
//   d hidden_i = g_i W,   d W = sum_i g_i^T h_i,   d b = sum_i g_i.
// All of them are linear in g, and g depends only on the chunk's own logits,
// so a chunk of tokens can be finished completely (loss and its share of every
// gradient) before the next chunk's logits are computed; the logits buffer is
// then reused. The returned loss is a sum, so the true gradients are these
// sums times the scalar that arrives in backward: backward is a scaling.
//
// The per-token variant cannot do this: each token's upstream weight is known
// only in backward, and d W mixes tokens. Its forward computes the losses
// alone and its backward recomputes the logits chunk by chunk with the
// weights folded into g (one extra chunk GEMM per chunk).
//
// Note [A vocabulary split across ranks]
// Under tensor parallelism each rank holds rows [o, o + V) of the head, so
// a chunk's logits are split by column across the ranks. The loss needs
// three per-token quantities over the whole vocabulary, and each is a
// reduction of per-rank parts (as Megatron's vocab-parallel cross-entropy):
//   m = max over all logits (max_across; the same m on every rank keeps the
//       partial sums on one scale),
//   S = sum of exp(z - m), and z[t] - m (only the rank holding t has it, the
//       others add 0): both in one sum_across of a [rows, 2] tensor.
// loss = log S - (z[t] - m). The gradient of this rank's logits is
// exp(z - m) / S - onehot(t - o), local once S is known, so the chunk is
// finished as in the unsplit case: two small collectives per chunk, no
// logits gathered. Its hidden gradient g W is this rank's part; the caller's
// column-parallel input sums the parts in backward.
//
// Numerics: the softmax runs in fp32 (fp64 for double inputs) and is computed
// in place on the chunk: subtract the row max, exponentiate, divide by the row
// sum, subtract 1 at the target. The matrix products use ATen's BLAS and its
// threading; the row work uses ATen's vectorised in-place ops on the whole
// chunk, which also run on ATen's thread pool.
#include "scaletrain/kernels/linear_cross_entropy.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "scaletrain/util/error.h"

namespace scaletrain::kernels {
namespace {

using torch::Tensor;
using Options = LinearCrossEntropyOptions;

constexpr int64_t kChunkBytes = int64_t{8} << 20;  // upper end of the 4-8 MiB window
constexpr int64_t kMinChunkTokens = 128;           // enough work per pass over the weight gradient

// Sizes and dtypes of one call, after checking.
struct Shape {
  int64_t tokens = 0;    // N
  int64_t features = 0;  // C
  int64_t vocab = 0;     // V
  at::ScalarType gemm = at::kFloat;  // dtype of the matrix products
  at::ScalarType row = at::kFloat;   // dtype of softmax, losses, bias grad
  int64_t offset = 0;                // first vocabulary row of the weight
  int64_t total = 0;                 // entries of the whole vocabulary
};

template <typename T>
std::string str(const T& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

[[noreturn]] void fail(const std::string& message) { throw UsageError("linear_cross_entropy: " + message); }

void check_float(const Tensor& t, const char* name) {
  if (!at::isFloatingType(t.scalar_type()))
    fail(std::string(name) + " must be a floating tensor, got " + str(t.scalar_type()));
}

// Targets outside [0, V) that are not ignore_index: names the first one.
void check_target_range(const Tensor& flat_targets, int64_t vocab, int64_t ignore) {
  const auto bad = flat_targets.ne(ignore).logical_and(flat_targets.lt(0).logical_or(flat_targets.ge(vocab)));
  const int64_t n_bad = bad.sum().item<int64_t>();
  if (n_bad == 0) return;
  const int64_t at = bad.nonzero()[0][0].item<int64_t>();
  fail("target " + std::to_string(flat_targets[at].item<int64_t>()) + " at token " + std::to_string(at) +
       " is outside [0, " + std::to_string(vocab) + ") and is not ignore_index " + std::to_string(ignore) + " (" +
       std::to_string(n_bad) + " such targets)");
}

// The weight's rows must lie inside the whole vocabulary; both reductions set.
void check_shard(const VocabShard& shard, Shape& s) {
  if (!shard.max_across || !shard.sum_across) fail("vocab_shard needs both reductions (max_across, sum_across)");
  if (shard.offset < 0 || shard.offset + s.vocab > shard.total)
    fail("vocab_shard rows [" + std::to_string(shard.offset) + ", " + std::to_string(shard.offset + s.vocab) +
         ") of the weight lie outside the vocabulary of " + std::to_string(shard.total));
  s.offset = shard.offset;
  s.total = shard.total;
}

// The paths that cannot combine a split vocabulary refuse one.
void refuse_shard(const Options& o, const char* path) {
  if (o.vocab_shard)
    fail(std::string("vocab_shard is taken only by the fused sum (") + path + " cannot reduce across ranks)");
}

Shape check_inputs(const Tensor& hidden, const Tensor& weight, const Tensor& bias, const Tensor& targets,
                   const Options& o) {
  if (!hidden.defined() || !weight.defined() || !targets.defined()) fail("hidden, weight and targets must be defined");
  if (hidden.dim() < 1) fail("hidden must have at least one dimension, got a 0-dim tensor");
  if (weight.dim() != 2) fail("weight must be [V, C], got " + str(weight.sizes()));
  check_float(hidden, "hidden");
  check_float(weight, "weight");
  Shape s;
  s.features = hidden.size(-1);
  s.vocab = weight.size(0);
  s.tokens = 1;  // every leading dimension is a token dimension
  for (int64_t d = 0; d + 1 < hidden.dim(); ++d) s.tokens *= hidden.size(d);
  if (weight.size(1) != s.features)
    fail("hidden " + str(hidden.sizes()) + " has C=" + std::to_string(s.features) + " features but weight is " +
         str(weight.sizes()));
  if (s.vocab < 1) fail("weight " + str(weight.sizes()) + " has an empty vocabulary");
  if (bias.defined()) {
    check_float(bias, "bias");
    if (bias.dim() != 1 || bias.size(0) != s.vocab)
      fail("bias must be [" + std::to_string(s.vocab) + "] to match weight " + str(weight.sizes()) + ", got " +
           str(bias.sizes()));
  }
  if (targets.scalar_type() != at::kLong) fail("targets must be int64, got " + str(targets.scalar_type()));
  if (targets.numel() != s.tokens)
    fail("targets " + str(targets.sizes()) + " has " + std::to_string(targets.numel()) + " elements but hidden " +
         str(hidden.sizes()) + " has " + std::to_string(s.tokens) + " tokens");
  for (const Tensor* t : {&weight, &bias, &targets})
    if (t->defined() && t->device() != hidden.device())
      fail("all inputs must be on hidden's device " + str(hidden.device()) + ", found one on " + str(t->device()));
  if (o.chunk_tokens < 0) fail("chunk_tokens must be >= 0 (0 = automatic), got " + std::to_string(o.chunk_tokens));
  s.total = s.vocab;
  if (o.vocab_shard) check_shard(*o.vocab_shard, s);
  check_target_range(targets.reshape({-1}), s.total, o.ignore_index);

  const auto promoted = at::promote_types(hidden.scalar_type(), weight.scalar_type());
  const bool reduced = promoted == at::kBFloat16 || promoted == at::kHalf;
  s.gemm = reduced && o.upcast ? at::kFloat : promoted;
  s.row = promoted == at::kDouble ? at::kDouble : at::kFloat;
  return s;
}

// The inputs of the fused loop, flattened and converted once.
struct Problem {
  Shape shape;
  Tensor hidden;   // [N, C], input dtype (chunks are converted as they are used)
  Tensor weight;   // [V, C], gemm dtype
  Tensor bias;     // [V], gemm dtype, or undefined
  Tensor targets;  // [N] int64
  int64_t chunk = 1;
  int64_t ignore = -100;
  std::optional<VocabShard> shard;  // Note [A vocabulary split across ranks]
};

Problem make_problem(const Tensor& hidden, const Tensor& weight, const Tensor& bias, const Tensor& targets,
                     const Options& o) {
  Problem p;
  p.shape = check_inputs(hidden, weight, bias, targets, o);
  const auto& s = p.shape;
  p.hidden = hidden.reshape({s.tokens, s.features});
  p.weight = weight.to(s.gemm);
  if (bias.defined()) p.bias = bias.to(s.gemm);
  p.targets = targets.reshape({-1}).contiguous();
  p.chunk = linear_cross_entropy_chunk_tokens(s.vocab, at::elementSize(s.row), o.chunk_tokens);
  p.ignore = o.ignore_index;
  p.shard = o.vocab_shard;
  return p;
}

// Which gradients to form, and the per-token upstream weights (undefined
// means 1 for every token).
struct Wanted {
  bool hidden = false, weight = false, bias = false;
  Tensor row_scale;  // [N], row dtype
  bool any() const { return hidden || weight || bias; }
};

// Gradients are in the compute dtypes; the caller converts them.
struct Outputs {
  Tensor losses;  // [N], row dtype, 0 at ignored targets
  Tensor hidden, weight, bias;
};

// One chunk's row work, in place on x [r, V] (row dtype, contiguous): writes
// each token's loss to loss_out and, when `grad` is set, replaces x with
// scale_i * (softmax(x_i) - onehot(t_i)); rows of ignored targets become 0.
void softmax_rows(Tensor& x, const Tensor& targets, const Tensor& scale, int64_t ignore, bool grad,
                  Tensor loss_out) {
  const auto dropped = targets.eq(ignore);
  const auto column = targets.masked_fill(dropped, 0).unsqueeze(1);
  const auto row_max = x.amax(1, /*keepdim=*/true);
  const auto picked = x.gather(1, column);
  x.sub_(row_max).exp_();
  const auto denom = x.sum(1, /*keepdim=*/true);
  loss_out.copy_((row_max + denom.log() - picked).squeeze(1).masked_fill(dropped, 0));
  if (!grad) return;
  auto k = dropped.logical_not().to(x.scalar_type()).unsqueeze(1);
  if (scale.defined()) k = k * scale.unsqueeze(1);
  x.mul_(k / denom);
  x.scatter_add_(1, column, -k);
}

// softmax_rows for this rank's columns of a split vocabulary (Note [A
// vocabulary split across ranks]): the row maximum, the exponential sums and
// the target's logit are combined across the ranks before use.
void softmax_rows_split(Tensor& x, const Tensor& targets, const Tensor& scale, const Problem& p, bool grad,
                        Tensor loss_out) {
  const int64_t first = p.shape.offset, rows = x.size(1);
  const auto dropped = targets.eq(p.ignore);
  const auto mine = targets.ge(first).logical_and(targets.lt(first + rows)).logical_and(dropped.logical_not());
  const auto column = (targets - first).masked_fill(mine.logical_not(), 0).unsqueeze(1);
  auto row_max = x.amax(1, /*keepdim=*/true).contiguous();
  p.shard->max_across(row_max);
  auto stats = torch::empty({x.size(0), 2}, x.options());
  stats.select(1, 0).copy_((x.gather(1, column) - row_max).squeeze(1).masked_fill(mine.logical_not(), 0));
  x.sub_(row_max).exp_();
  stats.select(1, 1).copy_(x.sum(1));
  p.shard->sum_across(stats);
  const auto denom = stats.select(1, 1).unsqueeze(1);
  loss_out.copy_((denom.log() - stats.select(1, 0).unsqueeze(1)).squeeze(1).masked_fill(dropped, 0));
  if (!grad) return;
  auto k = dropped.logical_not().to(x.scalar_type()).unsqueeze(1);
  if (scale.defined()) k = k * scale.unsqueeze(1);
  x.mul_(k / denom);
  x.scatter_add_(1, column, -k * mine.to(x.scalar_type()).unsqueeze(1));
}

// The chunk loop of Note [Chunked linear cross-entropy].
Outputs run_chunks(const Problem& p, const Wanted& want) {
  const auto& s = p.shape;
  const auto gemm_opts = torch::TensorOptions().dtype(s.gemm).device(p.hidden.device());
  const auto row_opts = gemm_opts.dtype(s.row);
  Outputs out;
  out.losses = torch::zeros({s.tokens}, row_opts);
  if (want.hidden) out.hidden = torch::empty({s.tokens, s.features}, gemm_opts);
  if (want.weight) out.weight = torch::zeros({s.vocab, s.features}, gemm_opts);
  if (want.bias) out.bias = torch::zeros({s.vocab}, row_opts);
  if (s.tokens == 0) return out;

  const int64_t chunk = std::min(p.chunk, s.tokens);
  auto logits_buf = torch::empty({chunk, s.vocab}, gemm_opts);
  auto row_buf = s.row == s.gemm ? logits_buf : torch::empty({chunk, s.vocab}, row_opts);
  const auto weight_t = p.weight.t();
  for (int64_t begin = 0; begin < s.tokens; begin += chunk) {
    const int64_t rows = std::min(chunk, s.tokens - begin);
    const auto h = p.hidden.narrow(0, begin, rows).to(s.gemm);
    auto logits = logits_buf.narrow(0, 0, rows);
    if (p.bias.defined())
      at::addmm_out(logits, p.bias, h, weight_t);
    else
      at::mm_out(logits, h, weight_t);
    auto x = row_buf.narrow(0, 0, rows);
    if (s.row != s.gemm) x.copy_(logits);
    const auto scale = want.row_scale.defined() ? want.row_scale.narrow(0, begin, rows) : Tensor();
    const auto t = p.targets.narrow(0, begin, rows);
    if (p.shard)
      softmax_rows_split(x, t, scale, p, want.any(), out.losses.narrow(0, begin, rows));
    else
      softmax_rows(x, t, scale, p.ignore, want.any(), out.losses.narrow(0, begin, rows));
    if (!want.any()) continue;
    if (s.row != s.gemm) logits.copy_(x);
    if (want.bias) out.bias.add_(x.sum(0));
    if (want.hidden) {
      auto dh = out.hidden.narrow(0, begin, rows);
      at::mm_out(dh, logits, p.weight);
    }
    if (want.weight) out.weight.addmm_(logits.t(), h);
  }
  return out;
}

// Converts a gradient from the compute dtype to its input's dtype and shape.
Tensor as_input(const Tensor& grad, const Tensor& input) {
  if (!grad.defined()) return grad;
  return grad.to(input.scalar_type()).reshape(input.sizes());
}

Tensor count_kept(const Tensor& targets, int64_t ignore) { return targets.ne(ignore).sum(); }

// What the autograd functions carry besides tensors.
struct Setup {
  Options options;
  Wanted want;  // which gradients the sum variant forms in forward
};

// Sum variant: gradients are formed in forward and scaled in backward.
struct FusedSum : public torch::autograd::Function<FusedSum> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& hidden,
                                                const Tensor& weight, const c10::optional<Tensor>& bias,
                                                const Tensor& targets, const Setup& setup) {
    const Tensor b = bias.value_or(Tensor());
    const auto p = make_problem(hidden, weight, b, targets, setup.options);
    auto out = run_chunks(p, setup.want);
    auto sum = out.losses.sum();
    auto count = count_kept(p.targets, p.ignore);
    ctx->mark_non_differentiable({count});
    ctx->saved_data["hidden"] = as_input(out.hidden, hidden);
    ctx->saved_data["weight"] = as_input(out.weight, weight);
    ctx->saved_data["bias"] = as_input(out.bias, b);
    return {sum, count};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The saved gradients are handed over and scaled in place, so that the
    // weight's gradient exists once, not twice; a second backward through the
    // same graph (retain_graph) finds them gone and says so.
    const auto& g = grads[0];
    if (ctx->saved_data.count("weight") == 0)
      throw std::runtime_error(
          "linear_cross_entropy: backward ran twice through the same fused loss; "
          "its saved gradients are consumed by the first backward (use the unfused path to retain the graph)");
    auto scaled = [&](const char* key) {
      auto saved = ctx->saved_data.at(key).toTensor();
      ctx->saved_data.erase(key);
      return saved.defined() ? saved.mul_(g) : Tensor();
    };
    return {scaled("hidden"), scaled("weight"), scaled("bias"), Tensor(), Tensor()};
  }
};

// Per-token variant: forward computes losses only; backward recomputes.
struct FusedPerToken : public torch::autograd::Function<FusedPerToken> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& hidden, const Tensor& weight,
                        const c10::optional<Tensor>& bias, const Tensor& targets, const Setup& setup) {
    const Tensor b = bias.value_or(Tensor());
    const auto p = make_problem(hidden, weight, b, targets, setup.options);
    ctx->save_for_backward({hidden, weight, b, targets});
    ctx->saved_data["ignore_index"] = setup.options.ignore_index;
    ctx->saved_data["chunk_tokens"] = setup.options.chunk_tokens;
    ctx->saved_data["upcast"] = setup.options.upcast;
    return run_chunks(p, Wanted{}).losses;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Options o;
    o.ignore_index = ctx->saved_data["ignore_index"].toInt();
    o.chunk_tokens = ctx->saved_data["chunk_tokens"].toInt();
    o.upcast = ctx->saved_data["upcast"].toBool();
    const auto p = make_problem(saved[0], saved[1], saved[2], saved[3], o);
    Wanted want;
    want.hidden = ctx->needs_input_grad(0);
    want.weight = ctx->needs_input_grad(1);
    want.bias = saved[2].defined() && ctx->needs_input_grad(2);
    want.row_scale = grads[0].to(p.shape.row).reshape({-1});
    const auto out = run_chunks(p, want);
    return {as_input(out.hidden, saved[0]), as_input(out.weight, saved[1]), as_input(out.bias, saved[2]), Tensor(),
            Tensor()};
  }
};

// Which gradients autograd will ask for, decided outside the Function (whose
// forward runs with grad mode off).
Wanted wanted_grads(const Tensor& hidden, const Tensor& weight, const Tensor& bias) {
  Wanted want;
  if (!torch::GradMode::is_enabled()) return want;
  want.hidden = hidden.requires_grad();
  want.weight = weight.requires_grad();
  want.bias = bias.defined() && bias.requires_grad();
  return want;
}

c10::optional<Tensor> optional_bias(const Tensor& bias) {
  return bias.defined() ? c10::optional<Tensor>(bias) : c10::nullopt;
}

// The unfused logits [N, V] in the row dtype.
Tensor full_logits(const Tensor& hidden, const Tensor& weight, const Tensor& bias, const Shape& s) {
  const auto h = hidden.reshape({s.tokens, s.features}).to(s.gemm);
  const auto w = weight.to(s.gemm);
  const auto logits = bias.defined() ? at::addmm(bias.to(s.gemm), h, w.t()) : at::mm(h, w.t());
  return logits.to(s.row);
}

}  // namespace

bool fused_linear_cross_entropy_applies(const torch::Tensor& hidden) {
  return hidden.defined() && hidden.device().is_cpu() && hidden.layout() == torch::kStrided;
}

int64_t linear_cross_entropy_chunk_tokens(int64_t vocab, int64_t element_size, int64_t requested) {
  if (requested > 0) return requested;
  const int64_t row_bytes = std::max<int64_t>(1, vocab) * std::max<int64_t>(1, element_size);
  return std::max<int64_t>(kMinChunkTokens, kChunkBytes / row_bytes);
}

std::tuple<Tensor, Tensor> linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& bias,
                                                const Tensor& targets, const Options& options) {
  if (!fused_linear_cross_entropy_applies(hidden))
    return linear_cross_entropy_unfused(hidden, weight, bias, targets, options);
  Setup setup{options, wanted_grads(hidden, weight, bias)};
  if (!setup.want.any()) {
    torch::NoGradGuard no_grad;
    const auto p = make_problem(hidden, weight, bias, targets, options);
    return {run_chunks(p, Wanted{}).losses.sum(), count_kept(p.targets, p.ignore)};
  }
  const auto out = FusedSum::apply(hidden, weight, optional_bias(bias), targets, setup);
  return {out[0], out[1]};
}

Tensor linear_cross_entropy_per_token(const Tensor& hidden, const Tensor& weight, const Tensor& bias,
                                      const Tensor& targets, const Options& options) {
  refuse_shard(options, "the per-token variant");
  if (!fused_linear_cross_entropy_applies(hidden))
    return linear_cross_entropy_per_token_unfused(hidden, weight, bias, targets, options);
  if (!wanted_grads(hidden, weight, bias).any()) {
    torch::NoGradGuard no_grad;
    return run_chunks(make_problem(hidden, weight, bias, targets, options), Wanted{}).losses;
  }
  return FusedPerToken::apply(hidden, weight, optional_bias(bias), targets, Setup{options, {}});
}

std::tuple<Tensor, Tensor> linear_cross_entropy_unfused(const Tensor& hidden, const Tensor& weight,
                                                        const Tensor& bias, const Tensor& targets,
                                                        const Options& options) {
  refuse_shard(options, "the unfused path");
  const auto s = check_inputs(hidden, weight, bias, targets, options);
  const auto t = targets.reshape({-1});
  const auto sum = at::cross_entropy_loss(full_logits(hidden, weight, bias, s), t, c10::nullopt, at::Reduction::Sum,
                                          options.ignore_index);
  return {sum, count_kept(t, options.ignore_index)};
}

Tensor linear_cross_entropy_per_token_unfused(const Tensor& hidden, const Tensor& weight, const Tensor& bias,
                                              const Tensor& targets, const Options& options) {
  refuse_shard(options, "the unfused path");
  const auto s = check_inputs(hidden, weight, bias, targets, options);
  return at::cross_entropy_loss(full_logits(hidden, weight, bias, s), targets.reshape({-1}), c10::nullopt,
                                at::Reduction::None, options.ignore_index);
}

}  // namespace scaletrain::kernels

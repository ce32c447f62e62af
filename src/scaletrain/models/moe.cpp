#include "scaletrain/models/moe.h"

#include <cmath>
#include <stdexcept>

#include "scaletrain/kernels/norm_activation.h"
#include "scaletrain/models/checkpoint.h"

namespace scaletrain::models {

namespace {

// Router arithmetic runs in fp32, or fp64 for an fp64 model (the parity tests).
at::ScalarType router_dtype(const torch::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Note [Auxiliary losses]: the identity on a layer's output whose backward
// also gives `loss` (a scalar) the gradient `scale`.
struct AttachLoss : public torch::autograd::Function<AttachLoss> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& out,
                               const torch::Tensor& loss, double scale) {
    ctx->saved_data["grad"] = torch::full({}, scale, loss.options());
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    return {grad[0], ctx->saved_data["grad"].toTensor(), torch::Tensor()};
  }
};

}  // namespace

Routing route(const torch::Tensor& logits, const MoeOptions& o, int64_t seq_len) {
  const int64_t n = logits.size(0), e = o.num_experts, k = o.experts_per_token;
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) == e, "route: logits [N, ", e, "] expected");
  TORCH_CHECK(seq_len > 0 && n % seq_len == 0, "route: ", n, " tokens are not whole sequences of ", seq_len);
  Routing r;
  r.logits = logits;
  r.probs = torch::softmax(logits.to(router_dtype(logits)), -1);
  auto [top, idx] = r.probs.topk(k, -1, /*largest=*/true, /*sorted=*/true);
  r.experts = idx;
  r.weights = top / top.sum(-1, /*keepdim=*/true);
  torch::NoGradGuard no_grad;
  r.kept = torch::ones({n, k}, torch::TensorOptions().dtype(at::kBool).device(logits.device()));
  if (o.capacity_factor > 0) {
    // Each sequence's slots in token order (token t's slot j at t*k + j); an
    // expert keeps its first C slots in the policy's order.
    const int64_t s = n / seq_len, slots = seq_len * k;
    const auto capacity = static_cast<int64_t>(
        std::ceil(o.capacity_factor * static_cast<double>(seq_len * k) / static_cast<double>(e)));
    torch::Tensor expert = idx.reshape({s, slots});
    torch::Tensor order;  // [s, slots]: slot indices in priority order
    if (o.drop_policy == "position") {
      order = torch::arange(slots, idx.options()).expand({s, slots});
    } else {  // probs: higher router probability first, the earlier slot on ties
      order = std::get<1>(top.detach().reshape({s, slots}).sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
    }
    const torch::Tensor sorted_expert = expert.gather(1, order);
    // Position of each slot among its expert's slots, in priority order.
    const torch::Tensor onehot = torch::one_hot(sorted_expert, e);  // [s, slots, e]
    const torch::Tensor rank = (onehot.cumsum(1) * onehot).sum(-1) - 1;
    const torch::Tensor keep_sorted = rank < capacity;
    torch::Tensor keep = torch::empty_like(keep_sorted);
    keep.scatter_(1, order, keep_sorted);
    r.kept = keep.reshape({n, k});
  }
  return r;
}

torch::Tensor load_balancing_loss(const Routing& r, const MoeOptions& o, int64_t seq_len) {
  const int64_t n = r.probs.size(0), e = o.num_experts, k = o.experts_per_token, s = n / seq_len;
  const torch::Tensor p = r.probs.reshape({s, seq_len, e}).mean(1);  // P_i per sequence
  torch::Tensor f;
  {
    torch::NoGradGuard no_grad;
    f = torch::one_hot(r.experts.reshape({s, seq_len * k}), e).sum(1).to(r.probs.scalar_type()) /
        static_cast<double>(seq_len * k);
  }
  return ((f * p).sum(-1) * static_cast<double>(e)).mean();
}

torch::Tensor router_z_loss(const Routing& r) {
  return torch::logsumexp(r.logits.to(router_dtype(r.logits)), -1).pow(2).mean();
}

MoeExpertImpl::MoeExpertImpl(int64_t width, int64_t inner, bool fused) : fused_(fused) {
  w1 = register_module("w1", Linear(width, inner, false));
  w2 = register_module("w2", Linear(inner, width, false));
  w3 = register_module("w3", Linear(width, inner, false));
}

torch::Tensor MoeExpertImpl::forward(const torch::Tensor& x) {
  return w2(fused_ ? kernels::swiglu(w1(x), w3(x)) : torch::silu(w1(x)) * w3(x));
}

SparseMoeBlockImpl::SparseMoeBlockImpl(int64_t width, int64_t inner, MoeOptions o) : o_(std::move(o)) {
  gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(width, o_.num_experts).bias(false)));
  experts = register_module("experts", std::make_shared<torch::nn::Module>());
  for (int64_t j = 0; j < o_.num_experts; ++j)
    local_.push_back(experts->register_module(std::to_string(j), MoeExpert(width, inner, o_.fused)));
}

void SparseMoeBlockImpl::set_expert_parallel(interfaces::ExpertParallelHooksPtr hooks) {
  TORCH_CHECK(hooks && hooks->local_experts > 0 && hooks->first_expert >= 0 &&
                  hooks->first_expert + hooks->local_experts <= o_.num_experts && first_ == 0 &&
                  static_cast<int64_t>(local_.size()) == o_.num_experts,
              "SparseMoeBlock: expert parallelism is set once, on a block holding every expert");
  std::vector<MoeExpert> kept;
  for (int64_t j = 0; j < o_.num_experts; ++j) {
    if (j >= hooks->first_expert && j < hooks->first_expert + hooks->local_experts)
      kept.push_back(local_[static_cast<size_t>(j)]);
    else
      experts->unregister_module(std::to_string(j));
  }
  local_ = std::move(kept);
  first_ = hooks->first_expert;
  ep_ = std::move(hooks);
}

torch::Tensor SparseMoeBlockImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2), e = o_.num_experts, k = o_.experts_per_token;
  const torch::Tensor flat = x.reshape({b * t, c});
  const Routing r = route(gate(flat), o_, t);

  // The kept slots, sorted by expert (stable: token order within an expert).
  torch::Tensor token, order;
  std::vector<int64_t> counts(static_cast<size_t>(e), 0);
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor tokens = torch::arange(b * t, r.experts.options()).unsqueeze(1).expand({b * t, k});
    const torch::Tensor sel_expert = r.experts.masked_select(r.kept);
    order = std::get<1>(sel_expert.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    token = tokens.masked_select(r.kept).index_select(0, order);
    const torch::Tensor hist = torch::bincount(sel_expert, {}, e).cpu();  // host: E counts, read one by one
    for (int64_t j = 0; j < e; ++j) counts[static_cast<size_t>(j)] = hist[j].item<int64_t>();
  }
  const torch::Tensor weight = r.weights.masked_select(r.kept).index_select(0, order);

  const torch::Tensor xs = flat.index_select(0, token);
  auto run_expert = [this](int64_t j, const torch::Tensor& in) {
    return local_.at(static_cast<size_t>(j - first_))->forward(in);
  };
  torch::Tensor ys;
  if (ep_) {
    ys = ep_->run(xs, counts, run_expert);
  } else {
    // Every expert runs, an empty one on no rows: each parameter gets a
    // gradient every step (zeros when unused), as data-parallel engines expect.
    std::vector<torch::Tensor> parts;
    int64_t at = 0;
    for (int64_t j = 0; j < e; ++j) {
      parts.push_back(run_expert(j, xs.narrow(0, at, counts[static_cast<size_t>(j)])));
      at += counts[static_cast<size_t>(j)];
    }
    ys = torch::cat(parts, 0);
  }
  ys = ys * weight.to(ys.scalar_type()).unsqueeze(1);
  torch::Tensor out = torch::zeros_like(flat).index_add(0, token, ys).reshape({b, t, c});

  // Note [Auxiliary losses].
  const bool record = context && !recomputing();
  const bool attach = torch::GradMode::is_enabled() && is_training() && (o_.aux_loss_coef != 0 || o_.z_loss_coef != 0);
  if (!record && !attach) return out;
  const torch::Tensor aux = load_balancing_loss(r, o_, t), z = router_z_loss(r);
  if (record) {
    MoeStats& s = context->stats;
    s.aux_sum += aux.item<double>();
    s.z_sum += z.item<double>();
    s.forwards += 1;
    if (s.tokens_per_expert.empty()) s.tokens_per_expert.assign(static_cast<size_t>(e), 0);
    for (int64_t j = 0; j < e; ++j) s.tokens_per_expert[static_cast<size_t>(j)] += counts[static_cast<size_t>(j)];
    s.dropped += b * t * k - token.size(0);
  }
  if (attach) {
    const double layers = context ? static_cast<double>(std::max<int64_t>(1, context->layers)) : 1.0;
    const double multiplier = context ? context->multiplier : 1.0;
    const torch::Tensor extra = o_.aux_loss_coef * aux + o_.z_loss_coef * z;
    out = AttachLoss::apply(out, extra, multiplier / layers);
  }
  return out;
}

}  // namespace scaletrain::models

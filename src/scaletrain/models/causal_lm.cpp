#include "scaletrain/models/causal_lm.h"

#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora.h"

#include <limits>

#include "scaletrain/kernels/linear_cross_entropy.h"
#include "scaletrain/precision/autocast_compat.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::models {

torch::Tensor CausalLM::forward(const torch::Tensor& idx) {
  torch::Tensor x = embed(idx);
  for (int64_t i = 0; i < num_blocks(); ++i) {
    const interfaces::BlockBody body = block_body(i);
    x = runner_ ? runner_(i, body, x) : body(x);
  }
  return head_logits(x);
}

torch::Tensor CausalLM::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  torch::Tensor x = embed(idx);
  for (int64_t i = 0; i < num_blocks(); ++i) {
    const interfaces::BlockBody body = block_body(i);
    x = runner_ ? runner_(i, body, x) : body(x);
  }
  return head_loss(x, targets);
}

namespace {

// Note [Tracing] (util/trace.h): block i's forward as a span, and its
// backward as the interval from the gradient of its output (the block's
// backward begins) to the gradient of its input (it has ended). Only while
// a step is traced: otherwise the body runs as it is.
interfaces::BlockBody traced(interfaces::BlockBody body, int64_t i) {
  if (!trace::on()) return body;
  return [body = std::move(body), i](const torch::Tensor& in) {
    trace::Span span("forward", "forward block", i);
    torch::Tensor out = body(in);
    span.end();
    if (torch::GradMode::is_enabled() && in.requires_grad() && out.requires_grad()) {
      auto begun = std::make_shared<int64_t>(0);
      out.register_hook([begun](const torch::Tensor&) { *begun = trace::now_ns(); });
      // `in` is a non-leaf shared with the previous block's hook; this one
      // fires once its whole gradient (residual path included) is known.
      torch::Tensor(in).register_hook([begun, i](const torch::Tensor&) {
        if (*begun) trace::span("backward", "backward block", i, *begun, trace::now_ns());
      });
    }
    return out;
  };
}

}  // namespace

interfaces::BlockBody CausalLM::block_body(int64_t i) {
  interfaces::BlockBody body = [this, i](const torch::Tensor& in) { return run_block(i, in); };
  if (checkpointing_ != ActivationCheckpointing::Full) return traced(std::move(body), i);
  CheckpointOptions ckpt;
  ckpt.preserve_rng = config_.dropout > 0;  // no dropout: no random draws to replay
  std::vector<at::Tensor> params = block_module(i).second->parameters();
  return traced(
      [plain = std::move(body), params, ckpt](const torch::Tensor& in) { return checkpoint(plain, in, params, ckpt); },
      i);
}

torch::Tensor CausalLM::generate(torch::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k) {
  torch::NoGradGuard no_grad;
  // Tensor parallel: sample with the hooks meant for it, and put the training
  // ones back however this returns.
  struct Restore {
    CausalLM* model;
    TensorParallelHooksPtr hooks;
    ~Restore() {
      if (hooks) model->set_tensor_parallel(hooks);
    }
  } restore{this, nullptr};
  if (tp_ && tp_->sampling) {
    restore.hooks = tp_;
    set_tensor_parallel(tp_->sampling);
  }
  const int64_t window = config_.block_size;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    auto ctx = idx.size(1) <= window ? idx : idx.slice(1, idx.size(1) - window);
    auto logits = forward(ctx).select(1, ctx.size(1) - 1).to(torch::kFloat) / std::max(temperature, 1e-6);
    if (top_k > 0 && top_k < logits.size(-1)) {
      auto kth = std::get<0>(logits.topk(top_k, -1)).select(-1, top_k - 1).unsqueeze(-1);
      logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
    }
    auto next = torch::multinomial(torch::softmax(logits, -1), 1);
    if (tp_ && tp_->broadcast_tokens) next = tp_->broadcast_tokens(next);
    idx = torch::cat({idx, next}, 1);
  }
  return idx;
}

int64_t CausalLM::num_parameters() const {
  int64_t n = 0;
  for (const auto& item : named_modules()) {
    const auto* lin = item.value()->as<LinearImpl>();
    if (lin && lin->quantized()) n += lin->in_features() * lin->out_features();  // NF4: the weights, not their bytes
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false))
      if (!(lin && lin->quantized() && p.value().scalar_type() == at::kByte)) n += p.value().numel();
  }
  return n;
}

double CausalLM::step_flops_per_token(int64_t seq_len) const {
  double frozen = 0;
  for (const auto& item : named_modules()) {
    const auto* lin = item.value()->as<LinearImpl>();
    if (lin && (lin->quantized() || !lin->weight.requires_grad()))
      frozen += static_cast<double>(lin->in_features()) * static_cast<double>(lin->out_features());
  }
  return flops_per_token(seq_len) - 2.0 * frozen;
}

TensorParallelSplit CausalLM::parameter_split(const std::string& name) const {
  if (!is_adapter_parameter(name)) return tensor_parallel_split(name);
  // "<layer>.lora_A.weight" follows "<layer>.weight".
  const std::string layer = name.substr(0, name.size() - std::string("lora_A.weight").size());
  return adapter_split(name, tensor_parallel_split(layer + "weight"));
}

std::vector<std::string> CausalLM::split_problems(int tp) const {
  if (tp < 1) return {tensor_parallel_degree_problem(tp)};
  return family_split_problems(tp);
}

interfaces::StageShape CausalLM::stage_shape() const {
  return {config_.n_embd, config_.block_size, config_.vocab_size};
}

void CausalLM::finish_construction(bool materialize) {
  if (!materialize) return;  // each module gave its bytes back as it was built
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) init_parameter(item.key(), item.value());
}

void CausalLM::check_length(int64_t T) const {
  if (T > config_.block_size)
    throw std::invalid_argument("sequence of " + std::to_string(T) + " tokens exceeds block_size " +
                                std::to_string(config_.block_size));
}

torch::Tensor CausalLM::head_cross_entropy(const torch::Tensor& y, const torch::Tensor& head,
                                           const torch::Tensor& targets) const {
  const bool fused = config_.fused && kernels::fused_linear_cross_entropy_applies(y);
  const bool split = tp_ != nullptr;
  if (split && (!fused || !tp_->max_across || !tp_->sum_across)) return tp_->loss(y, head, targets);
  if (!fused) return causal_lm_cross_entropy(torch::matmul(y, head.t()), targets);
  // As autocast would run the head's matmul: both operands in its dtype (the
  // kernel then forms each chunk's logits in fp32, as the unfused loss upcasts
  // them), and autocast off for the kernel's own GEMMs.
  torch::Tensor h = split ? tp_->column_input(y) : y, w = head;
  namespace pc = precision::compat;
  const auto cpu = y.device().type();  // the kernel runs on CPU tensors only (checked above)
  if (pc::autocast_enabled(cpu) && y.is_floating_point()) {
    h = h.to(pc::autocast_dtype(cpu));
    w = head.to(pc::autocast_dtype(cpu));
  }
  precision::AutocastGuard off(precision::PrecisionPolicy{}, cpu);
  kernels::LinearCrossEntropyOptions options;
  options.ignore_index = kIgnoreTarget;
  if (split) {
    // This rank's rows of the head (Note [A vocabulary split across ranks] in
    // kernels/linear_cross_entropy.cpp); column_input above sums hidden's
    // gradient over the group in backward.
    const int64_t rows = head.size(0);
    options.vocab_shard = kernels::VocabShard{tp_->rank * rows, config_.vocab_size, tp_->max_across, tp_->sum_across};
  }
  auto [sum, count] = kernels::linear_cross_entropy(h.reshape({-1, h.size(-1)}), w, {}, targets.reshape({-1}), options);
  return sum / count.clamp_min(1).to(sum.scalar_type());
}

torch::Tensor causal_lm_cross_entropy(torch::Tensor logits, const torch::Tensor& targets) {
  if (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kHalf)
    logits = logits.to(torch::kFloat);
  namespace F = torch::nn::functional;
  const auto t = targets.reshape({-1});
  auto sum = F::cross_entropy(logits.view({-1, logits.size(-1)}), t,
                              F::CrossEntropyFuncOptions().ignore_index(kIgnoreTarget).reduction(torch::kSum));
  return sum / (t != kIgnoreTarget).sum().clamp_min(1).to(sum.scalar_type());
}

torch::Tensor row_parallel(const torch::Tensor& y, LinearImpl& proj, const TensorParallelHooks& tp) {
  auto out = tp.row_output(proj.product(y));
  if (proj.has_adapter()) out = out + proj.adapter(y, tp.row_output);
  return proj.bias.defined() ? out + proj.bias : out;
}

bool CausalLM::is_expert_parameter(const std::string&) const { return false; }

void CausalLM::set_expert_parallel(std::shared_ptr<const interfaces::ExpertParallelHooks>) {
  throw std::invalid_argument("expert parallelism needs a model with MoE layers (model family " + config_.family + ")");
}

}  // namespace scaletrain::models

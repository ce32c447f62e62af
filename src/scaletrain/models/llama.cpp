#include "scaletrain/models/llama.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "scaletrain/kernels/norm_activation.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {

RMSNormImpl::RMSNormImpl(int64_t width, double eps, bool fused) : eps_(eps), fused_(fused) {
  weight = register_parameter("weight", torch::ones({width}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (fused_) return kernels::rms_norm(x, weight, eps_);  // the same function; ATen's ops off the CPU
  const auto in = x.scalar_type();
  const auto wide = in == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto h = x.to(wide);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * h.to(in);
}

// Note [Llama 3 rope]: from Llama 3.1 on, the rotary frequencies are
// stretched by wavelength. With L = original_max_positions: a frequency
// whose wavelength 2*pi/f is longer than L / low_freq_factor is divided by
// `factor`; one shorter than L / high_freq_factor is kept; in between the
// two are blended linearly in s = (L / wavelength - low) / (high - low).
std::pair<torch::Tensor, torch::Tensor> rotary_tables(const ModelConfig& c, int64_t T, torch::ScalarType dtype,
                                                       const torch::Device& device) {
  const auto wide = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  const int64_t d = c.head_dim();
  auto inv_freq =
      1.0 / torch::pow(c.rope_theta, torch::arange(0, d, 2, torch::TensorOptions().dtype(torch::kLong).device(device)).to(wide) / static_cast<double>(d));
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == "llama3") {
    const double L = static_cast<double>(rs.original_max_positions);
    const double low_wavelen = L / rs.low_freq_factor, high_wavelen = L / rs.high_freq_factor;
    auto wavelen = 2 * M_PI / inv_freq;
    auto stretched = torch::where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq);
    auto s = (L / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
    auto blended = (1 - s) * stretched / rs.factor + s * stretched;
    auto medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    inv_freq = torch::where(medium, blended, stretched);
  }
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device)).to(wide);
  auto freqs = torch::outer(pos, inv_freq);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

namespace {

// The two halves of the last dimension (x1, x2) -> (-x2, x1).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

torch::nn::Linear head(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

LlamaAttentionImpl::LlamaAttentionImpl(const ModelConfig& c) : c_(c), path_(attention_path(c.attention)) {
  const int64_t hd = c.head_dim();
  const bool qkv_bias = c.attention_bias || c.qkv_bias;
  q_proj = register_module("q_proj", Linear(c.n_embd, c.n_head * hd, qkv_bias));
  k_proj = register_module("k_proj", Linear(c.n_embd, c.kv_heads() * hd, qkv_bias));
  v_proj = register_module("v_proj", Linear(c.n_embd, c.kv_heads() * hd, qkv_bias));
  o_proj = register_module("o_proj", Linear(c.n_head * hd, c.n_embd, c.attention_bias));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& input) {
  // Under tensor parallelism the projections hold this rank's heads only.
  const int64_t hd = c_.head_dim();
  const int64_t nh = q_proj->out_features() / hd, nkv = k_proj->out_features() / hd;
  const torch::Tensor x = tp ? tp->column_input(input) : input;
  const int64_t B = x.size(0), T = x.size(1);
  auto heads = [&](const torch::Tensor& t, int64_t n) { return t.view({B, T, n, hd}).transpose(1, 2); };
  torch::Tensor q = heads(q_proj(x), nh), k = heads(k_proj(x), nkv), v = heads(v_proj(x), nkv);
  const SequenceLayout* layout = sequence ? sequence->layout.get() : nullptr;
  const int64_t span = layout != nullptr && layout->span > 0 ? layout->span : T;
  auto [cos, sin] = rotary_tables(c_, span, q.scalar_type(), q.device());
  if (layout != nullptr) {  // each token's rotation at its position (< span): in its document, or in the whole sequence
    const auto pos = layout->positions.reshape({-1});
    cos = cos.index_select(0, pos).view({B, 1, T, hd});
    sin = sin.index_select(0, pos).view({B, 1, T, hd});
  }
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  auto y = attend(q, k, v, path_, sequence.get()).transpose(1, 2).contiguous().view({B, T, nh * hd});
  return tp ? row_parallel(y, *o_proj, *tp) : o_proj(y);
}

LlamaMLPImpl::LlamaMLPImpl(const ModelConfig& c) : fused_(c.fused) {
  gate_proj = register_module("gate_proj", Linear(c.n_embd, c.mlp_width(), c.mlp_bias));
  up_proj = register_module("up_proj", Linear(c.n_embd, c.mlp_width(), c.mlp_bias));
  down_proj = register_module("down_proj", Linear(c.mlp_width(), c.n_embd, c.mlp_bias));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& input) {
  const torch::Tensor x = tp ? tp->column_input(input) : input;
  auto y = fused_ ? kernels::swiglu(gate_proj(x), up_proj(x)) : torch::silu(gate_proj(x)) * up_proj(x);
  return tp ? row_parallel(y, *down_proj, *tp) : down_proj(y);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const ModelConfig& c) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.n_embd, c.norm_eps, c.fused));
  self_attn = register_module("self_attn", LlamaAttention(c));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.n_embd, c.norm_eps, c.fused));
  if (c.num_local_experts > 0) {
    MoeOptions o;
    o.num_experts = c.num_local_experts;
    o.experts_per_token = c.num_experts_per_tok;
    o.capacity_factor = c.capacity_factor;
    o.drop_policy = c.moe_drop_policy;
    o.aux_loss_coef = c.router_aux_loss_coef;
    o.z_loss_coef = c.router_z_loss_coef;
    o.fused = c.fused;
    block_sparse_moe = register_module("block_sparse_moe", SparseMoeBlock(c.n_embd, c.mlp_width(), o));
  } else {
    mlp = register_module("mlp", LlamaMLP(c));
  }
}

torch::Tensor LlamaDecoderLayerImpl::forward(torch::Tensor x) {
  const torch::Tensor a = self_attn(input_layernorm(x));
  torch::Tensor h;
  // The residual add in the norm's pass; not under autocast, where a bf16
  // output is added to the fp32 stream.
  if (post_attention_layernorm->fused() && a.scalar_type() == x.scalar_type()) {
    std::tie(h, x) = kernels::add_rms_norm(a, x, post_attention_layernorm->weight, post_attention_layernorm->eps());
  } else {
    x = x + a;
    h = post_attention_layernorm(x);
  }
  return x + (block_sparse_moe ? block_sparse_moe(h) : mlp(h));
}

LlamaImpl::LlamaImpl(const ModelConfig& c, bool materialize) : CausalLM(c) {
  c.validate();
  // HF's names: the trunk under "model", the head beside it.
  auto trunk = register_module("model", std::make_shared<torch::nn::Module>());
  embed_tokens = trunk->register_module("embed_tokens", settle(torch::nn::Embedding(c.vocab_size, c.n_embd), materialize));
  layers = trunk->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) layers->push_back(settle(LlamaDecoderLayer(c), materialize));
  for (auto& m : *layers) m->as<LlamaDecoderLayer>()->self_attn->sequence = sequence_;
  norm = trunk->register_module("norm", settle(RMSNorm(c.n_embd, c.norm_eps, c.fused), materialize));
  if (!c.tie_word_embeddings) lm_head = register_module("lm_head", settle(head(c.n_embd, c.vocab_size), materialize));
  if (c.num_local_experts > 0) {
    moe_ = std::make_shared<MoeContext>();
    moe_->layers = c.n_layer;
    moe_->experts = c.num_local_experts;
    for (auto& m : *layers) m->as<LlamaDecoderLayer>()->block_sparse_moe->context = moe_;
  }
  finish_construction(materialize);
}

void LlamaImpl::init_parameter(const std::string& name, at::Tensor& p) const {
  torch::NoGradGuard no_grad;
  const auto ends = [&](const char* s) {
    const std::string suffix(s);
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends("norm.weight") || ends("layernorm.weight"))
    p.fill_(1.0);
  else if (ends(".bias"))
    p.zero_();
  else
    p.normal_(0.0, 0.02);
}

const torch::Tensor& LlamaImpl::head_weight() const { return lm_head ? lm_head->weight : embed_tokens->weight; }

torch::Tensor LlamaImpl::embed(const torch::Tensor& idx) {
  check_length(idx.size(1));
  return tp_ ? tp_->embed_tokens(idx, embed_tokens->weight) : embed_tokens(idx);
}

torch::Tensor LlamaImpl::run_block(int64_t i, const torch::Tensor& x) {
  return layers[i]->as<LlamaDecoderLayer>()->forward(x);
}

torch::Tensor LlamaImpl::head_logits(const torch::Tensor& x) {
  auto y = norm(x);
  if (tp_) return tp_->logits(y, head_weight());
  return torch::matmul(y, head_weight().t());
}

torch::Tensor LlamaImpl::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  auto y = norm(x);
  return head_cross_entropy(y, head_weight(), targets);
}

TensorParallelSplit LlamaImpl::tensor_parallel_split(const std::string& name) const {
  const auto has = [&](const char* part) { return name.find(part) != std::string::npos; };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {0, 1};
  if (has("q_proj.") || has("k_proj.") || has("v_proj.") || has("gate_proj.") || has("up_proj.")) return {0, 1};
  if (has("o_proj.weight") || has("down_proj.weight")) return {1, 1};
  return {};  // norms, row-parallel biases
}

std::vector<std::string> LlamaImpl::tensor_parallel_problems(const ModelConfig& c, int tp) {
  std::vector<std::string> out;
  const std::string degree = "tensor parallel degree tp=" + std::to_string(tp);
  if (c.n_head % tp != 0)
    out.push_back(degree + " does not divide model.n_head=" + std::to_string(c.n_head) +
                  " (attention heads are split across tp ranks)");
  if (c.kv_heads() % tp != 0)
    out.push_back(degree + " does not divide the " + std::to_string(c.kv_heads()) +
                  " key/value heads (model.n_kv_head; each rank keeps whole kv heads, none is replicated)");
  if (c.mlp_width() % tp != 0)
    out.push_back(degree + " does not divide model.intermediate_size=" + std::to_string(c.mlp_width()));
  if (c.vocab_size % tp != 0)
    out.push_back(degree + " does not divide model.vocab_size=" + std::to_string(c.vocab_size) +
                  " (pad the vocabulary to a multiple of " + std::to_string(tp) + ")");
  if (c.num_local_experts > 0)
    out.push_back(degree + " with MoE layers (model.num_local_experts) is not available: experts are not split "
                  "across tp ranks in this build (use data or expert parallelism)");
  return out;
}

void LlamaImpl::set_tensor_parallel(TensorParallelHooksPtr hooks) {
  tp_ = hooks;
  for (auto& m : *layers) {
    auto* layer = m->as<LlamaDecoderLayer>();
    layer->self_attn->tp = hooks;
    if (layer->mlp) layer->mlp->tp = hooks;
  }
}

std::vector<NamedModule> LlamaImpl::first_pieces() { return {{"model.embed_tokens", embed_tokens.ptr()}}; }

std::vector<NamedModule> LlamaImpl::last_pieces() {
  std::vector<NamedModule> out{{"model.norm", norm.ptr()}};
  if (lm_head) out.emplace_back("lm_head", lm_head.ptr());
  return out;
}

NamedModule LlamaImpl::block_module(int64_t i) { return {"model.layers." + std::to_string(i), layers[i]}; }

std::pair<std::string, at::Tensor> LlamaImpl::tied_head() {
  if (lm_head) return {"", at::Tensor()};
  return {"model.embed_tokens.weight", embed_tokens->weight};
}

bool LlamaImpl::is_expert_parameter(const std::string& name) const {
  return name.find(".block_sparse_moe.experts.") != std::string::npos;
}

void LlamaImpl::set_expert_parallel(std::shared_ptr<const interfaces::ExpertParallelHooks> hooks) {
  if (!moe_) CausalLM::set_expert_parallel(hooks);  // refuses
  for (auto& m : *layers) m->as<LlamaDecoderLayer>()->block_sparse_moe->set_expert_parallel(hooks);
}

double LlamaImpl::flops_per_token(int64_t seq_len) const {
  double N = static_cast<double>(num_parameters());
  if (lm_head) N -= static_cast<double>(embed_tokens->weight.numel());
  const auto& c = config();
  if (moe_) {  // a token runs k of each layer's experts (3 matrices each); this rank may hold fewer than E
    const int64_t held = layers->ptr(0)->as<LlamaDecoderLayer>()->block_sparse_moe->local_experts();
    N -= static_cast<double>(c.n_layer * (held - c.num_experts_per_tok) * 3 * c.n_embd * c.mlp_width());
  }
  return 6.0 * N + 12.0 * c.n_layer * c.n_head * c.head_dim() * seq_len;
}

}  // namespace scaletrain::models

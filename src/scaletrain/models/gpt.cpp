#include "scaletrain/models/gpt.h"

#include <cmath>
#include <map>

#include "scaletrain/kernels/layer_norm_gelu.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {

namespace {
const std::map<std::string, GPTConfig>& presets() {
  static const std::map<std::string, GPTConfig> p = [] {
    std::map<std::string, GPTConfig> m;
    m["tiny"] = GPTConfig{256, 128, 4, 4, 128};
    m["gpt2"] = GPTConfig{50257, 1024, 12, 12, 768};
    m["gpt2-medium"] = GPTConfig{50257, 1024, 24, 16, 1024};
    m["gpt2-large"] = GPTConfig{50257, 1024, 36, 20, 1280};
    m["gpt2-xl"] = GPTConfig{50257, 1024, 48, 25, 1600};
    return m;
  }();
  return p;
}
}  // namespace

std::vector<std::string> gpt_preset_names() {
  std::vector<std::string> names;
  for (auto& [k, v] : presets()) names.push_back(k);
  return names;
}

GPTConfig gpt_preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (auto& n : gpt_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw UsageError("unknown model preset '" + name + "' (known: " + known + ")");
  }
  return it->second;
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& c)
    : n_head_(c.n_head), n_embd_(c.n_embd), dropout_(c.dropout), path_(attention_path(c.attention)) {
  c_attn = register_module("c_attn", Linear(c.n_embd, 3 * c.n_embd, c.bias));
  c_proj = register_module("c_proj", Linear(c.n_embd, c.n_embd, c.bias));
}

int64_t CausalSelfAttentionImpl::local_heads() const { return c_attn->out_features() / (3 * (n_embd_ / n_head_)); }

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& input) {
  // Under tensor parallelism c_attn holds this rank's heads only (their q, k
  // and v rows), so the width below is n_embd / tp.
  const int64_t hs = n_embd_ / n_head_, nh = local_heads(), width = nh * hs;
  const torch::Tensor x = tp ? tp->column_input(input) : input;
  const int64_t B = x.size(0), T = x.size(1);
  auto qkv = c_attn(x).split(width, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, nh, hs}).transpose(1, 2); };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  auto y = attend(q, k, v, path_, sequence.get(), dropout_, is_training()).transpose(1, 2).contiguous().view({B, T, width});
  y = tp ? row_parallel(y, *c_proj, *tp) : c_proj(y);
  if (dropout_ > 0) y = torch::dropout(y, dropout_, is_training());
  return y;
}

MLPImpl::MLPImpl(const GPTConfig& c) : dropout_(c.dropout), fused_(c.fused) {
  c_fc = register_module("c_fc", Linear(c.n_embd, c.mlp_width(), c.bias));
  c_proj = register_module("c_proj", Linear(c.mlp_width(), c.n_embd, c.bias));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // GPT-2's tanh approximation; the kernel takes ATen's op off the CPU.
  auto gelu = [&](const torch::Tensor& h) { return fused_ ? kernels::gelu_tanh(h) : torch::gelu(h, "tanh"); };
  torch::Tensor y;
  if (tp)  // c_fc column-parallel, c_proj row-parallel: one reduction per MLP
    y = row_parallel(gelu(c_fc(tp->column_input(x))), *c_proj, *tp);
  else
    y = c_proj(gelu(c_fc(x)));
  if (dropout_ > 0) y = torch::dropout(y, dropout_, is_training());
  return y;
}

BlockImpl::BlockImpl(const GPTConfig& c) : fused_(c.fused) {
  auto ln = [&] {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).elementwise_affine(true).eps(c.norm_eps));
  };
  ln_1 = register_module("ln_1", ln());
  attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", ln());
  mlp = register_module("mlp", MLP(c));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  if (!fused_) {
    x = x + attn(ln_1(x));
    return x + mlp(ln_2(x));
  }
  const torch::Tensor a = attn(kernels::layer_norm(x, ln_1->weight, ln_1->bias, ln_1->options.eps()));
  const double eps = ln_2->options.eps();
  if (a.scalar_type() != x.scalar_type()) {  // autocast: a bf16 output added to the fp32 stream
    x = x + a;
    return x + mlp(kernels::layer_norm(x, ln_2->weight, ln_2->bias, eps));
  }
  auto [h, s] = kernels::add_layer_norm(a, x, ln_2->weight, ln_2->bias, eps);
  return s + mlp(h);
}

GPTImpl::GPTImpl(const GPTConfig& c, bool materialize) : CausalLM(c) {
  c.validate();
  wte = register_module("wte", settle(torch::nn::Embedding(c.vocab_size, c.n_embd), materialize));
  wpe = register_module("wpe", settle(torch::nn::Embedding(c.block_size, c.n_embd), materialize));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) h->push_back(settle(Block(c), materialize));
  for (auto& b : *h) b->as<Block>()->attn->sequence = sequence_;
  ln_f = register_module("ln_f", settle(torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).eps(c.norm_eps)), materialize));
  drop_ = register_module("drop", torch::nn::Dropout(c.dropout));
  finish_construction(materialize);
}

void GPTImpl::init_parameter(const std::string& name, at::Tensor& p) const {
  torch::NoGradGuard no_grad;
  const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  if (name.find("ln_") != std::string::npos) {
    p.fill_(bias ? 0.0 : 1.0);
  } else if (bias) {
    p.zero_();
  } else if (name.find("c_proj.weight") != std::string::npos) {
    p.normal_(0.0, 0.02 / std::sqrt(2.0 * config().n_layer));
  } else {
    p.normal_(0.0, 0.02);
  }
}

torch::Tensor GPTImpl::embed(const torch::Tensor& idx) {
  check_length(idx.size(1));
  torch::Tensor tok = tp_ ? tp_->embed_tokens(idx, wte->weight) : wte(idx);
  // Under sequence parallelism tok is this rank's chunk: add its positions.
  const int64_t n = tok.size(1), first = tp_ ? tp_->sequence_offset(n) : 0;
  if (const SequenceLayout* layout = sequence_->layout.get())  // positions inside each document
    return drop_(tok + wpe(layout->positions.narrow(1, first, n)));
  return drop_(tok + wpe(torch::arange(first, first + n, idx.options().dtype(torch::kLong))));
}

torch::Tensor GPTImpl::run_block(int64_t i, const torch::Tensor& x) { return h[i]->as<Block>()->forward(x); }

torch::Tensor GPTImpl::head_logits(const torch::Tensor& x) {
  auto y = ln_f(x);
  if (tp_) return tp_->logits(y, wte->weight);
  return torch::matmul(y, wte->weight.t());  // head tied to the token embedding
}

torch::Tensor GPTImpl::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  auto y = ln_f(x);
  return head_cross_entropy(y, wte->weight, targets);
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

TensorParallelSplit GPTImpl::tensor_parallel_split(const std::string& name) const {
  if (name == "wte.weight") return {0, 1};  // vocabulary rows
  // c_attn's rows are q, then k, then v: each rank keeps its heads' rows of each.
  if (ends_with(name, "attn.c_attn.weight") || ends_with(name, "attn.c_attn.bias")) return {0, 3};
  if (ends_with(name, "mlp.c_fc.weight") || ends_with(name, "mlp.c_fc.bias")) return {0, 1};  // column-parallel
  if (ends_with(name, "c_proj.weight")) return {1, 1};  // row-parallel: input columns
  return {};  // wpe, LayerNorms, row-parallel biases
}

std::vector<std::string> GPTImpl::tensor_parallel_problems(const ModelConfig& c, int tp) {
  std::vector<std::string> out;
  const std::string degree = "tensor parallel degree tp=" + std::to_string(tp);
  if (c.n_head % tp != 0)
    out.push_back(degree + " does not divide model.n_head=" + std::to_string(c.n_head) +
                  " (attention heads are split across tp ranks)");
  if (c.vocab_size % tp != 0)
    out.push_back(degree + " does not divide model.vocab_size=" + std::to_string(c.vocab_size) +
                  " (pad the vocabulary to a multiple of " + std::to_string(tp) + ")");
  return out;
}

void GPTImpl::set_tensor_parallel(TensorParallelHooksPtr hooks) {
  tp_ = hooks;
  for (auto& m : *h) {
    auto* block = m->as<Block>();
    block->attn->tp = hooks;
    block->mlp->tp = hooks;
  }
}

double GPTImpl::flops_per_token(int64_t seq_len) const {
  const double N = static_cast<double>(num_parameters() - wpe->weight.numel());
  return 6.0 * N + 12.0 * config().n_layer * config().n_embd * seq_len;
}

}  // namespace scaletrain::models

namespace scaletrain::models {

ModelConfig gpt2_config_from_hf(const nlohmann::json& j, const std::string& source) {
  auto fail = [&](const std::string& what) { throw UsageError(source + ": " + what); };
  if (j.value("model_type", "") != "gpt2") fail("model_type is not gpt2");
  auto get = [&](const char* key) -> int64_t {
    if (!j.contains(key) || !j[key].is_number_integer()) fail(std::string("missing integer '") + key + "'");
    return j[key].get<int64_t>();
  };
  ModelConfig c;  // family gpt2, biases on
  c.vocab_size = get("vocab_size");
  c.block_size = get("n_positions");
  c.n_embd = get("n_embd");
  c.n_layer = get("n_layer");
  c.n_head = get("n_head");
  if (j.contains("layer_norm_epsilon") && std::fabs(j.value("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12)
    fail("layer_norm_epsilon=" + j["layer_norm_epsilon"].dump() + " is not supported (this GPT-2 uses 1e-5)");
  const std::string act = j.value("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    fail("activation_function '" + act + "' is not supported (this GPT-2 uses the tanh GELU, gelu_new)");
  if (j.contains("n_inner") && !j["n_inner"].is_null() && j["n_inner"] != 4 * c.n_embd)
    fail("n_inner=" + j["n_inner"].dump() + " is not supported (this GPT-2 uses 4 x n_embd)");
  if (!j.value("tie_word_embeddings", true)) fail("tie_word_embeddings=false is not supported (GPT-2's head is the embedding)");
  if (!j.value("scale_attn_weights", true)) fail("scale_attn_weights=false is not supported");
  for (const char* key : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"})
    if (j.value(key, false)) fail(std::string(key) + "=true is not supported");
  c.validate();
  return c;
}

// GPT2Config's keys as transformers writes them; GPT-2 has no other choices
// this build makes differently (tanh GELU, LayerNorm eps 1e-5, MLP width
// 4 x n_embd, a tied head).
nlohmann::json gpt2_config_to_hf(const ModelConfig& c) {
  return {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", c.vocab_size},
      {"n_positions", c.block_size},
      {"n_ctx", c.block_size},
      {"n_embd", c.n_embd},
      {"n_layer", c.n_layer},
      {"n_head", c.n_head},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", c.norm_eps},
      {"resid_pdrop", c.dropout},
      {"embd_pdrop", c.dropout},
      {"attn_pdrop", c.dropout},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", true},
      {"use_cache", true},
      {"torch_dtype", "float32"},
  };
}

}  // namespace scaletrain::models

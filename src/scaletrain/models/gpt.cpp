#include "scaletrain/models/gpt.h"

#include <cmath>
#include <map>

#include "scaletrain/util/error.h"

namespace scaletrain::models {

void GPTConfig::validate() const {
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) throw UsageError(std::string("model.") + name + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(block_size, "block_size");
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_embd, "n_embd");
  if (n_embd % n_head != 0)
    throw UsageError("model.n_head=" + std::to_string(n_head) +
                     " does not divide model.n_embd=" + std::to_string(n_embd));
  if (dropout < 0 || dropout >= 1) throw UsageError("model.dropout must be in [0, 1)");
}

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
    : n_head_(c.n_head), n_embd_(c.n_embd), dropout_(c.dropout) {
  c_attn = register_module("c_attn", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, 3 * c.n_embd).bias(c.bias)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, c.n_embd).bias(c.bias)));
  mask_ = torch::ones({c.block_size, c.block_size}, torch::kBool).tril();
}

int64_t CausalSelfAttentionImpl::local_heads() const { return c_attn->weight.size(0) / (3 * (n_embd_ / n_head_)); }

namespace {
// c_proj as a row-parallel linear: the partial products of every rank are
// reduced by the hook, and the (replicated) bias is added once, after it.
torch::Tensor row_parallel(const torch::Tensor& y, torch::nn::Linear& proj, const TensorParallelHooks& tp) {
  auto out = tp.row_output(torch::linear(y, proj->weight));
  return proj->bias.defined() ? out + proj->bias : out;
}
}  // namespace

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& input) {
  // Under tensor parallelism c_attn holds this rank's heads only (their q, k
  // and v rows), so the width below is n_embd / tp.
  const int64_t hs = n_embd_ / n_head_, nh = local_heads(), width = nh * hs;
  const torch::Tensor x = tp ? tp->column_input(input) : input;
  const int64_t B = x.size(0), T = x.size(1);
  auto qkv = c_attn(x).split(width, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, nh, hs}).transpose(1, 2); };
  torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hs)));
  att = att.masked_fill(mask_.slice(0, 0, T).slice(1, 0, T).logical_not(), -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, -1);
  if (dropout_ > 0) att = torch::dropout(att, dropout_, is_training());
  auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, width});
  y = tp ? row_parallel(y, c_proj, *tp) : c_proj(y);
  if (dropout_ > 0) y = torch::dropout(y, dropout_, is_training());
  return y;
}

MLPImpl::MLPImpl(const GPTConfig& c) : dropout_(c.dropout) {
  c_fc = register_module("c_fc", torch::nn::Linear(torch::nn::LinearOptions(c.n_embd, 4 * c.n_embd).bias(c.bias)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(4 * c.n_embd, c.n_embd).bias(c.bias)));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  torch::Tensor y;
  if (tp)  // c_fc column-parallel, c_proj row-parallel: one reduction per MLP
    y = row_parallel(torch::gelu(c_fc(tp->column_input(x)), "tanh"), c_proj, *tp);
  else
    y = c_proj(torch::gelu(c_fc(x), "tanh"));  // GPT-2's tanh approximation
  if (dropout_ > 0) y = torch::dropout(y, dropout_, is_training());
  return y;
}

BlockImpl::BlockImpl(const GPTConfig& c) {
  auto ln = [&] {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd}).elementwise_affine(true).eps(1e-5));
  };
  ln_1 = register_module("ln_1", ln());
  attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", ln());
  mlp = register_module("mlp", MLP(c));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn(ln_1(x));
  return x + mlp(ln_2(x));
}

GPTImpl::GPTImpl(const GPTConfig& c, bool materialize) : config_(c) {
  c.validate();
  // Without materialization each module's bytes go as soon as it is built
  // (its constructor's own random draws still happen, so the generator is
  // where an eager build leaves it): the peak is one block, not the model.
  auto settle = [&](torch::nn::Module& m) {
    if (!materialize) free_parameters(m);
  };
  wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
  settle(*wte);
  wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
  settle(*wpe);
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    Block block(c);
    settle(*block);
    h->push_back(block);
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  settle(*ln_f);
  drop_ = register_module("drop", torch::nn::Dropout(c.dropout));
  if (!materialize) return;
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) init_parameter(item.key(), item.value());
}

// GPT-2 initialisation: N(0, 0.02), zero biases, LayerNorm 1 / 0, and the
// projections that write into the residual stream scaled by 1/sqrt(2 * n_layer).
void GPTImpl::init_parameter(const std::string& name, at::Tensor& p) const {
  torch::NoGradGuard no_grad;
  const bool bias = name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0;
  if (name.find("ln_") != std::string::npos) {
    p.fill_(bias ? 0.0 : 1.0);
  } else if (bias) {
    p.zero_();
  } else if (name.find("c_proj.weight") != std::string::npos) {
    p.normal_(0.0, 0.02 / std::sqrt(2.0 * config_.n_layer));
  } else {
    p.normal_(0.0, 0.02);
  }
}

torch::Tensor GPTImpl::embed(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  if (T > config_.block_size)
    throw std::invalid_argument("sequence of " + std::to_string(T) + " tokens exceeds block_size " +
                                std::to_string(config_.block_size));
  torch::Tensor x;
  if (tp_) {
    x = tp_->embed(idx);
  } else {
    auto pos = torch::arange(T, idx.options().dtype(torch::kLong));
    x = wte(idx) + wpe(pos);
  }
  return drop_(x);
}

BlockBody GPTImpl::block_body(int64_t i) {
  auto* block = (*h)[i]->as<Block>();
  BlockBody body = [block](const torch::Tensor& in) { return block->forward(in); };
  if (checkpointing_ != ActivationCheckpointing::Full) return body;
  CheckpointOptions ckpt;
  ckpt.preserve_rng = config_.dropout > 0;  // no dropout: no random draws to replay
  return [block, plain = std::move(body), ckpt](const torch::Tensor& in) {
    return checkpoint(plain, in, block->parameters(), ckpt);
  };
}

torch::Tensor GPTImpl::hidden(const torch::Tensor& idx) {
  torch::Tensor x = embed(idx);
  for (int64_t i = 0; i < static_cast<int64_t>(h->size()); ++i) {
    const BlockBody body = block_body(i);
    x = runner_ ? runner_(i, body, x) : body(x);
  }
  return ln_f(x);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  auto x = hidden(idx);
  if (tp_) return tp_->logits(x);
  return torch::matmul(x, wte->weight.t());  // head tied to the token embedding
}

namespace {
torch::Tensor cross_entropy(torch::Tensor logits, const torch::Tensor& targets) {
  // 16-bit logits (autocast) are upcast: the softmax over the vocabulary needs fp32.
  if (logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kHalf)
    logits = logits.to(torch::kFloat);
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), targets.reshape({-1}));
}
}  // namespace

torch::Tensor GPTImpl::loss(const torch::Tensor& idx, const torch::Tensor& targets) {
  if (tp_) return tp_->loss(hidden(idx), targets);
  return cross_entropy(forward(idx), targets);
}

torch::Tensor GPTImpl::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  auto y = ln_f(x);
  if (tp_) return tp_->loss(y, targets);
  return cross_entropy(torch::matmul(y, wte->weight.t()), targets);
}

void GPTImpl::set_tensor_parallel(TensorParallelHooksPtr hooks) {
  tp_ = hooks;
  for (auto& m : *h) {
    auto* block = m->as<Block>();
    block->attn->tp = hooks;
    block->mlp->tp = hooks;
  }
}

torch::Tensor GPTImpl::generate(torch::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k) {
  torch::NoGradGuard no_grad;
  // Tensor parallel: sample with the hooks meant for it, and put the training
  // ones back however this returns.
  struct Restore {
    GPTImpl* model;
    TensorParallelHooksPtr hooks;
    ~Restore() {
      if (hooks) model->set_tensor_parallel(hooks);
    }
  } restore{this, nullptr};
  if (tp_ && tp_->sampling) {
    restore.hooks = tp_;
    set_tensor_parallel(tp_->sampling);
  }
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    auto ctx = idx.size(1) <= config_.block_size ? idx : idx.slice(1, idx.size(1) - config_.block_size);
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

int64_t GPTImpl::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

double GPTImpl::flops_per_token(int64_t seq_len) const {
  const double N = static_cast<double>(num_parameters() - wpe->weight.numel());
  return 6.0 * N + 12.0 * config_.n_layer * config_.n_embd * seq_len;
}

}  // namespace scaletrain::models

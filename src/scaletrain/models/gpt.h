#pragma once
// A GPT-2 style decoder-only transformer in torch::nn: token and position
// embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a
// final LayerNorm and an output head tied to the token embedding. Module and
// parameter names follow Hugging Face's GPT-2 (wte, wpe, h.N.attn.c_attn, ...)
// so checkpoints map onto it by name (linear weights are transposed there).
#include <torch/torch.h>

#include "scaletrain/models/deferred.h"

#include <functional>
#include <string>
#include <vector>

namespace scaletrain::models {

struct GPTConfig {
  int64_t vocab_size = 256;  // token ids are in [0, vocab_size)
  int64_t block_size = 128;  // longest sequence (position embeddings)
  int64_t n_layer = 4;       // transformer blocks
  int64_t n_head = 4;        // attention heads; must divide n_embd
  int64_t n_embd = 128;      // model width
  double dropout = 0.0;      // on attention, residual and embedding outputs
  bool bias = true;          // biases in Linear and LayerNorm (GPT-2 has them)

  void validate() const;  // throws UsageError naming the bad field
};

// Presets: "tiny" (~0.8M parameters, byte vocabulary), "gpt2" (124M),
// "gpt2-medium" (350M), "gpt2-large" (774M), "gpt2-xl" (1.5B).
GPTConfig gpt_preset(const std::string& name);
std::vector<std::string> gpt_preset_names();

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};

 private:
  int64_t n_head_, n_embd_;
  double dropout_;
  torch::Tensor mask_;  // [block, block] lower triangle; not a parameter or buffer
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};

 private:
  double dropout_;
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& c);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

// How a parallel strategy takes part in a model's forward: the model calls the
// runner for each transformer block instead of the block itself, and the
// runner calls `body` (the block's forward) between whatever it must do before
// and after (gather a sharded unit, register a pre-backward hook, recompute in
// backward). No runner: blocks run directly.
using BlockBody = std::function<torch::Tensor(const torch::Tensor&)>;
using BlockRunner = std::function<torch::Tensor(int64_t index, const BlockBody& body, const torch::Tensor& x)>;

// What a strategy needs to know about a model built of repeated blocks.
class Blockwise {
 public:
  virtual ~Blockwise() = default;
  virtual int64_t num_blocks() const = 0;
  // Parameter-name prefix of block i ("h.3."), as in named_parameters().
  virtual std::string block_prefix(int64_t i) const = 0;
  // Class name of the blocks, for transformer-based wrap policies.
  virtual std::string block_class() const = 0;
  virtual void set_block_runner(BlockRunner runner) = 0;
};

class GPTImpl : public torch::nn::Module, public Blockwise {
 public:
  // materialize=false builds the model without its parameters' bytes (see
  // models/deferred.h); a strategy then fills them through init_parameter(),
  // in registration order, before anything else draws random numbers.
  explicit GPTImpl(const GPTConfig& c, bool materialize = true);
  // GPT-2 initialisation of parameter `name` into `p` (shaped like it).
  void init_parameter(const std::string& name, at::Tensor& p) const;
  // idx: [B, T] int64 token ids -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& idx);
  // Mean cross-entropy of the next-token prediction.
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  // Appends `max_new_tokens` sampled tokens (temperature, top-k) to `idx` [1, T].
  torch::Tensor generate(torch::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k);

  const GPTConfig& config() const { return config_; }
  int64_t num_parameters() const;
  // Training FLOPs per token: 6N + 12*L*H*Q*T, N = parameters without the
  // position embedding (it costs no matmul), H*Q = n_embd, T = sequence length.
  double flops_per_token(int64_t seq_len) const;

  int64_t num_blocks() const override { return config_.n_layer; }
  std::string block_prefix(int64_t i) const override { return "h." + std::to_string(i) + "."; }
  std::string block_class() const override { return "Block"; }
  void set_block_runner(BlockRunner runner) override { runner_ = std::move(runner); }

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GPTConfig config_;
  torch::nn::Dropout drop_{nullptr};
  BlockRunner runner_;
};
TORCH_MODULE(GPT);

}  // namespace scaletrain::models

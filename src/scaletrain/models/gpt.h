#pragma once
// A GPT-2 style decoder-only transformer in torch::nn: token and position
// embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a
// final LayerNorm and an output head tied to the token embedding. Module and
// parameter names follow Hugging Face's GPT-2 (wte, wpe, h.N.attn.c_attn, ...)
// so checkpoints map onto it by name (linear weights are transposed there).
#include <torch/torch.h>

#include "scaletrain/models/checkpoint.h"
#include "scaletrain/models/deferred.h"

#include <functional>
#include <memory>
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

// How a layer-splitting strategy (tensor parallelism, parallel/tensor) takes
// part in the forward without a second model class. The model stays free of
// communication: the strategy fills these in and the modules call them at the
// boundaries of Megatron's column-parallel / row-parallel pairs. An empty hook
// set (the default) is the plain single-process model, unchanged.
using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;
struct TensorParallelHooks {
  // Input of a column-parallel linear (c_attn, c_fc, the tied head): the f
  // operator (identity forward, all-reduce backward) or, under sequence
  // parallelism, the all-gather along the sequence.
  TensorFn column_input;
  // Output of a row-parallel linear (c_proj) before its bias: the g operator
  // (all-reduce) or, under sequence parallelism, the reduce-scatter.
  TensorFn row_output;
  // Token ids [B, T] -> token + position embedding [B, T, C] (or its
  // sequence shard [B, T/tp, C]) with the vocabulary-parallel lookup.
  TensorFn embed;
  // ln_f output -> full logits [B, T, V] (gathered over the vocabulary; for
  // forward() and generate(), not for the loss).
  TensorFn logits;
  // ln_f output and targets -> mean next-token cross-entropy, with logits
  // that stay sharded over the vocabulary.
  std::function<torch::Tensor(const torch::Tensor& hidden, const torch::Tensor& targets)> loss;
  // Token ids sampled by generate() [B, 1] -> the ids every rank continues
  // with (tp rank 0's): the ranks of a split model must feed the same tokens.
  TensorFn broadcast_tokens;
  // The hooks generate() runs with instead of these; null: these. Sequence
  // parallelism cannot split a sampled context of any length, and without
  // autograd it saves nothing, so its hooks name plain tensor-parallel ones.
  std::shared_ptr<const TensorParallelHooks> sampling;
};
using TensorParallelHooksPtr = std::shared_ptr<const TensorParallelHooks>;

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  // Heads this module computes: n_head, or n_head / tp once c_attn holds
  // only this rank's heads (derived from c_attn's weight shape).
  int64_t local_heads() const;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  TensorParallelHooksPtr tp;  // null: single process

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
  TensorParallelHooksPtr tp;  // null: single process

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
  // Mean cross-entropy of the next-token prediction (vocabulary-parallel
  // under tensor parallelism: the full logits are never formed).
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  // The pieces of loss() that a pipeline stage runs separately: the token and
  // position embedding (with dropout) before block 0, and ln_f, the tied head
  // and the cross-entropy after the last block.
  torch::Tensor embed(const torch::Tensor& idx);
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets);
  // Installs (or, with nullptr, removes) the tensor-parallel hooks in the
  // model and every block; parallel/tensor's parallelize_tensor() calls it
  // after it has split the weights.
  void set_tensor_parallel(TensorParallelHooksPtr hooks);
  const TensorParallelHooksPtr& tensor_parallel() const { return tp_; }
  // Appends `max_new_tokens` sampled tokens (temperature, top-k) to `idx` [1, T].
  // Tensor-parallel: a collective over tp; every rank returns the same ids.
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

  // Full: each block keeps only its input for backward and is recomputed
  // there (models/checkpoint.h). The body handed to a block runner is then
  // the checkpointed block, so strategies wrap it like any other body.
  void set_activation_checkpointing(ActivationCheckpointing c) { checkpointing_ = c; }
  ActivationCheckpointing activation_checkpointing() const { return checkpointing_; }
  // Block i's forward as a body for a BlockRunner, checkpointed when asked
  // (what hidden() runs; pipeline chunks run their blocks through it too).
  BlockBody block_body(int64_t i);

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 private:
  GPTConfig config_;
  // Embeddings, blocks and ln_f: [B, T, C] hidden states before the head.
  torch::Tensor hidden(const torch::Tensor& idx);

  torch::nn::Dropout drop_{nullptr};
  BlockRunner runner_;
  TensorParallelHooksPtr tp_;
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::None;
};
TORCH_MODULE(GPT);

}  // namespace scaletrain::models

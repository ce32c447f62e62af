#pragma once
// A GPT-2 style decoder-only transformer in torch::nn: token and position
// embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP, a
// final LayerNorm and an output head tied to the token embedding. Module and
// parameter names follow Hugging Face's GPT-2 (wte, wpe, h.N.attn.c_attn, ...)
// so checkpoints map onto it by name (linear weights are transposed there).
#include <torch/torch.h>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/linear.h"

#include <memory>
#include <string>
#include <vector>

namespace scaletrain::models {

// Presets: "tiny" (~0.8M parameters, byte vocabulary), "gpt2" (124M),
// "gpt2-medium" (350M), "gpt2-large" (774M), "gpt2-xl" (1.5B).
GPTConfig gpt_preset(const std::string& name);
std::vector<std::string> gpt_preset_names();

class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  // Heads this module computes: n_head, or n_head / tp once c_attn holds
  // only this rank's heads (derived from c_attn's weight shape).
  int64_t local_heads() const;
  Linear c_attn{nullptr}, c_proj{nullptr};
  TensorParallelHooksPtr tp;  // null: single process
  std::shared_ptr<const SequenceContext> sequence;  // the model's (packed documents); null: none

 private:
  int64_t n_head_, n_embd_;
  double dropout_;
  AttentionPath path_;
};
TORCH_MODULE(CausalSelfAttention);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear c_fc{nullptr}, c_proj{nullptr};
  TensorParallelHooksPtr tp;  // null: single process

 private:
  double dropout_;
  bool fused_;  // the tanh GELU in one pass each way (kernels/layer_norm_gelu.h)
};
TORCH_MODULE(MLP);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const GPTConfig& c);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};

 private:
  // The LayerNorms in one pass each way, ln_2 with the residual add before it
  // (kernels/layer_norm_gelu.h); false: the modules' ATen ops.
  bool fused_;
};
TORCH_MODULE(Block);

class GPTImpl : public CausalLM {
 public:
  // materialize=false builds the model without its parameters' bytes (see
  // interfaces/deferred.h); a strategy then fills them through init_parameter(),
  // in registration order, before anything else draws random numbers.
  explicit GPTImpl(const GPTConfig& c, bool materialize = true);
  // GPT-2 initialisation: N(0, 0.02), zero biases, LayerNorm 1 / 0, and the
  // projections that write into the residual stream scaled by 1/sqrt(2 * n_layer).
  void init_parameter(const std::string& name, at::Tensor& p) const override;

  torch::Tensor embed(const torch::Tensor& idx) override;
  torch::Tensor run_block(int64_t i, const torch::Tensor& x) override;
  torch::Tensor head_logits(const torch::Tensor& x) override;  // ln_f, the tied head
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets) override;

  std::string block_prefix(int64_t i) const override { return "h." + std::to_string(i) + "."; }
  std::string block_class() const override { return "Block"; }

  // Megatron's roles (parallel/tensor): wte vocabulary rows; c_attn the
  // rows of this rank's heads in each of q, k, v; c_fc rows; c_proj columns.
  TensorParallelSplit tensor_parallel_split(const std::string& name) const override;
  static std::vector<std::string> tensor_parallel_problems(const ModelConfig& c, int tp);
  void set_tensor_parallel(TensorParallelHooksPtr hooks) override;

  std::vector<NamedModule> first_pieces() override { return {{"wte", wte.ptr()}, {"wpe", wpe.ptr()}}; }
  std::vector<NamedModule> last_pieces() override { return {{"ln_f", ln_f.ptr()}}; }
  NamedModule block_module(int64_t i) override { return {"h." + std::to_string(i), h[i]}; }
  std::pair<std::string, at::Tensor> tied_head() override { return {"wte.weight", wte->weight}; }

  // 6N + 12*L*H*Q*T, N = parameters without the position embedding (it costs
  // no matmul), H*Q = n_embd, T = sequence length.
  double flops_per_token(int64_t seq_len) const override;

  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};

 protected:
  std::vector<std::string> family_split_problems(int tp) const override {
    return tensor_parallel_problems(config(), tp);
  }

 private:
  torch::nn::Dropout drop_{nullptr};
};
TORCH_MODULE(GPT);

}  // namespace scaletrain::models

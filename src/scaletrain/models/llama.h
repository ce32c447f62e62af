#pragma once
// The Llama family (Llama 2/3, TinyLlama, SmolLM2, and Qwen2, which adds
// biases on q, k and v): pre-RMSNorm blocks of grouped-query attention with
// rotary position embeddings and a SwiGLU MLP, a final RMSNorm, and a head
// that is its own matrix or the token embedding (tie_word_embeddings).
// Parameter names are Hugging Face's LlamaForCausalLM names
// (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...,
// lm_head.weight), so Hub checkpoints map onto it one to one.
//
// Semantics follow transformers' LlamaForCausalLM:
// - RMSNorm: x * rsqrt(mean(x^2) + eps) computed in fp32 (fp64 stays fp64),
//   cast back to the input's dtype, then times the weight.
// - Rotary embedding on q and k in Hugging Face's layout: the two halves of
//   each head are the rotated pairs (rotate_half), inv_freq = theta^(-2i/d),
//   optionally stretched by rope_scaling type "llama3" (Note [Llama 3 rope]).
// - Attention: k and v heads repeated n_head / n_kv_head times, causal,
//   softmax in fp32.
// - MLP: down(silu(gate(x)) * up(x)), or for family mixtral a sparse MoE
//   block of such experts (block_sparse_moe: models/moe.h).
#include <torch/torch.h>

#include <nlohmann/json_fwd.hpp>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/moe.h"

namespace scaletrain::models {

class RMSNormImpl : public torch::nn::Module {
 public:
  // fused: one pass forward and backward (kernels/norm_activation.h).
  RMSNormImpl(int64_t width, double eps, bool fused = false);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps() const { return eps_; }
  bool fused() const { return fused_; }

 private:
  double eps_;
  bool fused_;
};
TORCH_MODULE(RMSNorm);

// cos and sin [T, head_dim] of positions 0..T-1 in `dtype` (fp64 stays
// fp64; everything else is computed in fp32 as Hugging Face does).
std::pair<torch::Tensor, torch::Tensor> rotary_tables(const ModelConfig& c, int64_t T, torch::ScalarType dtype,
                                                       const torch::Device& device);

class LlamaAttentionImpl : public torch::nn::Module {
 public:
  explicit LlamaAttentionImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  TensorParallelHooksPtr tp;  // null: single process
  std::shared_ptr<const SequenceContext> sequence;  // the model's (packed documents); null: none

 private:
  ModelConfig c_;
  AttentionPath path_;
};
TORCH_MODULE(LlamaAttention);

class LlamaMLPImpl : public torch::nn::Module {
 public:
  explicit LlamaMLPImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  TensorParallelHooksPtr tp;

 private:
  bool fused_;  // silu(gate) * up in one pass (kernels/norm_activation.h)
};
TORCH_MODULE(LlamaMLP);

class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  explicit LlamaDecoderLayerImpl(const ModelConfig& c);
  torch::Tensor forward(torch::Tensor x);
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};                      // dense models
  SparseMoeBlock block_sparse_moe{nullptr};  // mixtral
};
TORCH_MODULE(LlamaDecoderLayer);

class LlamaImpl : public CausalLM {
 public:
  explicit LlamaImpl(const ModelConfig& c, bool materialize = true);
  // N(0, 0.02) for matrices and embeddings, ones for norms, zero biases
  // (transformers' initializer_range default).
  void init_parameter(const std::string& name, at::Tensor& p) const override;

  torch::Tensor embed(const torch::Tensor& idx) override;
  torch::Tensor run_block(int64_t i, const torch::Tensor& x) override;
  torch::Tensor head_logits(const torch::Tensor& x) override;
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets) override;

  std::string block_prefix(int64_t i) const override { return "model.layers." + std::to_string(i) + "."; }
  std::string block_class() const override { return "LlamaDecoderLayer"; }

  // q, k, v, gate, up: output rows (column-parallel; this rank's q heads and
  // kv heads); o, down: input columns (row-parallel); the embedding and an
  // untied head: vocabulary rows. tp must divide the kv heads: a kv head is
  // never replicated across ranks.
  TensorParallelSplit tensor_parallel_split(const std::string& name) const override;
  static std::vector<std::string> tensor_parallel_problems(const ModelConfig& c, int tp);
  void set_tensor_parallel(TensorParallelHooksPtr hooks) override;

  std::vector<NamedModule> first_pieces() override;
  std::vector<NamedModule> last_pieces() override;
  NamedModule block_module(int64_t i) override;
  std::pair<std::string, at::Tensor> tied_head() override;
  bool is_expert_parameter(const std::string& name) const override;
  void set_expert_parallel(std::shared_ptr<const interfaces::ExpertParallelHooks> hooks) override;

  // 6N + 12*L*(n_head*head_dim)*T, N without an untied embedding (a lookup)
  // and, for MoE models, with the k experts a token uses of each layer's E.
  double flops_per_token(int64_t seq_len) const override;

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tied; never adapted (not a models::Linear)

 protected:
  std::vector<std::string> family_split_problems(int tp) const override {
    return tensor_parallel_problems(config(), tp);
  }

 private:
  const torch::Tensor& head_weight() const;
};
TORCH_MODULE(Llama);

// Presets of the family, by name ("llama-tiny", "smollm2-135m", ...), and
// a Hugging Face config.json of model_type llama / mistral / qwen2.
std::vector<std::pair<std::string, ModelConfig>> llama_presets();
ModelConfig llama_config_from_hf(const nlohmann::json& j, const std::string& file);
// The config.json transformers writes for a model of this config
// (LlamaForCausalLM, or Qwen2ForCausalLM for family qwen2).
nlohmann::json llama_config_to_hf(const ModelConfig& c);

}  // namespace scaletrain::models

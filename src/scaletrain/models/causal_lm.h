#pragma once
// The base class of our families: a decoder-only causal language model made
// of an embedding, a list of repeated blocks, and a head with its loss.
// Model families (models/gpt.h, models/llama.h, ...) implement it. It
// implements the interfaces the engines drive (interfaces/blocks.h,
// stages.h, tensor_split.h, deferred.h, experts.h); the engines include only
// those, so adding a family touches models/ and nothing else.
//
// What a family says about itself, and who asks:
//   embed / block i / head_loss       pipeline chunks run the pieces separately
//   block_prefix, block_class         wrap policies cut units at blocks
//   set_block_runner                  ZeRO-3/FSDP gather a unit around its blocks
//   tensor_parallel_split(name)       parallel/tensor splits each parameter
//   TensorParallelHooks               the model calls them at the boundaries
//   first/last_pieces, tied_head      pipeline chunks own the right modules
//   init_parameter                    deferred init draws one tensor at a time
//   flops_per_token                   MFU
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/interfaces/blocks.h"
#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/interfaces/experts.h"
#include "scaletrain/interfaces/stages.h"
#include "scaletrain/interfaces/tensor_split.h"
#include "scaletrain/models/attention.h"
#include "scaletrain/models/checkpoint.h"

namespace scaletrain::models {

struct MoeContext;  // models/moe.h

// Llama 3.1's frequency-dependent stretch of the rotary embedding (Hugging
// Face's rope_scaling {"rope_type": "llama3", ...}); type "" is none.
struct RopeScaling {
  std::string type;                  // "" or "llama3"
  double factor = 8.0;               // how much longer the context became
  double low_freq_factor = 1.0;      // wavelengths above orig / low are stretched by `factor`
  double high_freq_factor = 4.0;     // wavelengths below orig / high are kept
  int64_t original_max_positions = 8192;
};

// Dimensions of a model of any family; the family decides which fields it
// reads, and validate() refuses a field set that the family does not read.
// The first seven fields keep GPTConfig's order, so {vocab, block, layers,
// heads, width} still initializes a GPT.
struct ModelConfig {
  int64_t vocab_size = 256;  // token ids are in [0, vocab_size)
  int64_t block_size = 128;  // longest sequence (position table or rope cache)
  int64_t n_layer = 4;       // transformer blocks
  int64_t n_head = 4;        // attention (query) heads; must divide n_embd
  int64_t n_embd = 128;      // model width
  double dropout = 0.0;      // gpt2: on attention, residual and embedding outputs
  bool bias = true;          // gpt2: biases in Linear and LayerNorm
  std::string family = "gpt2";    // "gpt2", "llama", "qwen2" (models/registry.cpp)
  int64_t n_kv_head = 0;          // key/value heads (grouped-query attention); 0: n_head
  int64_t intermediate_size = 0;  // MLP width; 0: 4 * n_embd
  double norm_eps = 1e-5;         // LayerNorm / RMSNorm epsilon
  double rope_theta = 10000.0;    // rotary base (llama family)
  RopeScaling rope_scaling;
  bool tie_word_embeddings = true;  // the head is the token embedding (gpt2: always)
  bool attention_bias = false;      // llama: biases on q, k, v and o
  bool mlp_bias = false;            // llama: biases on gate, up and down
  bool qkv_bias = false;            // llama: biases on q, k and v only (Qwen2)
  // Sparse Mixture of Experts (family mixtral; Note [MoE routing] in models/moe.h).
  int64_t num_local_experts = 0;      // experts per MoE layer (0: dense MLPs)
  int64_t num_experts_per_tok = 2;    // k
  double router_aux_loss_coef = 0.0;  // load-balancing loss coefficient
  double router_z_loss_coef = 0.0;    // router z-loss coefficient
  double capacity_factor = 0.0;       // 0: dropless
  std::string moe_drop_policy = "probs";  // probs | position (with a capacity factor)
  // How the model computes what it trains on (not what it is: Hub configs and
  // checkpoints say nothing of these).
  std::string attention = "flash";  // flash | naive (Note [Attention paths] in models/attention.h)
  bool fused = true;                // head + cross-entropy fused (kernels/linear_cross_entropy.h)

  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t mlp_width() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  int64_t head_dim() const { return n_embd / n_head; }
  // Throws UsageError naming the bad field (and the family that refuses it).
  void validate() const;
};
using GPTConfig = ModelConfig;  // the name the GPT-only code had

// Tensor parallelism's hooks and splits, and a pipeline's pieces, are the
// engines' interfaces (interfaces/tensor_split.h, interfaces/stages.h),
// under the names the families have always used.
using TensorFn = interfaces::TensorFn;
using TensorParallelHooks = interfaces::TensorParallelHooks;
using TensorParallelHooksPtr = interfaces::TensorParallelHooksPtr;
using TensorParallelSplit = interfaces::TensorParallelSplit;
using NamedModule = interfaces::NamedModule;

class CausalLM : public torch::nn::Module, public interfaces::Staged, public interfaces::TensorSplittable {
 public:
  explicit CausalLM(ModelConfig config) : config_(std::move(config)) {}
  const ModelConfig& config() const { return config_; }

  // The pieces, as a pipeline stage runs them separately:
  // token ids [B, T] -> hidden [B, T, C] (embedding, dropout);
  torch::Tensor embed(const torch::Tensor& idx) override = 0;
  // block i, hidden -> hidden (what block_body() wraps);
  torch::Tensor run_block(int64_t i, const torch::Tensor& x) override = 0;
  // last hidden states -> final norm, head -> logits [B, T, V], or the mean
  // next-token cross-entropy against `targets` (vocabulary-parallel under
  // tensor parallelism: the full logits are never formed).
  virtual torch::Tensor head_logits(const torch::Tensor& x) = 0;
  torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets) override = 0;

  // The whole model: idx [B, T] int64 -> logits [B, T, vocab]; the loss.
  torch::Tensor forward(const torch::Tensor& idx);
  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets);
  // Appends `max_new_tokens` sampled tokens (temperature, top-k) to `idx` [1, T].
  // Tensor-parallel: a collective over tp; every rank returns the same ids.
  torch::Tensor generate(torch::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k);

  // Block i's forward as a body for a BlockRunner, checkpointed when asked
  // (what forward() runs; pipeline chunks run their blocks through it too).
  interfaces::BlockBody block_body(int64_t i) override;
  void set_block_runner(interfaces::BlockRunner runner) override { runner_ = std::move(runner); }
  int64_t num_blocks() const override { return config_.n_layer; }
  // Full: each block keeps only its input for backward and is recomputed
  // there (models/checkpoint.h).
  void set_activation_checkpointing(ActivationCheckpointing c) { checkpointing_ = c; }
  ActivationCheckpointing activation_checkpointing() const { return checkpointing_; }

  // Tensor parallelism: how each parameter (by name) is split, and
  // installing (nullptr: removing) the hooks in every module. What a degree
  // cannot split is tensor_parallel_problems() below.
  virtual TensorParallelSplit tensor_parallel_split(const std::string& name) const = 0;
  // What parallel/tensor asks: the family's split, and for a LoRA adapter
  // the split that follows its layer's (models/lora.h).
  TensorParallelSplit parameter_split(const std::string& name) const override;
  // tensor_parallel_problems(config(), tp): a degree below 1, else the
  // family's own (family_split_problems).
  std::vector<std::string> split_problems(int tp) const override;
  void set_tensor_parallel(TensorParallelHooksPtr hooks) override = 0;
  const TensorParallelHooksPtr& tensor_parallel() const override { return tp_; }
  torch::nn::Module& split_module() override { return *this; }

  // Pipelines: the modules the first chunk owns besides its blocks (the
  // embeddings), those the last owns (final norm, an untied head), and block
  // i's module.
  std::vector<NamedModule> first_pieces() override = 0;
  std::vector<NamedModule> last_pieces() override = 0;
  NamedModule block_module(int64_t i) override = 0;
  // A head tied to the token embedding: its parameter name and tensor (used
  // by the first chunk and the last, Note [Tied head across stages]); an
  // undefined tensor when the head is its own parameter.
  std::pair<std::string, at::Tensor> tied_head() override = 0;
  torch::nn::Module& staged_module() override { return *this; }
  // Hidden width, the longest sequence and the vocabulary, from the config.
  interfaces::StageShape stage_shape() const override;

  // Initialization of parameter `name` into `p` (shaped like it); a model
  // built with materialize=false gets its values through this, in
  // registration order (interfaces/deferred.h).
  virtual void init_parameter(const std::string& name, at::Tensor& p) const = 0;

  int64_t num_parameters() const;
  // Training FLOPs per token at sequence length `seq_len` (6N + attention).
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // The same for a step in which the frozen linear weights of the blocks
  // (fine-tuning: the base under adapters) get no weight gradient: 2 of
  // their 6 FLOPs per weight and token are not spent. A frozen head's weight
  // gradient is still counted (a small overcount: the head is not a Linear).
  double step_flops_per_token(int64_t seq_len) const;

  // A model with Mixture-of-Experts layers: what they share (the auxiliary
  // losses' gradient multiplier, the routing statistics: models/moe.h);
  // null for a dense model.
  const std::shared_ptr<MoeContext>& moe() const { return moe_; }
  // Expert parallelism (parallel/expert, Note [Expert parallelism]): whether
  // a parameter belongs to an expert (its gradient is averaged over the
  // ranks holding the same experts), and keeping only the hooks' experts of
  // every MoE layer while tokens move through the hooks. A dense model has no
  // expert parameters and refuses the hooks.
  virtual bool is_expert_parameter(const std::string& name) const;
  virtual void set_expert_parallel(std::shared_ptr<const interfaces::ExpertParallelHooks> hooks);

  // Packed documents (Note [Packed documents] in models/attention.h): the
  // layout of the micro-batch that the next forwards (and their recomputation
  // in backward) run on, until replaced; null: one sequence per row.
  void set_sequence_layout(std::shared_ptr<const SequenceLayout> layout) { sequence_->layout = std::move(layout); }
  // Context parallelism (Note [Split attention] in models/attention.h): the
  // attention every layer runs instead of its own while it is set; empty
  // restores the local one.
  void set_split_attention(SplitAttention attention) { sequence_->split_attention = std::move(attention); }
  const SplitAttention& split_attention() const { return sequence_->split_attention; }

 protected:
  // Without materialization each module's bytes go as soon as it is built
  // (its constructor's own random draws still happen, so the generator is
  // where an eager build leaves it): the peak is one block, not the model.
  // After construction, finish_construction() initializes every parameter
  // through init_parameter() (materialize) or does nothing.
  template <typename M>
  M settle(M module, bool materialize) {
    if (!materialize) interfaces::free_parameters(*module);
    return module;
  }
  void finish_construction(bool materialize);
  // What tensor parallelism of degree `tp` >= 1 cannot split in this family
  // (its static tensor_parallel_problems, which the registry also calls).
  virtual std::vector<std::string> family_split_problems(int tp) const = 0;
  // The sequence must fit the model's position table / rope cache.
  void check_length(int64_t T) const;
  TensorParallelHooksPtr tp_;
  std::shared_ptr<MoeContext> moe_;
  // Shared with the attention layers, which read the layout in flight.
  std::shared_ptr<SequenceContext> sequence_ = std::make_shared<SequenceContext>();
  // The final hidden states [.., C] and head weight [V, C] -> the mean
  // next-token cross-entropy over the targets (not kIgnoreTarget), fused or
  // not as config().fused says; under tensor parallelism `head` is this
  // rank's vocabulary rows, and the fused kernel reduces across the group
  // (the unfused path calls the hooks' loss).
  torch::Tensor head_cross_entropy(const torch::Tensor& y, const torch::Tensor& head, const torch::Tensor& targets) const;

 private:
  ModelConfig config_;
  interfaces::BlockRunner runner_;
  ActivationCheckpointing checkpointing_ = ActivationCheckpointing::None;
};
using ModelPtr = std::shared_ptr<CausalLM>;

// Mean cross-entropy of logits [.., V] against targets over the targets that
// are not kIgnoreTarget (0 when there are none); 16-bit logits are upcast
// first (the softmax over the vocabulary needs fp32).
torch::Tensor causal_lm_cross_entropy(torch::Tensor logits, const torch::Tensor& targets);
// The target id a loss skips (data::kIgnoreIndex, as torch's ignore_index),
// and the mean of per-token losses over the other positions.
using interfaces::kIgnoreTarget;
using interfaces::mean_over_targets;

// A row-parallel linear's output: the partial products of every rank are
// reduced by the hook, and the (replicated) bias is added once, after it.
// An adapter's low-rank product is reduced the same way before its B.
class LinearImpl;
torch::Tensor row_parallel(const torch::Tensor& y, LinearImpl& proj, const TensorParallelHooks& tp);

// The family's model for `config` (models/registry.cpp). materialize=false
// builds it without parameter bytes (interfaces/deferred.h).
ModelPtr make_model(const ModelConfig& config, bool materialize = true);

// What tensor parallelism of degree `tp` cannot split in a model of this
// config, one line each ("tp=4 does not divide the 2 key/value heads");
// empty: it can. Callable before any model is built.
std::vector<std::string> tensor_parallel_problems(const ModelConfig& config, int tp);
// The problem of a degree below 1 ("tensor parallel degree tp=0 must be at least 1").
inline std::string tensor_parallel_degree_problem(int tp) {
  return "tensor parallel degree tp=" + std::to_string(tp) + " must be at least 1";
}
// Throws a one-line UsageError naming every dimension tp does not divide.
void check_tensor_parallel(const ModelConfig& config, int tp);

// Presets of every family: "tiny", "gpt2", ..., "llama-tiny", "smollm2-135m", ...
ModelConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();
// Whether `family` reads the llama family's fields (n_kv_head, rope,
// untied heads, the llama biases); UsageError for an unknown family.
bool llama_like_family(const std::string& family);
// Families this build has ("gpt2", "llama", "qwen2").
std::vector<std::string> model_families();
// The layers a LoRA adapts when none are named: PEFT's defaults for the
// family (gpt2: c_attn; the llama family: q_proj, v_proj).
std::vector<std::string> default_lora_targets(const std::string& family);

}  // namespace scaletrain::models

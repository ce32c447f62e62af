// ModelConfig::validate (models/causal_lm.h): the checks of a config
// against the family that reads it. They live apart from the registry
// (registry.cpp), which builds the families: each family's own files
// validate configs, and would otherwise call back into the file that
// builds them.
#include <cmath>
#include <sstream>
#include <string>

#include "scaletrain/models/attention.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

// What the checks need of each family; the names are registry.cpp's.
struct Traits {
  const char* name;
  bool llama_like;  // reads n_kv_head, rope, untied heads and the llama biases
  bool moe;         // reads the expert fields, and needs experts (Note [MoE routing])
};

const Traits& traits_of(const std::string& family) {
  static const Traits kTraits[] = {
      {"gpt2", false, false}, {"llama", true, false}, {"qwen2", true, false}, {"mixtral", true, true}};
  for (const auto& t : kTraits)
    if (family == t.name) return t;
  std::string known;
  for (const auto& t : kTraits) known += (known.empty() ? "" : ", ") + std::string(t.name);
  throw UsageError("unknown model family '" + family + "' (known: " + known + ")");
}

}  // namespace

bool llama_like_family(const std::string& family) { return traits_of(family).llama_like; }

void ModelConfig::validate() const {
  const Traits& fam = traits_of(family);
  auto positive = [](int64_t v, const char* name) {
    if (v <= 0) throw UsageError(std::string("model.") + name + " must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(block_size, "block_size");
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_embd, "n_embd");
  if (n_kv_head < 0) throw UsageError("model.n_kv_head must not be negative");
  if (intermediate_size < 0) throw UsageError("model.intermediate_size must not be negative");
  if (n_embd % n_head != 0)
    throw UsageError("model.n_head=" + std::to_string(n_head) +
                     " does not divide model.n_embd=" + std::to_string(n_embd));
  if (n_head % kv_heads() != 0)
    throw UsageError("model.n_kv_head=" + std::to_string(kv_heads()) + " does not divide model.n_head=" +
                     std::to_string(n_head) + " (each kv head serves a whole group of query heads)");
  if (dropout < 0 || dropout >= 1) throw UsageError("model.dropout must be in [0, 1)");
  if (!(norm_eps > 0)) throw UsageError("model.norm_eps must be positive");
  const std::string who = std::string(" (model family ") + fam.name + ")";
  // Note [MoE routing]: only the mixtral family reads the expert fields, and it needs experts.
  const bool moe = fam.moe;
  const ModelConfig dense;
  if (!moe && (num_local_experts != 0 || num_experts_per_tok != dense.num_experts_per_tok ||
               router_aux_loss_coef != dense.router_aux_loss_coef || router_z_loss_coef != dense.router_z_loss_coef ||
               capacity_factor != dense.capacity_factor || moe_drop_policy != dense.moe_drop_policy))
    throw UsageError(
        "model.num_local_experts / num_experts_per_tok / router_*_coef / capacity_factor / "
        "moe_drop_policy are read by model.family=mixtral only" +
        who);
  if (moe) {
    if (num_local_experts < 1) throw UsageError("model.num_local_experts must be at least 1" + who);
    if (num_experts_per_tok < 1 || num_experts_per_tok > num_local_experts)
      throw UsageError("model.num_experts_per_tok=" + std::to_string(num_experts_per_tok) +
                       " must be between 1 and model.num_local_experts=" + std::to_string(num_local_experts) + who);
    if (!(capacity_factor >= 0) || !std::isfinite(capacity_factor))
      throw UsageError("model.capacity_factor must be positive (leave it unset, 0, for dropless routing)" + who);
    if (moe_drop_policy != "probs" && moe_drop_policy != "position")
      throw UsageError("model.moe_drop_policy must be probs or position, got '" + moe_drop_policy + "'" + who);
    if (capacity_factor == 0 && moe_drop_policy != dense.moe_drop_policy)
      throw UsageError("model.moe_drop_policy would have no effect: routing is dropless (model.capacity_factor unset)" +
                       who);
    if (!(router_aux_loss_coef >= 0) || !(router_z_loss_coef >= 0) || !std::isfinite(router_aux_loss_coef) ||
        !std::isfinite(router_z_loss_coef))
      throw UsageError("model.router_aux_loss_coef and router_z_loss_coef must be finite and not negative" + who);
  }
  if (!fam.llama_like) {
    // Fields only the llama family reads: refused, never ignored.
    if (kv_heads() != n_head) throw UsageError("model.n_kv_head is not read by GPT-2's attention" + who);
    if (!rope_scaling.type.empty() || rope_theta != 10000.0)
      throw UsageError("model.rope_theta / rope_scaling: GPT-2 has no rotary embedding" + who);
    if (!tie_word_embeddings) throw UsageError("model.tie_word_embeddings=false: GPT-2's head is the embedding" + who);
    if (attention_bias || mlp_bias || qkv_bias)
      throw UsageError("model.attention_bias / mlp_bias / qkv_bias: GPT-2 uses model.bias" + who);
  } else {
    if (dropout > 0) throw UsageError("model.dropout is not supported by this build's llama family" + who);
    if (head_dim() % 2 != 0)
      throw UsageError("the head width n_embd / n_head must be even for the rotary embedding" + who);
    if (!(rope_theta > 0)) throw UsageError("model.rope_theta must be positive" + who);
    if (!rope_scaling.type.empty()) {
      if (rope_scaling.type != "llama3")
        throw UsageError("rope_scaling type '" + rope_scaling.type + "' is not supported (llama3 is)" + who);
      if (!(rope_scaling.factor > 0) || !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor) ||
          !(rope_scaling.low_freq_factor > 0) || rope_scaling.original_max_positions <= 0)
        throw UsageError(
            "rope_scaling llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
            "original_max_position_embeddings > 0" +
            who);
    }
  }
  // After the family's own refusals (the llama family has no dropout at all).
  if (dropout > 0 && attention_path(attention) == AttentionPath::Flash) {
    std::ostringstream p;
    p << dropout;
    throw UsageError(
        "model.dropout=" + p.str() +
        " drops attention probabilities, which only model.attention: naive computes (flash never holds them)");
  }
  attention_path(attention);  // flash | naive
}

}  // namespace scaletrain::models

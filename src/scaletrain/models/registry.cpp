// The families this build has, their presets, and the checks of a config
// against the family that reads it. Adding a family is a row here, its
// presets, and its model class.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "scaletrain/models/attention.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/llama.h"
#include "scaletrain/models/spec_catalog.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

struct Family {
  const char* name;
  bool llama_like;  // reads n_kv_head, rope, untied heads and the llama biases
  std::vector<std::string> model_types;  // the config.json model_types it reads
  std::function<ModelConfig(const nlohmann::json&, const std::string&)> from_hf;
  std::function<nlohmann::json(const ModelConfig&)> to_hf;
  std::function<ModelPtr(const ModelConfig&, bool)> make;
  std::function<std::vector<std::string>(const ModelConfig&, int)> tensor_parallel_problems;
  std::vector<std::string> lora_targets;  // PEFT's default target_modules
};

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"gpt2", false, {"gpt2"}, gpt2_config_from_hf, gpt2_config_to_hf, [](const ModelConfig& c, bool m) { return std::make_shared<GPTImpl>(c, m); },
       GPTImpl::tensor_parallel_problems, {"c_attn"}},
      {"llama", true, {"llama", "mistral"}, llama_config_from_hf, llama_config_to_hf, [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems, {"q_proj", "v_proj"}},
      // Qwen2 is Llama with biases on q, k and v (qkv_bias).
      {"qwen2", true, {"qwen2"}, llama_config_from_hf, llama_config_to_hf, [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems, {"q_proj", "v_proj"}},
      // Mixtral is Llama with sparse MoE blocks in place of the MLPs (models/moe.h).
      {"mixtral", true, {"mixtral"}, llama_config_from_hf, llama_config_to_hf, [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems, {"q_proj", "v_proj"}},
  };
  return f;
}

const Family& family_of(const std::string& name) {
  for (const auto& f : families())
    if (name == f.name) return f;
  std::string known;
  for (const auto& f : families()) known += (known.empty() ? "" : ", ") + std::string(f.name);
  throw UsageError("unknown model family '" + name + "' (known: " + known + ")");
}

const std::map<std::string, ModelConfig>& presets() {
  static const std::map<std::string, ModelConfig> p = [] {
    std::map<std::string, ModelConfig> m;
    for (const auto& name : gpt_preset_names()) m[name] = gpt_preset(name);
    for (const auto& [name, c] : llama_presets()) m[name] = c;
    return m;
  }();
  return p;
}

}  // namespace

void ModelConfig::validate() const {
  const Family& fam = family_of(family);
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
    throw UsageError("model.n_head=" + std::to_string(n_head) + " does not divide model.n_embd=" + std::to_string(n_embd));
  if (n_head % kv_heads() != 0)
    throw UsageError("model.n_kv_head=" + std::to_string(kv_heads()) + " does not divide model.n_head=" +
                     std::to_string(n_head) + " (each kv head serves a whole group of query heads)");
  if (dropout < 0 || dropout >= 1) throw UsageError("model.dropout must be in [0, 1)");
  if (!(norm_eps > 0)) throw UsageError("model.norm_eps must be positive");
  const std::string who = std::string(" (model family ") + fam.name + ")";
  // Note [MoE routing]: only the mixtral family reads the expert fields, and it needs experts.
  const bool moe = std::string(fam.name) == "mixtral";
  const ModelConfig dense;
  if (!moe && (num_local_experts != 0 || num_experts_per_tok != dense.num_experts_per_tok ||
               router_aux_loss_coef != dense.router_aux_loss_coef || router_z_loss_coef != dense.router_z_loss_coef ||
               capacity_factor != dense.capacity_factor || moe_drop_policy != dense.moe_drop_policy))
    throw UsageError("model.num_local_experts / num_experts_per_tok / router_*_coef / capacity_factor / "
                     "moe_drop_policy are read by model.family=mixtral only" + who);
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
      throw UsageError("model.moe_drop_policy would have no effect: routing is dropless (model.capacity_factor unset)" + who);
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
    if (head_dim() % 2 != 0) throw UsageError("the head width n_embd / n_head must be even for the rotary embedding" + who);
    if (!(rope_theta > 0)) throw UsageError("model.rope_theta must be positive" + who);
    if (!rope_scaling.type.empty()) {
      if (rope_scaling.type != "llama3")
        throw UsageError("rope_scaling type '" + rope_scaling.type + "' is not supported (llama3 is)" + who);
      if (!(rope_scaling.factor > 0) || !(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor) ||
          !(rope_scaling.low_freq_factor > 0) || rope_scaling.original_max_positions <= 0)
        throw UsageError("rope_scaling llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                         "original_max_position_embeddings > 0" + who);
    }
  }
  // After the family's own refusals (the llama family has no dropout at all).
  if (dropout > 0 && attention_path(attention) == AttentionPath::Flash) {
    std::ostringstream p;
    p << dropout;
    throw UsageError("model.dropout=" + p.str() +
                     " drops attention probabilities, which only model.attention: naive computes (flash never holds them)");
  }
  attention_path(attention);  // flash | naive
}

ModelPtr make_model(const ModelConfig& config, bool materialize) {
  config.validate();
  return family_of(config.family).make(config, materialize);
}

std::vector<std::string> tensor_parallel_problems(const ModelConfig& config, int tp) {
  if (tp < 1) return {"tensor parallel degree tp=" + std::to_string(tp) + " must be at least 1"};
  return family_of(config.family).tensor_parallel_problems(config, tp);
}

void check_tensor_parallel(const ModelConfig& config, int tp) {
  const auto problems = tensor_parallel_problems(config, tp);
  if (problems.empty()) return;
  std::string line;
  for (const auto& p : problems) line += (line.empty() ? "" : "; ") + p;
  throw UsageError(line);
}

ModelConfig model_preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
    throw UsageError("unknown model preset '" + name + "' (known: " + known + ")");
  }
  return it->second;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (auto& [k, v] : presets()) names.push_back(k);
  return names;
}

estimate::ModelSpec estimator_spec(const ModelConfig& c) {
  const Family& fam = family_of(c.family);
  estimate::ModelSpec s = estimator_structure(fam.name);
  s.name = c.family + " " + std::to_string(c.n_layer) + "x" + std::to_string(c.n_embd);
  s.vocab_size = c.vocab_size;
  s.hidden_size = c.n_embd;
  s.num_layers = c.n_layer;
  s.num_heads = c.n_head;
  s.num_kv_heads = c.kv_heads();
  s.intermediate_size = c.mlp_width();
  s.max_positions = c.block_size;
  s.tie_word_embeddings = c.tie_word_embeddings;
  s.num_experts = c.num_local_experts;
  s.experts_per_token = c.num_local_experts > 0 ? c.num_experts_per_tok : 0;
  if (fam.llama_like) {
    s.qkv_bias = c.attention_bias || c.qkv_bias;
    s.o_bias = c.attention_bias;
    s.mlp_bias = c.mlp_bias;
  } else if (!c.bias) {
    s.qkv_bias = s.o_bias = s.mlp_bias = false;  // (its LayerNorms lose a bias too: h per norm, not counted)
  }
  return s;
}

ModelConfig config_from_hf(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw UsageError(source + ": not a JSON object");
  const std::string type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  std::string known;
  for (const auto& f : families())
    for (const auto& t : f.model_types) {
      if (t == type) return f.from_hf(j, source);
      known += (known.empty() ? "" : ", ") + t;
    }
  throw UsageError(source + ": model_type '" + type + "' is not supported (known: " + known + ")");
}

std::vector<std::string> default_lora_targets(const std::string& family) { return family_of(family).lora_targets; }

std::string recorded_family(const std::string& recorded) { return recorded.empty() ? "gpt2" : recorded; }

nlohmann::json config_to_hf(const ModelConfig& c) { return family_of(c.family).to_hf(c); }

ModelConfig read_hf_config(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  if (!in) throw UsageError("cannot read model config " + p.string());
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception&) {
    throw UsageError(p.string() + " is not valid JSON");
  }
  return config_from_hf(j, p.string());
}

std::vector<std::string> model_families() {
  std::vector<std::string> out;
  for (const auto& f : families()) out.emplace_back(f.name);
  return out;
}

}  // namespace scaletrain::models

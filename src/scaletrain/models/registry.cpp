// The families this build has and their presets; the checks of a config
// against the family that reads it are model_config.cpp's. Adding a family
// is a row here and one in model_config.cpp, its presets, and its model class.
#include <filesystem>
#include <fstream>
#include <map>

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
  std::vector<std::string> model_types;  // the config.json model_types it reads
  std::function<ModelConfig(const nlohmann::json&, const std::string&)> from_hf;
  std::function<nlohmann::json(const ModelConfig&)> to_hf;
  std::function<ModelPtr(const ModelConfig&, bool)> make;
  std::function<std::vector<std::string>(const ModelConfig&, int)> tensor_parallel_problems;
  std::vector<std::string> lora_targets;  // PEFT's default target_modules
};

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"gpt2",
       {"gpt2"},
       gpt2_config_from_hf,
       gpt2_config_to_hf,
       [](const ModelConfig& c, bool m) { return std::make_shared<GPTImpl>(c, m); },
       GPTImpl::tensor_parallel_problems,
       {"c_attn"}},
      {"llama",
       {"llama", "mistral"},
       llama_config_from_hf,
       llama_config_to_hf,
       [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems,
       {"q_proj", "v_proj"}},
      // Qwen2 is Llama with biases on q, k and v (qkv_bias).
      {"qwen2",
       {"qwen2"},
       llama_config_from_hf,
       llama_config_to_hf,
       [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems,
       {"q_proj", "v_proj"}},
      // Mixtral is Llama with sparse MoE blocks in place of the MLPs (models/moe.h).
      {"mixtral",
       {"mixtral"},
       llama_config_from_hf,
       llama_config_to_hf,
       [](const ModelConfig& c, bool m) { return std::make_shared<LlamaImpl>(c, m); },
       LlamaImpl::tensor_parallel_problems,
       {"q_proj", "v_proj"}},
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

ModelPtr make_model(const ModelConfig& config, bool materialize) {
  config.validate();
  return family_of(config.family).make(config, materialize);
}

std::vector<std::string> tensor_parallel_problems(const ModelConfig& config, int tp) {
  if (tp < 1) return {tensor_parallel_degree_problem(tp)};
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
  if (llama_like_family(fam.name)) {
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

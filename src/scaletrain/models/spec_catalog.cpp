// The families as the estimator sees them. See spec_catalog.h.
//
// Note [Family structures]
// ------------------------
// What each Hugging Face class builds (transformers 4.x):
//   gpt2:    LayerNorm; one fused Conv1D for q, k and v (c_attn, h -> 3h);
//            biases everywhere; a learned position table; per block a causal
//            mask buffer (attn.bias, bool) and attn.masked_bias (fp32 scalar);
//            head tied to the token embedding. No-split unit: GPT2Block.
//   llama, mistral: RMSNorm; separate q, k, v, o (grouped-query attention);
//            a SwiGLU MLP (gate, up, down); biases only if attention_bias /
//            mlp_bias; one rotary_emb.inv_freq buffer (head_dim/2 fp32) at
//            model level. (transformers before ~4.38 kept one per layer plus
//            cos/sin caches, which is why older Hub reports of Llama-2-7B read
//            24.74 GB.) No-split unit: the decoder layer.
//   qwen2:   llama with biases on q, k and v (never on o).
//   bert:    an encoder: LayerNorm, biases everywhere, word, position and
//            token-type tables with a LayerNorm, a pooler; no LM head
//            (AutoModel). Buffers embeddings.position_ids and token_type_ids
//            (int64, max_position_embeddings each). No-split units:
//            BertEmbeddings and BertLayer.
#include "scaletrain/models/spec_catalog.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

using estimate::ModelSpec;
using estimate::Norm;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

ModelSpec gpt2(const char* name, int64_t h, int64_t layers, int64_t heads) {
  ModelSpec s = estimator_structure("gpt2");
  s.name = name;
  s.vocab_size = 50257;
  s.max_positions = 1024;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = s.num_kv_heads = heads;
  s.intermediate_size = 4 * h;
  return s;
}

ModelSpec llama(const char* name, const char* family, int64_t vocab, int64_t h, int64_t inter, int64_t layers,
                int64_t heads, int64_t kv_heads, int64_t max_pos, bool tied = false) {
  ModelSpec s = estimator_structure(family);
  s.name = name;
  s.vocab_size = vocab;
  s.hidden_size = h;
  s.intermediate_size = inter;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.max_positions = max_pos;
  s.tie_word_embeddings = tied;
  return s;
}

ModelSpec bert(const char* name, int64_t vocab, int64_t h, int64_t layers, int64_t heads) {
  ModelSpec s = estimator_structure("bert");
  s.name = name;
  s.vocab_size = vocab;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = s.num_kv_heads = heads;
  s.intermediate_size = 4 * h;
  s.max_positions = 512;
  s.type_vocab_size = 2;
  return s;
}

// Shapes from the published config.json files of each checkpoint.
const std::map<std::string, ModelSpec>& presets() {
  static const std::map<std::string, ModelSpec> table = [] {
    std::map<std::string, ModelSpec> t;
    auto add = [&t](ModelSpec s) { t.emplace(s.name, std::move(s)); };
    add(gpt2("gpt2", 768, 12, 12));
    add(gpt2("gpt2-medium", 1024, 24, 16));
    add(gpt2("gpt2-large", 1280, 36, 20));
    add(gpt2("gpt2-xl", 1600, 48, 25));
    add(llama("llama-7b", "llama", 32000, 4096, 11008, 32, 32, 32, 2048));
    add(llama("llama-2-7b", "llama", 32000, 4096, 11008, 32, 32, 32, 4096));
    add(llama("llama-2-13b", "llama", 32000, 5120, 13824, 40, 40, 40, 4096));
    add(llama("llama-2-70b", "llama", 32000, 8192, 28672, 80, 64, 8, 4096));
    add(llama("llama-3-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 8192));
    add(llama("llama-3-70b", "llama", 128256, 8192, 28672, 80, 64, 8, 8192));
    add(llama("llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 131072, /*tied=*/true));
    add(llama("mistral-7b", "mistral", 32000, 4096, 14336, 32, 32, 8, 32768));
    ModelSpec mixtral = llama("mixtral-8x7b", "mixtral", 32000, 4096, 14336, 32, 32, 8, 32768);
    mixtral.num_experts = 8;
    mixtral.experts_per_token = 2;
    add(mixtral);
    add(bert("bert-base-uncased", 30522, 768, 12, 12));
    add(bert("bert-base-cased", 28996, 768, 12, 12));
    add(bert("bert-large-uncased", 30522, 1024, 24, 16));
    return t;
  }();
  return table;
}

// Other spellings people type, mapped to a canonical preset.
const std::map<std::string, std::string>& aliases() {
  static const std::map<std::string, std::string> table = {
      {"gpt2-small", "gpt2"},          {"meta-llama-3-8b", "llama-3-8b"},
      {"llama3-8b", "llama-3-8b"},     {"meta-llama-3-70b", "llama-3-70b"},
      {"llama-3.1-8b", "llama-3-8b"},  {"mistral-7b-v0.1", "mistral-7b"},
      {"llama2-7b", "llama-2-7b"},     {"llama-3.2-1b-instruct", "llama-3.2-1b"},
      {"mixtral-8x7b-v0.1", "mixtral-8x7b"},
  };
  return table;
}

std::string canonical_preset(const std::string& name) {
  std::string n = lower(name);
  if (auto slash = n.rfind('/'); slash != std::string::npos) n = n.substr(slash + 1);
  if (n.size() > 3 && n.compare(n.size() - 3, 3, "-hf") == 0) n.resize(n.size() - 3);
  if (auto it = aliases().find(n); it != aliases().end()) n = it->second;
  return n;
}

int64_t get_int(const nlohmann::json& j, std::initializer_list<const char*> keys, const std::string& name,
                int64_t fallback = -1) {
  for (const char* key : keys) {
    auto it = j.find(key);
    if (it != j.end() && it->is_number_integer()) return it->get<int64_t>();
  }
  if (fallback >= 0) return fallback;
  throw UsageError("config '" + name + "': missing integer field '" + *keys.begin() + "'");
}

bool get_bool(const nlohmann::json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return (it != j.end() && it->is_boolean()) ? it->get<bool>() : fallback;
}

}  // namespace

ModelSpec estimator_structure(const std::string& family) {
  ModelSpec s;
  s.family = family;
  if (family == "gpt2") {
    s.fused_qkv = s.qkv_bias = s.o_bias = s.mlp_bias = true;
    s.learned_positions = s.causal_mask_buffers = true;
    s.tie_word_embeddings = true;
  } else if (family == "llama" || family == "mistral" || family == "qwen2" || family == "mixtral") {
    s.norm = Norm::kRMSNorm;
    s.gated_mlp = s.rotary_buffer = true;
    s.qkv_bias = family == "qwen2";
  } else if (family == "bert") {
    s.qkv_bias = s.o_bias = s.mlp_bias = true;
    s.learned_positions = s.encoder = s.embeddings_unit = true;
    s.position_id_buffers = 2;
  } else {
    throw UsageError("unknown architecture '" + (family.empty() ? std::string("(no model_type)") : family) +
                     "' (known: gpt2, llama, mistral, qwen2, mixtral, bert)");
  }
  return s;
}

std::vector<std::string> estimator_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, spec] : presets()) names.push_back(name);
  return names;
}

ModelSpec estimator_preset(const std::string& name) {
  const auto it = presets().find(canonical_preset(name));
  if (it == presets().end())
    throw UsageError("unknown model preset '" + name + "' (known: " + join(estimator_preset_names(), ", ") + ")");
  return it->second;
}

ModelSpec estimator_spec_from_hf(const nlohmann::json& j, const std::string& name) {
  if (!j.is_object()) throw UsageError("config '" + name + "': not a JSON object");
  const std::string type = j.contains("model_type") && j["model_type"].is_string()
                               ? lower(j["model_type"].get<std::string>()) : "";
  ModelSpec s;
  try {
    s = estimator_structure(type);
  } catch (const UsageError& e) {
    throw UsageError("config '" + name + "': " + e.what());
  }
  s.name = name;
  if (type == "gpt2") {
    s.hidden_size = get_int(j, {"n_embd", "hidden_size"}, name);
    s.num_layers = get_int(j, {"n_layer", "num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"n_head", "num_attention_heads"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"n_positions", "max_position_embeddings"}, name);
    s.intermediate_size = get_int(j, {"n_inner"}, name, 4 * s.hidden_size);  // null -> 4h
    s.tie_word_embeddings = get_bool(j, "tie_word_embeddings", true);
    s.num_kv_heads = s.num_heads;
  } else if (type == "bert") {
    s.hidden_size = get_int(j, {"hidden_size"}, name);
    s.num_layers = get_int(j, {"num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"num_attention_heads"}, name);
    s.num_kv_heads = s.num_heads;
    s.intermediate_size = get_int(j, {"intermediate_size"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"max_position_embeddings"}, name, 512);
    s.type_vocab_size = get_int(j, {"type_vocab_size"}, name, 2);
  } else {  // the llama-shaped decoders
    s.hidden_size = get_int(j, {"hidden_size"}, name);
    s.num_layers = get_int(j, {"num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"num_attention_heads"}, name);
    s.num_kv_heads = get_int(j, {"num_key_value_heads"}, name, s.num_heads);
    s.intermediate_size = get_int(j, {"intermediate_size"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"max_position_embeddings"}, name, 2048);
    s.head_dim = get_int(j, {"head_dim"}, name, 0);
    s.tie_word_embeddings = get_bool(j, "tie_word_embeddings", false);
    const bool attention_bias = get_bool(j, "attention_bias", false);
    s.qkv_bias = s.qkv_bias || attention_bias;
    s.o_bias = attention_bias;
    s.mlp_bias = get_bool(j, "mlp_bias", false);
    if (type == "mixtral") {  // sparse MoE blocks: both counts are part of the architecture
      s.num_experts = get_int(j, {"num_local_experts"}, name);
      s.experts_per_token = get_int(j, {"num_experts_per_tok"}, name);
      if (s.num_experts < 1 || s.experts_per_token < 1 || s.experts_per_token > s.num_experts)
        throw UsageError("config '" + name + "': num_experts_per_tok=" + std::to_string(s.experts_per_token) +
                         " must be between 1 and num_local_experts=" + std::to_string(s.num_experts));
    }
  }
  estimate::count_params(s);  // validates divisibility now, with the config's name in the message
  return s;
}

ModelSpec load_estimator_config(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  if (!in) throw UsageError("cannot read model config '" + p.string() + "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("config '" + p.string() + "' is not valid JSON: " + e.what());
  }
  return estimator_spec_from_hf(j, path);
}

ModelSpec resolve_estimator_model(const std::string& model) {
  if (presets().count(canonical_preset(model))) return estimator_preset(model);
  std::error_code ec;
  if (std::filesystem::exists(model, ec)) return load_estimator_config(model);
  if (const int64_t n = estimate::parse_param_count(model); n > 0) return estimate::raw_count(model, n);
  throw UsageError("unknown model '" + model + "': not a preset (known: " + join(estimator_preset_names(), ", ") +
                   "), a config.json path, or a parameter count such as 7.5B");
}

}  // namespace scaletrain::models

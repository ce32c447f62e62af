// Model descriptions and exact parameter counts. See model_spec.h.
//
// Note [What is counted]
// ----------------------
// Parameters: every nn.Parameter of the Hugging Face reference class, a tied
// LM head counted once (DeepSpeed's model_to_params dedups by data_ptr; a tied
// head has no storage of its own). The training model is the *ForCausalLM
// class for decoders and BertModel (with pooler) for BERT. Accelerate's
// estimate-memory builds `AutoModel.from_config`, i.e. the base model without
// the LM head: `base_model` is that count.
//
// Buffers are what the current transformers 4.x classes register, as
// Accelerate's compute_module_sizes sees them (it walks named_module_tensors,
// persistent or not):
//   GPT-2:   per block, attn.bias (bool causal mask, n_positions^2) and
//            attn.masked_bias (fp32 scalar).
//   Llama,   one rotary_emb.inv_freq of head_dim/2 fp32 at model level.
//   Mistral: (transformers before ~4.38 kept one per layer plus cos/sin caches,
//            which is why older Hub reports of Llama-2-7B read 24.74 GB.)
//   BERT:    embeddings.position_ids and embeddings.token_type_ids, int64 of
//            max_position_embeddings each.
// Accelerate sizes a bool element at 1/8 byte (its dtype_byte_size), so we do.
#include "scaletrain/estimate/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "scaletrain/util/error.h"

namespace scaletrain::estimate {
namespace {

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
  ModelSpec s;
  s.name = name;
  s.arch = Arch::kGpt2;
  s.vocab_size = 50257;
  s.max_positions = 1024;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = heads;
  s.intermediate_size = 4 * h;
  s.tie_word_embeddings = true;
  return s;
}

ModelSpec llama(const char* name, Arch arch, int64_t vocab, int64_t h, int64_t inter, int64_t layers,
                int64_t heads, int64_t kv_heads, int64_t max_pos, bool tied = false) {
  ModelSpec s;
  s.name = name;
  s.arch = arch;
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
  ModelSpec s;
  s.name = name;
  s.arch = Arch::kBert;
  s.vocab_size = vocab;
  s.hidden_size = h;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = heads;
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
    add(llama("llama-7b", Arch::kLlama, 32000, 4096, 11008, 32, 32, 32, 2048));
    add(llama("llama-2-7b", Arch::kLlama, 32000, 4096, 11008, 32, 32, 32, 4096));
    add(llama("llama-2-13b", Arch::kLlama, 32000, 5120, 13824, 40, 40, 40, 4096));
    add(llama("llama-2-70b", Arch::kLlama, 32000, 8192, 28672, 80, 64, 8, 4096));
    add(llama("llama-3-8b", Arch::kLlama, 128256, 4096, 14336, 32, 32, 8, 8192));
    add(llama("llama-3-70b", Arch::kLlama, 128256, 8192, 28672, 80, 64, 8, 8192));
    add(llama("llama-3.2-1b", Arch::kLlama, 128256, 2048, 8192, 16, 32, 8, 131072, /*tied=*/true));
    add(llama("mistral-7b", Arch::kMistral, 32000, 4096, 14336, 32, 32, 8, 32768));
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

int64_t head_dim_of(const ModelSpec& s) {
  if (s.head_dim > 0) return s.head_dim;
  if (s.num_heads <= 0 || s.hidden_size % s.num_heads != 0)
    throw UsageError("model '" + s.name + "': hidden_size " + std::to_string(s.hidden_size) +
                     " is not divisible by num_heads " + std::to_string(s.num_heads));
  return s.hidden_size / s.num_heads;
}

int64_t max_of(std::initializer_list<int64_t> v) { return *std::max_element(v.begin(), v.end()); }

}  // namespace

const char* arch_name(Arch arch) {
  switch (arch) {
    case Arch::kGpt2: return "gpt2";
    case Arch::kLlama: return "llama";
    case Arch::kMistral: return "mistral";
    case Arch::kBert: return "bert";
    case Arch::kRaw: return "raw";
  }
  return "?";
}

ParamCounts count_params(const ModelSpec& s) {
  ParamCounts c;
  if (s.arch == Arch::kRaw) {
    c.total = c.base_model = s.raw_params;
    return c;
  }
  if (s.hidden_size <= 0 || s.num_layers <= 0 || s.num_heads <= 0 || s.vocab_size <= 0)
    throw UsageError("model '" + s.name + "': hidden_size, num_layers, num_heads and vocab_size must be positive");
  const int64_t h = s.hidden_size, V = s.vocab_size, L = s.num_layers, I = s.intermediate_size;
  const int64_t P = s.max_positions;
  switch (s.arch) {
    case Arch::kGpt2: {
      // Block: ln_1, ln_2 (weight+bias); c_attn h->3h; attn c_proj h->h; c_fc h->I;
      // mlp c_proj I->h; every Conv1D has a bias. That is 12h^2+13h for I=4h.
      const int64_t c_attn = h * 3 * h + 3 * h, attn_proj = h * h + h;
      const int64_t c_fc = h * I + I, mlp_proj = I * h + h;
      c.per_layer = 4 * h + c_attn + attn_proj + c_fc + mlp_proj;
      c.per_layer_tp_split = c_attn + h * h + c_fc + I * h;  // row-parallel biases and norms replicate
      c.embedding = V * h + P * h;
      c.embedding_tp_split = V * h;
      c.final_norm = 2 * h;
      c.head = s.tie_word_embeddings ? 0 : V * h;
      c.largest_module = max_of({V * h, P * h, c_attn, c_fc, mlp_proj});
      c.largest_linear = std::max(h * 3 * h, h * I);
      // Per block: bool causal mask (1/8 byte each in Accelerate) + fp32 scalar.
      const double block_buffers = static_cast<double>(P * P) / 8.0 + 4.0;
      c.buffer_bytes = block_buffers * static_cast<double>(L);
      // _no_split_modules = ["GPT2Block"]; other leaves: wte, wpe, ln_f.
      c.largest_layer_bytes = std::max({4.0 * V * h, 4.0 * P * h, 4.0 * c.per_layer + block_buffers});
      break;
    }
    case Arch::kLlama:
    case Arch::kMistral: {
      const int64_t hd = head_dim_of(s), nh = s.num_heads, nkv = s.num_kv_heads > 0 ? s.num_kv_heads : nh;
      const int64_t ab = s.attention_bias ? 1 : 0, mb = s.mlp_bias ? 1 : 0;
      const int64_t q = h * nh * hd + ab * nh * hd, k = h * nkv * hd + ab * nkv * hd, v = k;
      const int64_t o = nh * hd * h + ab * h;
      const int64_t gate = h * I + mb * I, up = gate, down = I * h + mb * h;
      c.per_layer = q + k + v + o + gate + up + down + 2 * h;  // + input/post-attention RMSNorm
      c.per_layer_tp_split = q + k + v + nh * hd * h + gate + up + I * h;
      c.embedding = c.embedding_tp_split = V * h;
      c.final_norm = h;
      c.head = s.tie_word_embeddings ? 0 : V * h;
      c.largest_module = max_of({V * h, q, k, o, gate, down});
      c.largest_linear = std::max({h * nh * hd, h * I});
      c.buffer_bytes = 4.0 * static_cast<double>(hd / 2);  // rotary inv_freq
      // _no_split_modules = ["LlamaDecoderLayer"] / ["MistralDecoderLayer"].
      c.largest_layer_bytes = std::max({4.0 * V * h, 4.0 * c.per_layer, c.buffer_bytes});
      break;
    }
    case Arch::kBert: {
      const int64_t T = s.type_vocab_size;
      const int64_t qkv = 3 * (h * h + h), attn_out = h * h + h, inter = h * I + I, out = I * h + h;
      c.per_layer = qkv + attn_out + inter + out + 4 * h;  // + attention and output LayerNorm
      c.per_layer_tp_split = qkv + h * h + inter + I * h;
      c.embedding = V * h + P * h + T * h + 2 * h;  // word, position, token type, LayerNorm
      c.embedding_tp_split = V * h;
      c.pooler = h * h + h;
      c.head = 0;  // BertModel: no MLM head (what AutoModel builds)
      c.largest_module = max_of({V * h, P * h, T * h, h * h + h, inter, out});
      c.largest_linear = std::max(h * h, h * I);
      c.buffer_bytes = 8.0 * 2.0 * static_cast<double>(P);  // position_ids, token_type_ids (int64)
      // _no_split_modules = ["BertEmbeddings", "BertLayer"]; pooler.dense is a leaf.
      c.largest_layer_bytes =
          std::max({4.0 * c.embedding + c.buffer_bytes, 4.0 * c.per_layer, 4.0 * c.pooler});
      break;
    }
    case Arch::kRaw: break;
  }
  c.total = c.embedding + L * c.per_layer + c.final_norm + c.head + c.pooler;
  c.base_model = c.total - c.head;
  return c;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, spec] : presets()) names.push_back(name);
  return names;
}

ModelSpec preset(const std::string& name) {
  const auto it = presets().find(canonical_preset(name));
  if (it == presets().end())
    throw UsageError("unknown model preset '" + name + "' (known: " + join(preset_names(), ", ") + ")");
  return it->second;
}

namespace {

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

ModelSpec from_hf_config(const nlohmann::json& j, const std::string& name) {
  if (!j.is_object()) throw UsageError("config '" + name + "': not a JSON object");
  const std::string type = j.contains("model_type") && j["model_type"].is_string()
                               ? lower(j["model_type"].get<std::string>()) : "";
  ModelSpec s;
  s.name = name;
  if (type == "gpt2") {
    s.arch = Arch::kGpt2;
    s.hidden_size = get_int(j, {"n_embd", "hidden_size"}, name);
    s.num_layers = get_int(j, {"n_layer", "num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"n_head", "num_attention_heads"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"n_positions", "max_position_embeddings"}, name);
    s.intermediate_size = get_int(j, {"n_inner"}, name, 4 * s.hidden_size);  // null -> 4h
    s.tie_word_embeddings = get_bool(j, "tie_word_embeddings", true);
    s.num_kv_heads = s.num_heads;
  } else if (type == "llama" || type == "mistral") {
    s.arch = type == "llama" ? Arch::kLlama : Arch::kMistral;
    s.hidden_size = get_int(j, {"hidden_size"}, name);
    s.num_layers = get_int(j, {"num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"num_attention_heads"}, name);
    s.num_kv_heads = get_int(j, {"num_key_value_heads"}, name, s.num_heads);
    s.intermediate_size = get_int(j, {"intermediate_size"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"max_position_embeddings"}, name, 2048);
    s.head_dim = get_int(j, {"head_dim"}, name, 0);
    s.tie_word_embeddings = get_bool(j, "tie_word_embeddings", false);
    s.attention_bias = get_bool(j, "attention_bias", false);
    s.mlp_bias = get_bool(j, "mlp_bias", false);
  } else if (type == "bert") {
    s.arch = Arch::kBert;
    s.hidden_size = get_int(j, {"hidden_size"}, name);
    s.num_layers = get_int(j, {"num_hidden_layers"}, name);
    s.num_heads = get_int(j, {"num_attention_heads"}, name);
    s.num_kv_heads = s.num_heads;
    s.intermediate_size = get_int(j, {"intermediate_size"}, name);
    s.vocab_size = get_int(j, {"vocab_size"}, name);
    s.max_positions = get_int(j, {"max_position_embeddings"}, name, 512);
    s.type_vocab_size = get_int(j, {"type_vocab_size"}, name, 2);
  } else {
    throw UsageError("config '" + name + "': unknown architecture '" + (type.empty() ? "(no model_type)" : type) +
                     "' (known: gpt2, llama, mistral, bert)");
  }
  count_params(s);  // validates divisibility now, with the config's name in the message
  return s;
}

ModelSpec load_hf_config(const std::string& path) {
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
  return from_hf_config(j, path);
}

int64_t parse_param_count(const std::string& text) {
  std::string digits;
  for (char ch : text)
    if (ch != '_' && ch != ',') digits += ch;
  if (digits.empty()) return -1;
  double mult = 1;
  switch (std::tolower(static_cast<unsigned char>(digits.back()))) {
    case 'k': mult = 1e3; break;
    case 'm': mult = 1e6; break;
    case 'b': case 'g': mult = 1e9; break;
    case 't': mult = 1e12; break;
    default: break;
  }
  if (mult != 1) digits.pop_back();
  if (digits.empty() || !(std::isdigit(static_cast<unsigned char>(digits[0])) || digits[0] == '.')) return -1;
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || !(value > 0) || !std::isfinite(value)) return -1;
  return std::llround(value * mult);
}

ModelSpec resolve_model(const std::string& model) {
  if (presets().count(canonical_preset(model))) return preset(model);
  std::error_code ec;
  if (std::filesystem::exists(model, ec)) return load_hf_config(model);
  if (const int64_t n = parse_param_count(model); n > 0) {
    ModelSpec s;
    s.name = model;
    s.arch = Arch::kRaw;
    s.raw_params = n;
    return s;
  }
  throw UsageError("unknown model '" + model + "': not a preset (known: " + join(preset_names(), ", ") +
                   "), a config.json path, or a parameter count such as 7.5B");
}

}  // namespace scaletrain::estimate

#include "scaletrain/models/hf_config.h"

#include "scaletrain/models/llama.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

// GPT2Config's keys as transformers writes them; GPT-2 has no other
// choices this build makes differently (tanh GELU, LayerNorm eps 1e-5,
// MLP width 4 x n_embd, a tied head).
nlohmann::json gpt2_config_to_hf(const ModelConfig& c) {
  return {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", c.vocab_size},
      {"n_positions", c.block_size},
      {"n_ctx", c.block_size},
      {"n_embd", c.n_embd},
      {"n_layer", c.n_layer},
      {"n_head", c.n_head},
      {"n_inner", nullptr},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", c.norm_eps},
      {"resid_pdrop", c.dropout},
      {"embd_pdrop", c.dropout},
      {"attn_pdrop", c.dropout},
      {"initializer_range", 0.02},
      {"scale_attn_weights", true},
      {"tie_word_embeddings", true},
      {"use_cache", true},
      {"torch_dtype", "float32"},
  };
}

ModelConfig gpt2_config_from_hf(const nlohmann::json& j, const std::string& source) {
  auto fail = [&](const std::string& what) { throw UsageError(source + ": " + what); };
  auto get = [&](const char* key) -> int64_t {
    if (!j.contains(key) || !j[key].is_number_integer()) fail(std::string("missing integer '") + key + "'");
    return j[key].get<int64_t>();
  };
  ModelConfig c;
  c.family = "gpt2";
  c.vocab_size = get("vocab_size");
  c.block_size = get("n_positions");
  c.n_embd = get("n_embd");
  c.n_layer = get("n_layer");
  c.n_head = get("n_head");
  c.norm_eps = j.value("layer_norm_epsilon", 1e-5);
  c.dropout = 0.0;  // a training choice (model.dropout), not the weights'
  const std::string act = j.value("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    fail("activation_function '" + act + "' is not supported (this GPT-2 uses the tanh GELU, gelu_new)");
  if (j.contains("n_inner") && !j["n_inner"].is_null() && j["n_inner"] != 4 * c.n_embd)
    fail("n_inner other than 4 x n_embd is not supported");
  c.validate();
  return c;
}

}  // namespace

nlohmann::json model_config_to_hf(const ModelConfig& c) {
  if (c.family == "gpt2") return gpt2_config_to_hf(c);
  return llama_config_to_hf(c);
}

ModelConfig model_config_from_hf(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw UsageError(source + ": a config.json must be a JSON object");
  if (j.value("model_type", std::string()) == "gpt2") return gpt2_config_from_hf(j, source);
  return llama_config_from_hf(j, source);
}

}  // namespace scaletrain::models

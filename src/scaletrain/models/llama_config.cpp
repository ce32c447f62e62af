// The llama family's presets (the published config.json values of each
// model) and the reading of a Hugging Face config.json of model_type llama,
// mistral or qwen2.
#include <nlohmann/json.hpp>

#include "scaletrain/models/llama.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

ModelConfig llama(int64_t vocab, int64_t positions, int64_t layers, int64_t heads, int64_t kv_heads, int64_t width,
                  int64_t inter, double eps, double theta, bool tie) {
  ModelConfig c;
  c.family = "llama";
  c.vocab_size = vocab;
  c.block_size = positions;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_kv_head = kv_heads;
  c.n_embd = width;
  c.intermediate_size = inter;
  c.norm_eps = eps;
  c.rope_theta = theta;
  c.tie_word_embeddings = tie;
  c.bias = false;
  return c;
}

}  // namespace

std::vector<std::pair<std::string, ModelConfig>> llama_presets() {
  std::vector<std::pair<std::string, ModelConfig>> p;
  // For tests: byte vocabulary, grouped-query attention (4 heads, 2 kv
  // heads), an untied head, an MLP width that tp = 2 and 4 divide.
  p.emplace_back("llama-tiny", llama(256, 128, 2, 4, 2, 64, 176, 1e-5, 10000.0, false));
  p.emplace_back("smollm2-135m", llama(49152, 8192, 30, 9, 3, 576, 1536, 1e-5, 100000.0, true));
  p.emplace_back("smollm2-360m", llama(49152, 8192, 32, 15, 5, 960, 2560, 1e-5, 100000.0, true));
  p.emplace_back("tinyllama-1.1b", llama(32000, 2048, 22, 32, 4, 2048, 5632, 1e-5, 10000.0, false));
  p.emplace_back("llama-2-7b", llama(32000, 4096, 32, 32, 32, 4096, 11008, 1e-5, 10000.0, false));
  p.emplace_back("llama-3-8b", llama(128256, 8192, 32, 32, 8, 4096, 14336, 1e-5, 500000.0, false));
  ModelConfig l31 = llama(128256, 131072, 32, 32, 8, 4096, 14336, 1e-5, 500000.0, false);
  l31.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 8192};
  p.emplace_back("llama-3.1-8b", l31);
  // Mixtral (models/moe.h): for tests, 4 experts of which each token takes 2;
  // and Mixtral-8x7B's published config.json.
  auto mixtral = [](ModelConfig c, int64_t experts) {
    c.family = "mixtral";
    c.num_local_experts = experts;
    c.num_experts_per_tok = 2;
    c.router_aux_loss_coef = 0.02;
    return c;
  };
  p.emplace_back("mixtral-tiny", mixtral(llama(256, 128, 2, 4, 2, 64, 96, 1e-5, 10000.0, false), 4));
  p.emplace_back("mixtral-8x7b", mixtral(llama(32000, 32768, 32, 32, 8, 4096, 14336, 1e-5, 1000000.0, false), 8));
  return p;
}

ModelConfig llama_config_from_hf(const nlohmann::json& j, const std::string& file) {
  auto fail = [&](const std::string& what) { throw UsageError(file + ": " + what); };
  const std::string type = j.value("model_type", "");
  if (type != "llama" && type != "mistral" && type != "qwen2" && type != "mixtral")
    fail("model_type '" + type + "' is not of the llama family");
  auto get = [&](const char* key) -> int64_t {
    if (!j.contains(key) || !j[key].is_number_integer()) fail(std::string("missing integer '") + key + "'");
    return j[key].get<int64_t>();
  };
  ModelConfig c = llama(get("vocab_size"), get("max_position_embeddings"), get("num_hidden_layers"),
                        get("num_attention_heads"), j.value("num_key_value_heads", get("num_attention_heads")),
                        get("hidden_size"), get("intermediate_size"), j.value("rms_norm_eps", 1e-6),
                        j.value("rope_theta", 10000.0), j.value("tie_word_embeddings", type == "qwen2"));
  if (type == "qwen2") {
    c.family = "qwen2";
    c.qkv_bias = true;
  }
  if (type == "mixtral") {
    c.family = "mixtral";
    c.num_local_experts = get("num_local_experts");
    c.num_experts_per_tok = get("num_experts_per_tok");
    c.router_aux_loss_coef = j.value("router_aux_loss_coef", 0.001);
    // transformers' Mixtral trains dropless with no z-loss: nothing to read for those.
    if (j.value("router_jitter_noise", 0.0) != 0.0) fail("router_jitter_noise is not supported (0 is)");
  }
  c.attention_bias = j.value("attention_bias", false);
  c.mlp_bias = j.value("mlp_bias", false);
  const std::string act = j.value("hidden_act", "silu");
  if (act != "silu") fail("hidden_act '" + act + "' is not supported (silu is)");
  if (j.contains("head_dim") && !j["head_dim"].is_null() && j["head_dim"].get<int64_t>() != c.n_embd / c.n_head)
    fail("head_dim other than hidden_size / num_attention_heads is not supported");
  // A sliding window that is on changes attention: refused, never ignored.
  const bool window = j.contains("sliding_window") && !j["sliding_window"].is_null() &&
                      (type == "mistral" || type == "mixtral" || j.value("use_sliding_window", false));
  if (window && j["sliding_window"].get<int64_t>() < c.block_size)
    fail("sliding_window attention is not supported (set it to null, or above max_position_embeddings)");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const auto& rs = j["rope_scaling"];
    const std::string kind = rs.value("rope_type", rs.value("type", ""));
    if (kind != "llama3") fail("rope_scaling type '" + kind + "' is not supported (llama3 is)");
    c.rope_scaling.type = kind;
    c.rope_scaling.factor = rs.value("factor", 8.0);
    c.rope_scaling.low_freq_factor = rs.value("low_freq_factor", 1.0);
    c.rope_scaling.high_freq_factor = rs.value("high_freq_factor", 4.0);
    c.rope_scaling.original_max_positions = rs.value("original_max_position_embeddings", int64_t{8192});
  }
  c.validate();
  return c;
}

nlohmann::json llama_config_to_hf(const ModelConfig& c) {
  const bool qwen = c.family == "qwen2", mixtral = c.family == "mixtral";
  nlohmann::json j = {
      {"architectures", {qwen ? "Qwen2ForCausalLM" : mixtral ? "MixtralForCausalLM" : "LlamaForCausalLM"}},
      {"model_type", qwen ? "qwen2" : mixtral ? "mixtral" : "llama"},
      {"vocab_size", c.vocab_size},
      {"max_position_embeddings", c.block_size},
      {"hidden_size", c.n_embd},
      {"intermediate_size", c.mlp_width()},
      {"num_hidden_layers", c.n_layer},
      {"num_attention_heads", c.n_head},
      {"num_key_value_heads", c.kv_heads()},
      {"hidden_act", "silu"},
      {"rms_norm_eps", c.norm_eps},
      {"rope_theta", c.rope_theta},
      {"rope_scaling", nullptr},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"torch_dtype", "float32"},
  };
  if (!qwen && !mixtral) {
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
  }
  if (mixtral) {
    j["num_local_experts"] = c.num_local_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    j["sliding_window"] = nullptr;
  }
  if (c.rope_scaling.type == "llama3")
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_positions}};
  return j;
}

}  // namespace scaletrain::models

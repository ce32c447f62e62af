#pragma once
// Hugging Face config.json files as ModelConfigs and back, for every family
// this build has: model.config (a published architecture, trained from
// scratch), the config.json of a Hub directory given to model.init_from, what
// a checkpoint records of its model, and what `checkpoint export` writes.
#include <string>

#include <nlohmann/json.hpp>

#include "scaletrain/models/causal_lm.h"

namespace scaletrain::models {

// By model_type: gpt2 (GPT2LMHeadModel), llama, mistral, qwen2. An unknown
// model_type, a missing dimension, or a setting this build's model would not
// honour (another activation, norm epsilon of GPT-2, a sliding window that is
// on, ...) is a UsageError naming `source` and the key. Dropout
// probabilities are not read: dropout is a training choice (model.dropout).
ModelConfig config_from_hf(const nlohmann::json& config, const std::string& source);

// A config.json, or the one in a directory. UsageError if unreadable or not JSON.
ModelConfig read_hf_config(const std::string& path);

// The config.json transformers writes for a model of `c` (GPT2LMHeadModel,
// LlamaForCausalLM, Qwen2ForCausalLM), by c.family. "torch_dtype" is
// float32; callers that write another dtype overwrite it.
nlohmann::json config_to_hf(const ModelConfig& c);

// The family of a checkpoint whose index records `recorded`: itself, or
// gpt2 for an index from before families were recorded (when GPT-2 was the
// only one).
std::string recorded_family(const std::string& recorded);

// The gpt2 parts of the two (models/gpt.cpp).
ModelConfig gpt2_config_from_hf(const nlohmann::json& config, const std::string& source);
nlohmann::json gpt2_config_to_hf(const ModelConfig& c);

}  // namespace scaletrain::models

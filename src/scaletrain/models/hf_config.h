#pragma once
// Hugging Face config.json files as ModelConfigs, for every family this build
// has: model.config (a published architecture, trained from scratch) and the
// config.json of a Hub directory given to model.init_from.
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

// The gpt2 part of config_from_hf (models/gpt.cpp).
ModelConfig gpt2_config_from_hf(const nlohmann::json& config, const std::string& source);

}  // namespace scaletrain::models

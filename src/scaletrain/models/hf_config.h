#pragma once
// A model's Hugging Face config.json, for every family of this build, and
// back: what a checkpoint records of the model it holds (so it can be
// exported without the run's config) and what `checkpoint export` writes.
#include <nlohmann/json.hpp>

#include <string>

#include "scaletrain/models/causal_lm.h"

namespace scaletrain::models {

// The config.json transformers writes for a model of `c`: GPT2LMHeadModel
// for gpt2, LlamaForCausalLM / Qwen2ForCausalLM for the llama family
// (llama_config_to_hf). "torch_dtype" is float32; callers that write
// another dtype overwrite it.
nlohmann::json model_config_to_hf(const ModelConfig& c);

// The ModelConfig of such a config.json, dispatched on model_type (gpt2,
// llama, mistral, qwen2); validated. Throws UsageError "SOURCE: PROBLEM".
ModelConfig model_config_from_hf(const nlohmann::json& j, const std::string& source);

}  // namespace scaletrain::models

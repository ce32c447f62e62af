#pragma once
// What the memory estimator needs to know about the model families: the
// structure of each family's blocks (estimate::ModelSpec's flags), the
// published shapes of well-known checkpoints, and how to read a Hugging Face
// config.json. The estimator itself (estimate/) counts from a ModelSpec and
// never names a family.
//
// Torch-free: built into the core library with the estimator, so that
// `scaletrain estimate-memory` works without libtorch.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "scaletrain/estimate/model_spec.h"

namespace scaletrain::models {

struct ModelConfig;

// The structure of a family's Hugging Face class ("gpt2", "llama", "mistral",
// "qwen2", "bert"), shapes left at zero. UsageError naming the known families
// otherwise.
estimate::ModelSpec estimator_structure(const std::string& family);

// The spec of a model this build trains (models/registry.cpp).
estimate::ModelSpec estimator_spec(const ModelConfig& config);

// Published checkpoints by name ("gpt2", "llama-2-7b", ...): canonical
// lower-case names.
std::vector<std::string> estimator_preset_names();

// A preset by name. Case-insensitive; a hub id ("meta-llama/Llama-2-7b-hf") is
// reduced to its last path part without "-hf". UsageError listing the known
// presets when the name is unknown.
estimate::ModelSpec estimator_preset(const std::string& name);

// A spec from a parsed Hugging Face config.json. UsageError naming the known
// architectures when model_type is unknown, or when a field is missing.
estimate::ModelSpec estimator_spec_from_hf(const nlohmann::json& config, const std::string& name);

// Reads a config.json (or the one in a directory). UsageError if unreadable
// or malformed.
estimate::ModelSpec load_estimator_config(const std::string& path);

// The MODEL argument of `estimate-memory`: a preset, a path to a config.json
// (or a directory holding one), or a raw count ("7.5B"). UsageError otherwise.
estimate::ModelSpec resolve_estimator_model(const std::string& model);

}  // namespace scaletrain::models

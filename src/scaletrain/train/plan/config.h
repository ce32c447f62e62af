#pragma once
// The run's configuration as train/ reads it: config/'s torch-free readers
// with the model's width known (train/plan/model_config.h resolves it from the
// model.* keys, a preset, model.config or model.init_from), so DeepSpeed's
// "auto" bucket sizes resolve. The config types are config/'s
// (config::Config and its sections).
#include <string>
#include <vector>

#include "scaletrain/config/config.h"
#include "scaletrain/config/data_parallelism.h"
#include "scaletrain/config/deepspeed_config.h"

namespace scaletrain::train {

// The width of the model `m` describes (resolve_model_config(m).n_embd).
int64_t model_width(const config::ModelOptions& m);

// config::load_config with model_width.
config::Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// config::apply_deepspeed_config with model_width.
void apply_deepspeed_config(config::Config& config, const std::string& path, int data_parallel_size);

}  // namespace scaletrain::train

#pragma once
// The run's configuration as train/ reads it: config/'s torch-free readers
// with the model's width known (train/model_config.h resolves it from the
// model.* keys, a preset, model.config or model.init_from), so DeepSpeed's
// "auto" bucket sizes resolve. The config types are config/'s, named here
// too so that train/ and its users write train::Config as before.
#include <string>
#include <vector>

#include "scaletrain/config/config.h"
#include "scaletrain/config/data_parallelism.h"
#include "scaletrain/config/deepspeed_config.h"

namespace scaletrain::train {

using config::apply_override;
using config::CheckpointingOptions;
using config::Config;
using config::config_key_table;
using config::config_keys;
using config::config_value;
using config::ConfigKeyInfo;
using config::data_parallelism;
using config::DataOptions;
using config::DataParallelism;
using config::deepspeed_data_parallel_size;
using config::FinetuneOptions;
using config::FsdpOptions;
using config::MetricsOptions;
using config::ModelOptions;
using config::ParallelOptions;
using config::PrecisionOptions;
using config::runs_ddp;
using config::shards_params;
using config::to_string;
using config::TrainOptions;
using config::uses_fsdp_keys;
using config::validate_config;
using config::zero_stage;
using config::ZeroOptions;

// The width of the model `m` describes (resolve_model_config(m).n_embd).
int64_t model_width(const ModelOptions& m);

// config::load_config with model_width.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// config::apply_deepspeed_config with model_width.
void apply_deepspeed_config(Config& config, const std::string& path, int data_parallel_size);

}  // namespace scaletrain::train

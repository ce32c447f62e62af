#pragma once
// DeepSpeed compatibility: `scaletrain train CONFIG.yaml --deepspeed ds.json`
// reads a DeepSpeed JSON config and maps it onto the typed Config. Every key
// is honoured (mapped onto a Config field), accepted with a start-up notice
// saying it has no effect on this build (Config::notices), or an error; see
// deepspeed_config.cpp, Note [DeepSpeed mapping] for the rules ("auto", absent
// keys, batch-size resolution, element counts to MiB).
#include <nlohmann/json.hpp>

#include <string>

#include "scaletrain/config/config.h"

namespace scaletrain::config {

// Applies the DeepSpeed config at `path` to `config` (already loaded from YAML
// and overrides) for a run whose data-parallel degree is `data_parallel_size`,
// then validates the result. Malformed JSON, unknown keys, ill-typed values,
// inconsistent batch sizes and unsupported settings throw UsageError, one line
// naming the file and the key.
// Unknown keys are all named in one error. `model_width` sizes the "auto"
// buckets (Note [DeepSpeed mapping]); without it they are a UsageError.
void apply_deepspeed_config(Config& config, const std::string& path, int data_parallel_size,
                            const ModelWidth& model_width);

// The same for a parsed config; `origin` names it in messages and notices
// (Accelerate's deepspeed_config section is translated into one of these).
void apply_deepspeed_json(Config& config, const nlohmann::json& root, const std::string& origin, int data_parallel_size,
                          const ModelWidth& model_width);

// The data-parallel degree of this run: WORLD_SIZE from the environment over
// parallel.tp x parallel.pp (at least 1).
int deepspeed_data_parallel_size(const Config& config);

}  // namespace scaletrain::config

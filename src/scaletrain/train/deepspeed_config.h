#pragma once
// DeepSpeed compatibility: `scaletrain train CONFIG.yaml --deepspeed ds.json`
// reads a DeepSpeed JSON config and maps it onto the typed Config. Every key
// is either honoured (mapped onto a Config field) or an error naming it; see
// deepspeed_config.cpp, Note [DeepSpeed mapping] for the rules ("auto", absent
// keys, batch-size resolution, element counts to MiB).
#include <string>

#include "scaletrain/train/config.h"

namespace scaletrain::train {

// Applies the DeepSpeed config at `path` to `config` (already loaded from YAML
// and overrides) for a run whose data-parallel degree is `data_parallel_size`,
// then validates the result. Malformed JSON, unknown keys, ill-typed values,
// inconsistent batch sizes and unsupported settings throw UsageError, one line
// naming the file and the key.
void apply_deepspeed_config(Config& config, const std::string& path, int data_parallel_size);

}  // namespace scaletrain::train

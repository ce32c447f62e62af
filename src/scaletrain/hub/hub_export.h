#pragma once
// `scaletrain checkpoint export`: a training checkpoint of any layout as a
// Hugging Face Hub directory, the inverse of model.init_from
// (hub/hub_load.h, hub/hf_gpt2.h).
//
// Note [Hub export]
// The model is the one the index records (ModelShape::hf_config, written by
// the trainer; GPT-2 indexes from before it still export from their
// dimensions), built without bytes (models::make_model(config, false)) only
// to list its parameters, names and shapes: each is then read whole from the
// checkpoint's pieces (checkpoint::read_tensors, checksums verified), renamed
// and reshaped as the family's Hub files have it (llama family: our names are
// Hugging Face's; gpt2: hub/hf_gpt2.h's "transformer." prefix and
// Conv1D transposes), converted to the asked dtype and streamed into the
// shards, one tensor in memory at a time. Beside them: config.json
// (models::config_to_hf, torch_dtype the written dtype) and the
// tokenizer files the checkpoint keeps (Note [Checkpoint assets]).
// Everything is written into a temporary directory beside OUT_DIR and renamed
// onto it at the end, so a failure leaves nothing at OUT_DIR.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/hub/hub_write.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/models/causal_lm.h"

namespace scaletrain::hub {

struct HubExportOptions {
  // Largest tensor bytes per shard (Note [Hub shards] in checkpoint/hub_write.h).
  int64_t max_shard_bytes = hub::kDefaultMaxShardBytes;
  // "" = the dtype the checkpoint stores its parameters in; "fp32", "bf16", "fp16".
  std::string dtype;
};

struct HubExportResult {
  std::vector<std::string> files;  // written into OUT_DIR, weights first
  int64_t tensors = 0;             // tensors in the weights
  int64_t total_bytes = 0;         // their bytes
  std::string dtype;               // safetensors name of the written dtype
};

// The model the index of checkpoint `dir` records: its Hugging Face config,
// or for a GPT-2 index from before that was recorded, its dimensions.
// UsageError for another family's index without a config.
models::ModelConfig recorded_model(const checkpoint::Index& x, const std::string& dir);

// Exports the step directory `step_dir` to `out_dir`, which must not exist or
// be an empty directory (Note [Hub export]). Throws UsageError (one line) for
// a directory that is not a checkpoint, a corrupt file, a model this build
// cannot name in Hub terms, an existing non-empty out_dir, or a bad dtype;
// nothing is left at out_dir then.
HubExportResult export_hub(const std::string& step_dir, const std::string& out_dir, const HubExportOptions& options);

// Writes a directory whole or not at all: `fill` writes into a fresh
// temporary directory beside `out_dir`, which is then renamed onto it.
// `out_dir` must not exist or be an empty directory (UsageError otherwise,
// prefixed by `what`); when `fill` throws, nothing is left at out_dir.
void write_directory(const std::string& out_dir, const std::string& what,
                     const std::function<void(const std::string& tmp)>& fill);

}  // namespace scaletrain::hub

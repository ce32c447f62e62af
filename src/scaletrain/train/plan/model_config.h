#pragma once
// The model a run trains: model.* keys over a preset, or the dimensions of
// the model.init_from file.
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/train/plan/config.h"

namespace scaletrain::train {

// Without model.init_from: the preset with the non-zero model.* keys over it.
// With it: the file's dimensions (hub::hf_gpt2_file_config: the
// weights' shapes and the config.json beside them). Explicit model.n_layer,
// n_embd, vocab_size and n_head that disagree with the file are a one-line
// UsageError; model.block_size may be shorter than the file's position table
// (its first rows are used), not longer. Without config.json, n_head comes
// from model.n_head, else from the preset when the preset's width matches
// the file's.
models::ModelConfig resolve_model_config(const config::ModelOptions& m);

}  // namespace scaletrain::train

#pragma once
// model.init_from for families whose parameter names are Hugging Face's
// (the llama family): a Hub directory (or one safetensors file) into a
// model, whole or one tensor at a time. GPT-2 files keep their own mapping
// (hub/hf_gpt2.h: Conv1D transposes, prefixes, mask buffers).
#include <functional>
#include <memory>
#include <string>

#include "scaletrain/hub/hub_read.h"
#include "scaletrain/models/causal_lm.h"

namespace scaletrain::hub {

// Checks the file against the model before anything is written: every
// parameter present with its shape, nothing else but entries that are not
// parameters (rotary_emb.inv_freq). Throws UsageError naming the tensor.
void check_hub_weights(const models::CausalLM& model, const hub::HubWeights& hub);

// Loads every parameter, converted to its dtype, in place.
void load_hub_weights(models::CausalLM& model, const std::string& path);

// The same as an initialization function for deferred models: checked now,
// each parameter read from the mapped files when the strategy asks for it.
interfaces::InitFn hub_init(const models::CausalLM& model, const std::string& path);

// The same for a sharded strategy that asks each rank for its part of each
// parameter only (parallel/fsdp: ShardedOptions::deferred_slice_init):
// elements [begin, begin + count) of the flattened tensor, read straight from
// the mapped file, so no rank touches more of the files than it keeps.
using SliceInitFn = std::function<void(const std::string& name, int64_t begin, int64_t count, at::Tensor& out)>;
SliceInitFn hub_slice_init(const models::CausalLM& model, const std::string& path);

}  // namespace scaletrain::hub

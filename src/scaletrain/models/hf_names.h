#pragma once
// Hugging Face class names of the model families this build has, so that
// configuration files written for transformers models (Accelerate's
// fsdp_transformer_layer_cls_to_wrap: GPT2Block) name our classes. The
// engines (parallel/) only ever see our names.
#include <string>

namespace scaletrain::models {

// Our block class for a Hugging Face (or our own) layer class name:
// "GPT2Block" -> "Block", "Block" -> "Block". A comma-separated list (as
// Accelerate writes several classes) maps when every name maps to the same
// class. Throws UsageError naming `key` and the class when a name belongs to
// no family of this build, or the list names two different classes.
std::string block_class_from_hf(const std::string& key, const std::string& names);

}  // namespace scaletrain::models

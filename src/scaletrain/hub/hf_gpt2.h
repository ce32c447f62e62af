#pragma once
// Hugging Face GPT-2 checkpoints (model.safetensors) <-> models::GPT.
//
// Note [HF GPT-2 names]
// Our parameter names are HF's without the "transformer." prefix (see
// models/gpt.h). HF files come in two spellings:
//   - the published hub file (openai-community/gpt2 model.safetensors): bare
//     names ("wte.weight", "h.0.attn.c_attn.weight"), plus the causal-mask
//     buffers "h.N.attn.bias" and sometimes "h.N.attn.masked_bias";
//   - GPT2LMHeadModel.save_pretrained(): "transformer."-prefixed names, and
//     "lm_head.weight" when the tied head is not deduplicated.
// Both load. HF's Conv1D stores its weight as [in, out], the transpose of
// torch Linear's [out, in]: c_attn, c_proj (attention and MLP) and c_fc are
// transposed on the way in and out; embeddings and LayerNorms are not. The
// mask buffers are ignored (we rebuild the mask from block_size); a present
// lm_head.weight must equal wte.weight, because our head is tied.
//
// export_hf_gpt2() writes the prefixed spelling without lm_head.weight, in
// F32, with metadata {"format": "pt"}: GPT2LMHeadModel.from_pretrained()
// accepts exactly that (prefixed names match its state dict; the missing head
// is re-tied to wte, and the missing mask buffers are non-persistent or on its
// ignore list), and so does our import.
#include <cstdint>
#include <string>

#include "scaletrain/models/gpt.h"

namespace scaletrain::hub {

// The Hugging Face name of our GPT parameter `name` ("transformer." + name),
// and its value as that file stores it (Conv1D weights transposed: a view,
// not a copy). Both the one-file export below and `checkpoint export`'s Hub
// directories (checkpoint/hub_export.h) write through these.
std::string hf_gpt2_name(const std::string& name);
at::Tensor hf_gpt2_tensor(const std::string& name, const at::Tensor& value);

// Throws UsageError ("hf gpt2 PATH: ...") for a config HF GPT-2 cannot hold
// (bias=false).
void check_hf_gpt2_exportable(const models::ModelConfig& config, const std::string& path);

// Writes `model`'s parameters to `path` as an HF GPT2LMHeadModel safetensors
// file (Note [HF GPT-2 names]). Throws UsageError if the model has
// config().bias == false (HF GPT-2 has biases everywhere); SafetensorsError on
// write failure.
void export_hf_gpt2(const models::GPT& model, const std::string& path);

// `path` in the readers below: one safetensors file, or a Hub directory
// (model.safetensors, or shards with model.safetensors.index.json;
// checkpoint/hub.h).
//
// Loads an HF GPT-2 safetensors file into `model`, in place, on the model's
// device and dtype. A position table (wpe.weight) longer than the model's
// block_size is allowed: its first block_size rows are loaded. Every tensor is checked before any parameter is written:
// a missing, unexpected, duplicated, misshaped or non-floating tensor throws
// UsageError naming the tensor ("hf gpt2 PATH: ..."), and leaves the model
// untouched. Malformed files throw SafetensorsError.
void import_hf_gpt2(models::GPT& model, const std::string& path);

// The same file as an initialization function for deferred models (models/
// deferred.h): the file is checked against `model` now (by shapes), and each
// parameter is read from the memory-mapped file when the strategy asks for
// it, so a sharded strategy loads one tensor at a time and keeps its shard.
interfaces::InitFn hf_gpt2_init(const models::GPT& model, const std::string& path);

// The GPTConfig an HF GPT-2 file describes: vocab_size and n_embd from
// wte.weight, block_size from wpe.weight, n_layer from the h.N blocks present
// (they must be 0..L-1), bias from h.0.attn.c_attn.bias, dropout 0. The head
// count is not recorded in the weights, so it is a parameter (GPT-2 small: 12;
// 0 = unknown: the result is then not validated).
// Throws UsageError naming what is missing or inconsistent.
models::GPTConfig hf_gpt2_config(const std::string& path, int64_t n_head);

// hf_gpt2_config() completed by the Hugging Face config.json in the file's
// directory, when there is one: n_head from it (0 when there is no
// config.json), and its n_layer, n_embd, n_positions, vocab_size checked
// against the weights. Settings of config.json this model cannot honour
// (layer_norm_epsilon other than 1e-5, an activation other than GPT-2's tanh
// GELU, n_inner other than 4 x n_embd, a model_type other than gpt2) throw
// UsageError naming config.json and the key. Its dropout probabilities are
// not taken: dropout is a training choice (model.dropout).
models::GPTConfig hf_gpt2_file_config(const std::string& path);

}  // namespace scaletrain::hub

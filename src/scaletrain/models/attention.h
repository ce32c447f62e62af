#pragma once
// The attention both families run, and what a batch tells it about where its
// documents begin.
//
// Note [Attention paths]
// model.attention picks how softmax(q k^T / sqrt(d)) v is computed:
//   flash  kernels/attention.h: tiles of keys with an online softmax, so no
//          more than a tile of scores exists at a time (memory linear in T)
//          and masked tiles are skipped; the default on the CPU.
//   naive  the [T, T] scores materialized with ATen ops (matmul, masked_fill,
//          softmax, matmul); the only path that drops attention
//          probabilities (GPT-2's attention dropout), and the path CUDA
//          tensors take (the kernel is written for the CPU;
//          flash_runs_on() says which tensors it takes).
// Both give the same function: grouped-query heads (query head h reads kv
// head h / (H / Hkv)), causal, and within one document when the batch has a
// SequenceLayout.
//
// Note [Packed documents]
// With data.pack: documents a sample is a window over documents laid end to
// end, and the trainer hands the model each micro-batch's SequenceLayout
// before its forward (CausalLM::set_sequence_layout): a document id per
// token, so that attention never crosses a document boundary, and each
// token's position inside its document, which the rotary tables (llama) or
// the position embedding (gpt2) read instead of 0..T-1. The data side makes
// the token after a boundary no target (data/dataset.h), so each document
// trains as if it were alone in its window.
#include <torch/torch.h>

#include <memory>
#include <string>

namespace scaletrain::models {

// Where the documents of a micro-batch are (Note [Packed documents]).
struct SequenceLayout {
  torch::Tensor segments;   // [B, T] int64: document id of each token
  torch::Tensor positions;  // [B, T] int64: its position inside the document
};

// What a model's attention layers share with the model: the layout of the
// batch in flight, or null (one sequence per row, positions 0..T-1).
struct SequenceContext {
  std::shared_ptr<const SequenceLayout> layout;
};

enum class AttentionPath { Flash, Naive };

// "flash" or "naive"; UsageError naming anything else.
AttentionPath attention_path(const std::string& name);

// Whether the flash kernel takes these tensors (CPU tensors of a floating
// type); attend() runs the naive path for the others.
bool flash_runs_on(const torch::Tensor& q);

// q [B, H, T, D], k and v [B, Hkv, T, D] -> [B, H, T, D] in q's dtype: causal
// attention, within documents when `layout` is given (its rows narrowed to
// this T by the caller). `dropout` drops attention probabilities in training
// and needs the naive path (ModelConfig::validate refuses it with flash).
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, AttentionPath path,
                     const SequenceLayout* layout, double dropout = 0.0, bool training = false);

// The positions of a [B, T] batch: the layout's, or 0..T-1 for every row.
torch::Tensor batch_positions(const SequenceLayout* layout, int64_t B, int64_t T, const torch::Device& device);

}  // namespace scaletrain::models

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
//          tensors take with libtorch 1.x (the kernel is written for the
//          CPU; flash_runs_on() says which tensors it takes). With libtorch
//          2.x, flash on CUDA tensors is ATen's fused attention
//          (at::scaled_dot_product_attention: its flash or memory-efficient
//          kernels), with a boolean mask for packed documents.
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
//
// Note [Split attention]
// Under context parallelism (parallel/context) each rank holds a part of
// every sequence, and attention must see the keys of the whole. The layer
// above (train/) sets SequenceContext::split_attention to the distributed
// attention and a layout whose positions are the tokens' places in the
// whole sequence (`span` long); attend() then calls it instead of the local
// paths. The families stay unaware of ranks: they compute q, k and v of the
// tokens they were given, as always.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace scaletrain::models {

// Where the documents of a micro-batch are (Note [Packed documents]).
struct SequenceLayout {
  torch::Tensor segments;   // [B, T] int64: document id of each token; undefined: one document per row
  torch::Tensor positions;  // [B, T] int64: its position inside the document (or the whole sequence)
  int64_t span = 0;         // positions are < span; 0: < T (Note [Split attention])
};

// q [B, H, T, D], k and v [B, Hkv, T, D] of the tokens a rank holds, and
// their layout -> [B, H, T, D] (Note [Split attention]).
using SplitAttention = std::function<torch::Tensor(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v, const SequenceLayout* layout)>;

// What a model's attention layers share with the model: the layout of the
// batch in flight, or null (one sequence per row, positions 0..T-1), and the
// attention that replaces the local one when the sequence is split.
struct SequenceContext {
  std::shared_ptr<const SequenceLayout> layout;
  SplitAttention split_attention;
};

enum class AttentionPath { Flash, Naive };

// "flash" or "naive"; UsageError naming anything else.
AttentionPath attention_path(const std::string& name);

// Whether the flash kernel takes these tensors (CPU tensors of a floating
// type); attend() runs the naive path, or libtorch 2.x's fused attention, for
// the others.
bool flash_runs_on(const torch::Tensor& q);

// q [B, H, T, D], k and v [B, Hkv, T, D] -> [B, H, T, D] in q's dtype: causal
// attention, within documents when the context's layout has segments, over
// the whole sequence by the context's split attention when it has one.
// `dropout` drops attention probabilities in training and needs the naive
// path (ModelConfig::validate refuses it with flash). `context` may be null.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, AttentionPath path,
                     const SequenceContext* context, double dropout = 0.0, bool training = false);

// The positions of a [B, T] batch: the layout's, or 0..T-1 for every row.
torch::Tensor batch_positions(const SequenceLayout* layout, int64_t B, int64_t T, const torch::Device& device);

}  // namespace scaletrain::models

#pragma once
// One model chunk of a pipeline: a module that owns (shares, with the model
// it was cut from) a consecutive run of transformer blocks, plus the model's
// first pieces (embeddings) on the first chunk and its last pieces (final
// norm, an untied head) on the last. Its parameter names are the model's own
// ("h.5.attn.c_attn.weight", "model.layers.5.mlp.up_proj.weight"), so the
// optimizer, checkpoints and the parity tests see the single-process names.
//
// A chunk is Blockwise: the sharded engine (parallel/fsdp) wraps its blocks
// the same way it wraps a whole model, which is how ZeRO/FSDP runs inside a
// pipeline stage.
//
// Note [Tied head across stages]: a head tied to the token embedding is used
// by the first chunk (lookup) and the last (logits). When they are on
// different stages, the embedding stays a parameter of the first chunk only
// (one copy in the optimizer, in checkpoints and in the gradient norm). The
// last stage computes its logits with its own model's embedding tensor, which
// is not a chunk parameter: a copy that the first stage refreshes every step
// (it sends the weight when its first forward has it whole), and whose
// gradient the last stage averages over data parallelism and sends back to be
// added to the embedding's. A frozen tied head (adapters) needs neither: every
// stage built the same weights. An untied head is simply a last-chunk parameter.
// Megatron keeps two parameters and all-reduces their gradients across an
// embedding group instead; with one parameter nothing can drift apart.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/interfaces/stages.h"

namespace scaletrain::parallel::pipeline {

struct ChunkSpec {
  int index = 0;        // global chunk index in [0, chunks)
  int chunks = 1;       // p * v
  int64_t begin = 0;    // first block
  int64_t end = 0;      // one past the last block
  bool first() const { return index == 0; }
  bool last() const { return index == chunks - 1; }
};

class ChunkImpl : public torch::nn::Module, public interfaces::Blockwise {
 public:
  ChunkImpl(std::shared_ptr<interfaces::Staged> model, ChunkSpec spec);

  // First chunk: token ids [B, T] -> hidden [B, T, C]; others: hidden ->
  // hidden; the last chunk returns the mean cross-entropy against `targets`.
  at::Tensor forward(const at::Tensor& input, const at::Tensor& targets);

  const ChunkSpec& spec() const { return spec_; }
  const std::shared_ptr<interfaces::Staged>& model() const { return model_; }

  int64_t num_blocks() const override { return spec_.end - spec_.begin; }
  std::string block_prefix(int64_t i) const override { return model_->block_prefix(spec_.begin + i); }
  std::string block_class() const override { return model_->block_class(); }
  void set_block_runner(interfaces::BlockRunner runner) override { runner_ = std::move(runner); }

 private:
  std::shared_ptr<interfaces::Staged> model_;
  ChunkSpec spec_;
  interfaces::BlockRunner runner_;
};
TORCH_MODULE(Chunk);

// Cuts `costs` (one per block) into `parts` consecutive runs of at least one
// block, minimizing the largest run's cost; `first_extra` and `last_extra`
// are added to the first and the last run (embedding, head). Returns the
// [begin, end) of each run. Throws UsageError if there are fewer blocks than parts.
std::vector<std::pair<int64_t, int64_t>> balance_blocks(const std::vector<double>& costs, double first_extra,
                                                        double last_extra, int parts);

// Per-block costs by parameter count, with the embedding and head extras.
struct BlockCosts {
  std::vector<double> blocks;
  double first_extra = 0, last_extra = 0;
};
BlockCosts parameter_costs(interfaces::Staged& model);
// The same by measured time: forward + backward of one micro-batch of
// `batch` sequences through each block, the embedding and the head (median of
// `repeats`). Every rank must use the same costs: measure on one, broadcast.
BlockCosts measured_costs(interfaces::Staged& model, int64_t batch, int repeats = 3);

}  // namespace scaletrain::parallel::pipeline

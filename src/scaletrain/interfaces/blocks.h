#pragma once
// What a parallel engine needs to know about a module built of repeated
// blocks, and how it takes part in the module's forward. The engines
// (parallel/fsdp, parallel/pipeline) drive these; a model family implements
// them (models/causal_lm.h), and so can any user module. They live below
// both so that no engine includes a model family's header.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>

namespace scaletrain::interfaces {

// How a parallel strategy takes part in a model's forward: the model calls the
// runner for each transformer block instead of the block itself, and the
// runner calls `body` (the block's forward) between whatever it must do before
// and after (gather a sharded unit, register a pre-backward hook, recompute in
// backward). No runner: blocks run directly.
using BlockBody = std::function<torch::Tensor(const torch::Tensor&)>;
using BlockRunner = std::function<torch::Tensor(int64_t index, const BlockBody& body, const torch::Tensor& x)>;

// What a strategy needs to know about a module built of repeated blocks.
class Blockwise {
 public:
  virtual ~Blockwise() = default;
  virtual int64_t num_blocks() const = 0;
  // Parameter-name prefix of block i ("h.3."), as in named_parameters().
  virtual std::string block_prefix(int64_t i) const = 0;
  // Class name of the blocks, for transformer-based wrap policies.
  virtual std::string block_class() const = 0;
  virtual void set_block_runner(BlockRunner runner) = 0;
};

}  // namespace scaletrain::interfaces

#pragma once
// What a pipeline (parallel/pipeline's Pipeline) needs from a module it cuts
// into chunks of consecutive blocks: the pieces a stage runs separately, the
// modules each chunk takes over, and the shape of what flows between blocks.
// Our families implement it (models/causal_lm.h); a user module can too, or
// hand ModulePipeline (parallel/pipeline/module_pipeline.h) its stages
// directly. It lives below both parallel/ and models/ so that the engine does
// not include a family's header.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/interfaces/blocks.h"

namespace scaletrain::interfaces {

// A module a pipeline chunk takes over, under its dotted path in the model
// ("model.embed_tokens"), so the chunk's parameter names are the model's.
using NamedModule = std::pair<std::string, std::shared_ptr<torch::nn::Module>>;

// Between blocks flow hidden states [batch, seq, width]; the first piece
// reads token ids in [0, vocab) of at most max_sequence positions.
struct StageShape {
  int64_t width = 0;
  int64_t max_sequence = 0;
  int64_t vocab = 0;
};

class Staged : public Blockwise {
 public:
  // The whole module (its parameters).
  virtual torch::nn::Module& staged_module() = 0;
  virtual StageShape stage_shape() const = 0;
  // Token ids [B, T] -> hidden [B, T, C] (the first chunk's piece).
  virtual torch::Tensor embed(const torch::Tensor& idx) = 0;
  // Block i, hidden -> hidden; block_body(i) is the same as a body for a
  // BlockRunner (checkpointed when the module says so).
  virtual torch::Tensor run_block(int64_t i, const torch::Tensor& x) = 0;
  virtual BlockBody block_body(int64_t i) = 0;
  // Last hidden states and targets -> the mean loss (the last chunk's piece).
  virtual torch::Tensor head_loss(const torch::Tensor& x, const torch::Tensor& targets) = 0;
  // The modules the first chunk owns besides its blocks (embeddings), those
  // the last owns (final norm, an untied head), and block i's module.
  virtual std::vector<NamedModule> first_pieces() = 0;
  virtual std::vector<NamedModule> last_pieces() = 0;
  virtual NamedModule block_module(int64_t i) = 0;
  // A head tied to the token embedding: its parameter name and tensor (the
  // first chunk and the last use it, Note [Tied head across stages] in
  // parallel/pipeline/stage.h); an undefined tensor when the head is its own
  // parameter.
  virtual std::pair<std::string, at::Tensor> tied_head() = 0;
};

}  // namespace scaletrain::interfaces

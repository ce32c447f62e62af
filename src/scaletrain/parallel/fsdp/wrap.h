#pragma once
// Wrap policies: which parameters form each sharded unit.
//
// A unit is the granularity of gathering and freeing: its parameters are
// all-gathered together before it runs and released together after. Units are
// made of whole blocks of a Blockwise model (the points where the model lets a
// strategy step in); everything no unit takes (embeddings, final norm, blocks
// a size policy left over) belongs to the root unit, which is gathered for the
// whole forward and backward.
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/interfaces/blocks.h"

namespace scaletrain::parallel::fsdp {

enum class WrapPolicy {
  Transformer,  // each block of class layer_cls is a unit
  Size,         // consecutive blocks form a unit once it holds min_num_params
  None,         // one root unit holds everything
  // Gradient buckets (ZeRO-1/2): every block in a unit, units formed in
  // backward order as DDP forms its buckets (Note [Backward buckets]).
  Buckets,
};

struct WrapOptions {
  WrapPolicy policy = WrapPolicy::Transformer;
  // Transformer policy: the block class to wrap (the model's block_class()).
  std::string layer_cls;  // "": the model's own block class (Blockwise::block_class)
  // Size policy: a unit closes as soon as it holds at least this many
  // parameters; blocks left over at the end stay in the root unit.
  // Buckets policy: the cap of a unit (it closes once it holds this many).
  int64_t min_num_params = 100000000;
  // Buckets policy: cap of the first unit in backward order (the last
  // blocks), small so the first reduce starts early in backward.
  int64_t first_bucket_numel = 1 << 18;
  // Buckets policy: cap of the last unit in backward order (the first
  // blocks, ready when backward ends); walking back from it each unit may be
  // tail_growth times the one after it, up to min_num_params. 0: no taper.
  int64_t last_bucket_numel = 1 << 18;
  double tail_growth = 1.5;
};

// A unit of consecutive blocks [first_block, last_block].
struct UnitPlan {
  std::string name;  // "h.0-h.1" style, for logs
  int64_t first_block = 0;
  int64_t last_block = 0;
};

// Note [Backward buckets]: ZeRO-1/2 keep parameters whole, so a unit is only
// the granularity of the gradient reduce (and of the deferred parameter
// gather, Note [Deferred gather] in fsdp.h). A unit's reduce can start once
// its last gradient is ready, so units are cut in the order backward makes
// gradients, from the last block to the first, the way DDP cuts its buckets
// (Note [Bucket tail] in parallel/ddp/ddp.h): a small first unit so the
// link is busy early, then units up to the cap, and a tapered tail (caps of
// last_bucket_numel, times tail_growth, ...) so what is left to send when
// backward ends is small. Unlike the size policy no block is left in the
// root, whose gradients (the embeddings) are the last of all.
//
// Plans units over `model`'s blocks; `block_numel[i]` is block i's parameter
// count. Throws std::invalid_argument for a layer_cls the model does not have.
std::vector<UnitPlan> plan_units(const interfaces::Blockwise& model, const std::vector<int64_t>& block_numel,
                                 const WrapOptions& options);

WrapPolicy parse_wrap_policy(const std::string& s);  // transformer | size | none

}  // namespace scaletrain::parallel::fsdp

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

#include "scaletrain/models/gpt.h"

namespace scaletrain::parallel::fsdp {

enum class WrapPolicy {
  Transformer,  // each block of class layer_cls is a unit
  Size,         // consecutive blocks form a unit once it holds min_num_params
  None,         // one root unit holds everything
};

struct WrapOptions {
  WrapPolicy policy = WrapPolicy::Transformer;
  // Transformer policy: the block class to wrap (the model's block_class()).
  std::string layer_cls = "Block";
  // Size policy: a unit closes as soon as it holds at least this many
  // parameters; blocks left over at the end stay in the root unit.
  int64_t min_num_params = 100000000;
};

// A unit of consecutive blocks [first_block, last_block].
struct UnitPlan {
  std::string name;  // "h.0-h.1" style, for logs
  int64_t first_block = 0;
  int64_t last_block = 0;
};

// Plans units over `model`'s blocks; `block_numel[i]` is block i's parameter
// count. Throws std::invalid_argument for a layer_cls the model does not have.
std::vector<UnitPlan> plan_units(const models::Blockwise& model, const std::vector<int64_t>& block_numel,
                                 const WrapOptions& options);

WrapPolicy parse_wrap_policy(const std::string& s);  // transformer | size | none

}  // namespace scaletrain::parallel::fsdp

#pragma once
// Activation checkpointing chosen by configuration for any module.
//
// Note [Checkpointing a user's module]: a C++ module has no forward hooks,
// so nothing outside it can make one of its submodules recompute. The
// module marks the points where it may: its forward calls
//   x = train::checkpointed(*block, [&](const at::Tensor& h) { return block->forward(h); }, x);
// which is block->forward(x) unless a policy selected `block`; then only x
// is kept for backward and the body runs again there (models/checkpoint.h).
// apply_activation_checkpointing(module, policy) selects the submodules, by
// class, by name or by size as fully_shard chooses units (module_units.h),
// and every k-th of those; the trainer applies the policy of its options
// (ModuleTrainerOptions::activation_checkpointing, YAML
// model.activation_checkpointing: full). The parameters of a recomputed
// block reach their gradients through the checkpoint's own backward node,
// so DDP's and the sharded engine's gradient hooks fire as without it.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/models/checkpoint.h"
#include "scaletrain/parallel/fsdp/module_units.h"

namespace scaletrain::train {

struct CheckpointPolicy {
  // The submodules that may recompute: by class name, dotted name, or size
  // (fully_shard's unit policies). Empty: every submodule that calls
  // checkpointed().
  parallel::fsdp::ModuleUnits blocks;
  // Of the selected submodules, in registration order, the 1st, (1+k)-th,
  // ... recompute (1: all). Needs `blocks` when above 1.
  int64_t every = 1;
  models::CheckpointOptions options;  // preserve_rng: dropout draws the same masks again
};

// Selects the submodules of `module` that recompute (replacing an earlier
// selection of the same submodules); returns their dotted names ("" for the
// module itself when blocks is empty: all of it). Throws
// std::invalid_argument naming the problem (a name or class no submodule
// has, every < 1, every > 1 without blocks).
std::vector<std::string> apply_activation_checkpointing(torch::nn::Module& module, const CheckpointPolicy& policy);

// body(x) for `block`; recomputed in backward when a policy selected it.
at::Tensor checkpointed(torch::nn::Module& block, const std::function<at::Tensor(const at::Tensor&)>& body,
                        const at::Tensor& x);

// Whether a policy selected `block` (for a module that reports it).
bool is_checkpointed(const torch::nn::Module& block);

// How many times selected submodules of `module` (or itself) were
// recomputed through checkpointed(): 0 after a forward means the policy
// changed nothing (the module never calls checkpointed() on them).
int64_t checkpointed_uses(const torch::nn::Module& module);

}  // namespace scaletrain::train

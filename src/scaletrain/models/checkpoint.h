#pragma once
// Activation checkpointing: run a block without keeping what autograd would
// save inside it, and recompute that in backward.
//
// libtorch's C++ frontend has no torch.utils.checkpoint, so this is a custom
// autograd Function (Note [Checkpoint function] in checkpoint.cpp). Forward
// runs the block body with gradients off and saves only the block's input;
// backward runs the body again with gradients on, from that input, and
// differentiates the recomputed output with respect to the input and the
// block's parameters. The parameters are inputs of the Function, so their
// gradients leave its backward node through the outer graph to the
// parameters' own AccumulateGrad nodes: the post-accumulation hooks that DDP
// and the sharded engines count gradients with fire exactly as without
// checkpointing, in the same backward pass.
//
// It composes with a BlockRunner (interfaces/blocks.h): the model hands the runner a
// body that checkpoints, and the runner does what it does around any body
// (gather a sharded unit before it, hook its output so the unit is gathered
// again before its backward, which is before the recomputation).
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace scaletrain::models {

// What the model keeps of its blocks' activations for backward.
enum class ActivationCheckpointing {
  None,  // everything autograd saves (fastest, most memory)
  Full,  // only each block's input; the block is recomputed in backward
};

// "none" | "full"; throws UsageError naming the choices otherwise.
ActivationCheckpointing parse_activation_checkpointing(const std::string& s);
std::string to_string(ActivationCheckpointing c);

struct CheckpointOptions {
  // Restore the random generator of the input's device to its state at the
  // forward before recomputing, so dropout draws the same masks (needed when
  // the body has dropout; costs one generator-state copy per block).
  bool preserve_rng = true;
};

// body(x), keeping only x for backward. `params` are the tensors body reads
// whose gradients are wanted (the block's parameters); they are read again in
// backward, so whatever makes them valid in forward (a sharded unit being
// gathered) must hold again when this output's gradient arrives. Without
// gradient mode, or when neither x nor a parameter requires grad, this is
// plain body(x).
torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& body, const torch::Tensor& x,
                         const std::vector<torch::Tensor>& params, const CheckpointOptions& options = {});

// True while this thread recomputes a checkpointed block in backward: what a
// body records on the side (MoE routing statistics) was recorded in forward.
bool recomputing();

}  // namespace scaletrain::models

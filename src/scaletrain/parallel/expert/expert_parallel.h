#pragma once
// Expert parallelism: the experts of each MoE layer split over the ranks of
// an ep group (comm::Mesh, Note [Expert groups]), tokens moved to their
// experts' ranks and back.
//
// Note [Expert parallelism]: rank r of an ep group of P ranks holds experts
// [r * E/P, (r + 1) * E/P) of every MoE layer (models::CausalLM::keep_experts
// removes the others, so each rank builds and stores only its own). A layer
// routes its tokens as one process would (models/moe.h: routing depends only
// on the token's sequence), sorts the kept slots by expert, and hands them to
// the hooks, which
//   1. exchange the slot counts per expert (an all_to_all of E integers),
//   2. send each rank the rows for its experts and receive the rows every
//      rank has for this rank's experts (all_to_all_v, uneven splits),
//   3. run each local expert on its rows (gathered from every source rank),
//      every expert even on no rows, so every parameter gets a gradient,
//   4. send the outputs back the way the rows came (the same splits, swapped).
// Steps 2 and 4 are autograd functions whose backward is the opposite
// exchange, so the backward moves the gradients of the rows the same way.
// Gradients of expert parameters are averaged over the expert-data-parallel
// group (the ranks holding the same experts), every other gradient over the
// whole data-parallel group (the data-parallel engines' `expert` options).
#include <torch/torch.h>

#include "scaletrain/comm/group.h"
#include "scaletrain/interfaces/experts.h"

namespace scaletrain::parallel::expert {

// Hooks for a model whose MoE layers have `num_experts` experts each, split
// over `ep` (which must divide it).
interfaces::ExpertParallelHooksPtr expert_parallel_hooks(comm::Group& ep, int64_t num_experts);

// The all_to_all_v above as an autograd function: rows of `x` split by
// in_rows go out, rows split by out_rows come back; backward sends the
// gradient the opposite way.
torch::Tensor all_to_all_rows(comm::Group& group, const torch::Tensor& x, const std::vector<int64_t>& in_rows,
                              const std::vector<int64_t>& out_rows);

}  // namespace scaletrain::parallel::expert

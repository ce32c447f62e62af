#pragma once
// What the expert-parallel engine (parallel/expert) hands a mixture-of-experts
// layer: which experts this rank holds, and how tokens travel to the ranks
// that hold theirs. The layer (models/moe.h) calls it; neither includes the
// other.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace scaletrain::interfaces {

// Expert parallelism (filled in by a strategy; null: every expert is here).
// `run` receives, for each local expert, the tokens routed to every expert
// [M, C] sorted by expert with `counts` [E] per expert, and returns the
// experts' outputs in the same order: the strategy moves the tokens to the
// ranks that own their experts and back.
struct ExpertParallelHooks {
  int64_t first_expert = 0;  // this rank holds experts [first, first + local)
  int64_t local_experts = 0;
  std::function<torch::Tensor(const torch::Tensor& sorted, const std::vector<int64_t>& counts,
                              const std::function<torch::Tensor(int64_t expert, const torch::Tensor& x)>& expert)>
      run;
};
using ExpertParallelHooksPtr = std::shared_ptr<const ExpertParallelHooks>;

}  // namespace scaletrain::interfaces

#pragma once
// The memory estimator's layout of a training run (estimate/memory_model.h),
// read from its config and plan, for the predicted-against-measured lines of
// observe/memory.h.
#include <cstdint>

#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/plan.h"

namespace scaletrain::train {

// Strategy, precision, world and degrees, micro-batch, sequence length,
// recomputation, dropout, buckets, prefetch, pipeline stages and schedule
// (the prediction is then the worst stage's), and the finetune section's
// adapters (their parameters per block counted on a model built without
// bytes) and NF4 base.
// `dp_shard` is the size of the sharding group (HYBRID_SHARD's per-node size);
// `microbatches` per step and rank (accumulation, or a pipeline's);
// `gloo`: the collectives run on Gloo.
estimate::Layout run_layout(const config::Config& config, const Plan& plan, int world_size, int dp_shard, int64_t microbatches,
                            bool gloo);

}  // namespace scaletrain::train

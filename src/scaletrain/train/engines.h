#pragma once
// The data-parallel engines the parallelize recipe (train/recipe.cpp) puts
// behind train::DataParallel: DDP, the sharded engine with the groups a
// plan's mesh gives it, and pipelines of chunks under either.
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/data_parallel.h"

namespace scaletrain::train {

using TensorPlan = std::optional<parallel::tensor::TensorParallelPlan>;

// DDP over `group`. `plan`: the model is tensor-parallel (clipping counts
// split and replicated parameters over tp; see parallel/tensor).
// `experts`: the mesh with expert parallelism added (Note [Expert
// parallelism]): expert gradients are averaged over its expert-data groups.
std::unique_ptr<DataParallel> ddp_strategy(models::ModelPtr model, comm::Group& group, parallel::DDPOptions o,
                                           TensorPlan plan, comm::Mesh* experts);

// The sharded engine over `shard` (and HYBRID_SHARD's `replicate`). `plan`:
// the model is tensor-parallel; the engine shards each rank's part (Note
// [Sharding tensor-parallel parameters] in parallel/fsdp). `no_sync`:
// micro-batches before the last accumulate whole gradients locally.
std::unique_ptr<DataParallel> sharded_strategy(models::ModelPtr model, comm::World& world, comm::Group& shard,
                                               comm::Group* replicate, const parallel::fsdp::ShardedOptions& o,
                                               bool no_sync, std::string label, TensorPlan plan);

// The plan's sharded-engine options with the groups of `mesh` filled in.
struct ShardedSetup {
  parallel::fsdp::ShardedOptions options;
  comm::Group* shard = nullptr;      // the group parameters are sharded over
  comm::Group* replicate = nullptr;  // HYBRID_SHARD's replicas, else null
  bool deferred = false;             // build the model without bytes (zero3, cpu_ram_efficient_loading)
  bool no_sync = true;               // accumulate whole gradients until the last micro-batch
  std::string label;                 // for describe()
};
ShardedSetup sharded_setup(const Plan& plan, comm::Mesh& mesh);

// With FP8 weight gathers (precision.fp8_opt_level=O3), selects the weights
// of `module`'s FP8 linears (models::fp8_weight_names) as the ones to gather in FP8.
void select_fp8_weights(parallel::fsdp::ShardedOptions& o, torch::nn::Module& module);

// parallel.pp > 1: the model (split by `plan` when tensor-parallel) cut
// into stages, each chunk under DDP or the sharded engine
// (train/pipeline_strategy.cpp).
std::unique_ptr<DataParallel> pipeline_strategy(models::ModelPtr model, comm::World& world, comm::Mesh& mesh,
                                                const Plan& run, TensorPlan plan);

}  // namespace scaletrain::train

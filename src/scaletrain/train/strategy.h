#pragma once
// parallelize(), the recipe that builds a run's model and its data-parallel
// strategy (train/data_parallel.h) from a plan.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/data_parallel.h"
#include "scaletrain/train/plan.h"
#include "scaletrain/train/starting_model.h"

namespace scaletrain::train {

// Builds the model (deferred when the strategy initializes it shard by
// shard; whole and loaded first with model.init_from) and the strategy the
// plan resolved (its EnginePlan: train/engine_plan.h). Throws UsageError,
// one line, for combinations this build cannot run.
struct Parallelized {
  models::ModelPtr model;
  std::unique_ptr<DataParallel> dp;
};
Parallelized parallelize(const Plan& plan, comm::World& world, comm::Mesh& mesh);

}  // namespace scaletrain::train

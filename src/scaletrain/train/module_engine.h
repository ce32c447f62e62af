#pragma once
// What the recipe built over a user's module (ParallelModule: DDP or a
// sharded strategy, over tensor parallelism or under a pipeline), behind the
// DataParallel interface our families' strategies implement, so
// ModuleTrainer runs the same step (train/loop.h) as the CLI's loop.
// module_engine.cpp has the engines of a whole module,
// module_engine_pipeline.cpp the pipeline of its chunks.
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/train/data_parallel.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/recipe.h"

namespace scaletrain::train {

class ModuleEngine : public DataParallel {
 public:
  // Every parameter of the module, whole, in named_parameters() order
  // (collective).
  virtual std::vector<at::Tensor> full_parameters() = 0;
};

// What an engine needs of the trainer: its module and loss function (a
// pipeline runs the loss on its last chunk), the options, and the
// micro-batches of a step.
struct ModuleEngineSetup {
  std::shared_ptr<torch::nn::Module> module;
  ParallelModule* par = nullptr;  // outlives the engine
  comm::World* world = nullptr;
  const ModuleTrainerOptions* options = nullptr;  // outlives the engine
  ModuleLoss loss;
  int64_t accum = 1;
  at::Device device{at::kCPU};  // host: a module without parameters; else its parameters' device
};

// The module's DDP or sharded engine (the recipe built no stages).
std::unique_ptr<ModuleEngine> module_engine(const ModuleEngineSetup& setup);
// The pipeline of the recipe's stages (pp > 1; module_engine_pipeline.cpp).
// Throws std::invalid_argument naming ModuleTrainerOptions.pp_schedule for
// a schedule these chunks cannot run.
std::unique_ptr<ModuleEngine> module_pipeline_engine(const ModuleEngineSetup& setup);

}  // namespace scaletrain::train

#pragma once
// The parallelize recipe: one order in which every layout is applied, for
// our families (from a run's Plan) and for any torch::nn::Module (from a
// ModuleRecipe); Note [Recipe order] in recipe.cpp says why that order.
#include <torch/torch.h>

#include <memory>
#include <string>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/fsdp/module_units.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/train/data_parallel.h"
#include "scaletrain/train/module_checkpointing.h"
#include "scaletrain/train/plan/plan.h"

namespace scaletrain::train {

// A family's model and its strategy as the plan resolved them (its
// EnginePlan: train/plan/engine_plan.h). The model is built deferred when the
// strategy initializes it shard by shard, whole and loaded first with
// model.init_from. Throws UsageError, one line, for combinations this build
// cannot run.
struct Parallelized {
  models::ModelPtr model;
  std::unique_ptr<DataParallel> dp;
};
Parallelized parallelize(const Plan& plan, comm::World& world, comm::Mesh& mesh);

// The data-parallel engine of a user's module: DDP, or the sharded engine
// with one of its strategies (parallel/fsdp/fsdp.h has the table of what
// each shards).
enum class ModuleStrategy { DDP, Zero1, Zero2, Zero3, FullShard, ShardGradOp, HybridShard };
std::string to_string(ModuleStrategy s);  // "ddp", "zero2", "fsdp FULL_SHARD", ...
bool is_sharded(ModuleStrategy s);        // every strategy but DDP
parallel::fsdp::Sharding sharding_of(ModuleStrategy s);  // the sharded engine's name for a sharded one

// What the recipe applies to a user's module, in its order: the pipeline
// cut, tensor parallelism by a plan of submodule names, activation
// checkpointing, the storage dtypes, then the data-parallel engine(s).
struct ModuleRecipe {
  // Pipeline parallelism (parallel/pipeline/module_pipeline.h), first: the
  // module must be a torch::nn::Sequential, cut into pp x virtual_stages
  // chunks of consecutive children (pp_balance: children per chunk; empty:
  // the cut whose largest chunk holds the fewest parameters). The world is a
  // pp x dp x tp mesh (pp outermost, tp innermost; HybridShard: pp x
  // dp_replicate x dp_shard x tp);
  // rank s of the pp group keeps chunks s, s+pp, ..., each under its own
  // engine over dp, and the others are never run there (they stay as the
  // module was built, in the storage dtypes). Units of the sharded
  // strategies are chosen on the whole module, and each chunk's engine
  // takes those among its children. Not with given groups.
  int pp = 1;
  int virtual_stages = 1;  // chunks per rank (the interleaved schedule's v)
  std::vector<int64_t> pp_balance;
  // Tensor parallelism by a plan over the module's submodule names
  // (parallel/tensor/parallelize_module.h): tp > 1 makes the world a dp x
  // tp mesh (tp innermost; HybridShard: dp_replicate x dp_shard x tp), tp
  // ranks split the planned submodules and see the same micro-batches, the
  // engine runs over dp; checkpoints hold the whole parameters' pieces, so
  // any layout resumes them. tp > 1 needs a plan (a plan needs tp > 1).
  int tp = 1;
  parallel::tensor::ModulePlan tensor_plan;
  // Activation checkpointing, after tensor parallelism: the submodules the
  // policy selects recompute in backward where the module's forward calls
  // checkpointed() (Note [Checkpointing a user's module]; YAML
  // model.activation_checkpointing: full selects every such submodule);
  // unset: none.
  std::optional<CheckpointPolicy> activation_checkpointing;
  // Storage, after checkpointing and before the engine (YAML
  // precision.param_dtype and buffer_dtype): kBFloat16 keeps the module's
  // floating parameters (and buffers, unless buffer_dtype says otherwise)
  // in bf16 and the sharded strategies' optimizer shards in fp32
  // (sharded.master_dtype, unless set); gradients are reduced in
  // sharded.reduce_dtype (YAML precision.reduce_dtype; unset: the
  // gradients' dtype, summed in fp32 by Gloo). kFloat or Undefined: the
  // module's own dtypes. Not with DDP, which has no master weights.
  at::ScalarType param_dtype = at::ScalarType::Undefined;
  at::ScalarType buffer_dtype = at::ScalarType::Undefined;
  ModuleStrategy strategy = ModuleStrategy::DDP;
  // Sharded strategies: the submodules gathered and freed as one
  // (module_units.h); empty: the whole module is the root unit. Not for DDP.
  parallel::fsdp::ModuleUnits units;
  // The engines' own knobs; `sharded.sharding` is set from `strategy`.
  parallel::DDPOptions ddp;
  parallel::fsdp::ShardedOptions sharded;
  // HybridShard: the shard group (within a node) and the replicate group
  // (across nodes), e.g. a comm::Mesh's dp_shard() and dp_replicate() (not
  // with tp); or both null and dp_replicate >= 2 for a mesh the recipe
  // builds over the world. Other strategies run over the world's group (or
  // the mesh's dp under tp).
  comm::Group* shard_group = nullptr;
  comm::Group* replicate_group = nullptr;
  int dp_replicate = 1;
};

// One pipeline chunk this rank runs (ModuleRecipe::pp > 1): a Sequential of
// the module's children (named as in the module) and its engine over dp.
struct ModuleStage {
  int chunk = 0;  // its place among the pp x virtual_stages chunks
  torch::nn::Sequential module;
  std::shared_ptr<parallel::DistributedDataParallel> ddp;  // one of the two is set
  std::shared_ptr<parallel::fsdp::ShardedDataParallel> sharded;
};

// What the recipe built over a user's module. Members are destroyed in
// reverse order: the engines first, then the tensor-parallel hooks and the
// mesh whose groups they use.
struct ParallelModule {
  std::unique_ptr<comm::Mesh> mesh;  // dp x tp, pp x dp, or HybridShard's over dp_replicate; null: the world's group
  // The planned submodules run split while it lives.
  std::unique_ptr<parallel::tensor::TensorParallelModule> tp;
  parallel::tensor::GradNormParams tp_norm;  // DDP over tp: the parameters the global norm reads
  comm::Group* shard = nullptr;              // the engine's group
  comm::Group* replicate = nullptr;          // HybridShard's replicas, else null
  int dp_size = 1, dp_rank = 0;              // data-parallel ranks (shard x replicate) and this one
  std::unique_ptr<parallel::DistributedDataParallel> ddp;  // one of the two is set
  std::unique_ptr<parallel::fsdp::ShardedDataParallel> sharded;
  // pp > 1: this rank's chunks in order, each with its engine (then ddp and
  // sharded above are null), and the pipeline group.
  std::vector<ModuleStage> stages;
  comm::Group* pp = nullptr;
  int chunks = 1;                                      // pp x virtual_stages
  std::vector<std::vector<std::string>> chunk_children;  // the module's children each chunk holds, by name
  // What an optimizer must be built over: the engine's flat shards, or the
  // module's trainable parameters (every chunk's, in order, under pp).
  std::vector<at::Tensor> trainable() const;
};

// The cut of `children` parameter counts into `chunks` consecutive non-empty
// pieces whose largest sum is the smallest (the families' block balance,
// parallel/pipeline/stage.h); returns children per piece. Throws UsageError
// when there are fewer children than chunks.
std::vector<int64_t> balance_by_parameters(const std::vector<int64_t>& children, int chunks);

// Applies `recipe` to `module` (collective over `world`). Throws
// std::invalid_argument naming the ModuleRecipe field for a recipe the world
// cannot run, UsageError (from the engines) for a module they refuse.
ParallelModule parallelize(std::shared_ptr<torch::nn::Module> module, comm::World& world, const ModuleRecipe& recipe);

}  // namespace scaletrain::train

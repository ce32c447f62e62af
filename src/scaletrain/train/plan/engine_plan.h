#pragma once
// What the parallelize recipe (train/recipe.h) builds, resolved from the
// config once, after make_plan's checks passed: the starting model's source
// and adapters, and each engine's options. The recipe reads these and the
// plan's dimensions; it never sees the YAML-level Config, so a program that
// fills a Plan itself drives the same public calls the trainer does.
#include <cstdint>
#include <optional>
#include <string>

#include "scaletrain/models/lora.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/precision/nf4.h"

namespace scaletrain::config {
struct Config;
}  // namespace scaletrain::config

namespace scaletrain::train {

// The model a run starts from (train/starting_model.h).
struct StartingPlan {
  uint64_t seed = 0;                         // train.seed: every rank draws the same values
  std::string init_from;                     // model.init_from: a GPT-2 file or a Hub directory; empty: drawn
  std::string adapter_from;                  // finetune.adapter_from: a PEFT adapter directory to start from
  std::optional<models::LoraOptions> lora;   // finetune.method lora or qlora: the adapters
  std::optional<precision::NF4Options> nf4;  // finetune.method qlora: the NF4 base
};

// The sharded engine's options without the groups, which parallelize() takes
// from the mesh (the shard group, HYBRID_SHARD's replicas, tp for O3's amax).
struct ShardedPlan {
  parallel::fsdp::ShardedOptions options;
  bool hybrid = false;  // HYBRID_SHARD: shard within dp_shard, replicate over dp_replicate
  bool no_sync = true;  // accumulate whole gradients until the last micro-batch (zero1, fsdp)
  std::string label;    // for describe()
};

struct EnginePlan {
  StartingPlan start;
  parallel::DDPOptions ddp;                        // DDP, FSDP's NO_SHARD and the pipeline's DDP stages
  ShardedPlan sharded;                             // every other data-parallel strategy
  parallel::tensor::TensorParallelOptions tensor;  // applied when dims.tp > 1
  parallel::context::AttentionOptions context;     // applied when dims.cp > 1
  parallel::pipeline::PipelineOptions pipeline;    // applied when dims.pp > 1
  int ep = 1;                                      // expert-parallel degree (parallel.ep)
};

// The finetune section's adapter settings (r, alpha, rslora, dropout, init,
// train.seed) and target_modules as listed ("q_proj, v_proj"; empty when
// none are): the families' recipe and the module trainer read them alike.
models::LoraOptions finetune_lora(const config::Config& c);

struct Plan;  // train/plan/plan.h, which holds an EnginePlan

// The engine sections of `config` as the engines' options, for a plan whose
// checks passed (make_plan calls it last; engine_plan.cpp).
EnginePlan plan_engines(const config::Config& config, const Plan& plan);

}  // namespace scaletrain::train

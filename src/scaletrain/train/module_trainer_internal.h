#pragma once
// Internal to the module trainer's files: what module_trainer_options.cpp
// (the options' checks and YAML keys), module_trainer.cpp (the loop) and
// module_engine_pipeline.cpp (its pipeline) share.
#include <functional>
#include <string>

#include <torch/nn/module.h>

#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/plan/plan.h"

namespace scaletrain::train::detail {

ModuleStrategy strategy_of(config::DataParallelism d);           // the plan's strategy (NO_SHARD runs DDP)
// std::invalid_argument "ModuleTrainerOptions.FIELD PROBLEM".
[[noreturn]] void bad(const std::string& field, const std::string& problem);
// What must be the same on every rank (Note [Same on every rank] in
// comm/world.cpp): the options that decide the collectives and the module's
// parameters and buffers (names, shapes, dtypes), one "key=value" a line.
// Rank 0's own outputs (metrics_path, progress, log_every) are left out.
std::string settings_text(const ModuleTrainerOptions& o, const torch::nn::Module& module);

// `forward` under autocast in `dtype` on `device` (kFloat: as it is). Inline:
// both the loop and its pipeline run forwards with it.
inline at::Tensor in_precision(at::ScalarType dtype, at::DeviceType device, const std::function<at::Tensor()>& forward) {
  if (dtype == at::kFloat) return forward();
  precision::PrecisionPolicy policy;
  policy.compute = dtype;
  precision::AutocastGuard autocast(policy, device);
  return forward();
}

}  // namespace scaletrain::train::detail

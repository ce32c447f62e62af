#pragma once
// The model a run starts from, before any parallelism: one of our families
// built from the plan's dimensions, its weights drawn or read from
// model.init_from (a GPT-2 file or a Hub directory), with the finetune
// section's adapters and NF4 base, as the plan's StartingPlan says. Either whole on this rank, or without
// parameter bytes for an engine that fills its shard tensor by tensor.
#include <torch/torch.h>

#include <optional>
#include <string>

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/parallel/fsdp/flat_param.h"
#include "scaletrain/train/plan/plan.h"

namespace scaletrain::train {

// An HF GPT-2 file or a Hub directory (model.init_from) into the whole, not
// yet wrapped model; nothing for an empty path.
void init_from(models::ModelPtr& model, const std::string& path);

// The whole model on this rank in `param_dtype` on `device`, loaded from
// model.init_from, with the finetune section's adapters (QLoRA's base built
// tensor by tensor, never whole in full precision). It is built and
// initialized in host memory, so every device starts from the same values.
models::ModelPtr whole_model(const StartingPlan& start, const models::ModelConfig& model, at::ScalarType param_dtype,
                             const at::Device& device);

// A model without parameter bytes (interfaces/deferred.h) and how the
// sharded engine fills each parameter: `init` a whole tensor at a time, or
// `slice_init` only the elements of this rank's shard (Hub directories).
struct DeferredModel {
  models::ModelPtr model;
  interfaces::InitFn init;
  parallel::fsdp::FlatParam::SliceFill slice_init;
};
DeferredModel deferred_model(const Plan& plan);

}  // namespace scaletrain::train

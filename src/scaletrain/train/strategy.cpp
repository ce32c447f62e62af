// The parallelize recipe: the starting model (train/starting_model.cpp),
// experts, tensor and context parallelism, then the data-parallel engine the
// plan names (train/engines.cpp); pipelines in train/pipeline_strategy.cpp.
#include "scaletrain/train/strategy.h"

#include "scaletrain/train/engines.h"

#include "scaletrain/parallel/expert/expert_parallel.h"
#include "scaletrain/precision/fp8.h"

#include <cmath>
#include <map>
#include <unistd.h>

#include <optional>
#include <set>
#include <sstream>

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/optim/file_backed.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/parallel/zero/zero.h"
#include "scaletrain/train/device.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

namespace fsdp = parallel::fsdp;

// Tensor parallelism comes first, then data parallelism over the split
// parameters (DDP and the sharded engine broadcast, bucket and shard what each
// rank now holds). A deferred model is split in shape only, and its init
// function wrapped to draw each full tensor and keep this rank's part (Note
// [Deferred tensor-parallel init] in parallel/tensor).
TensorPlan apply_tensor_parallel(models::ModelPtr& model, comm::Mesh& mesh, const Plan& run,
                                 interfaces::InitFn* deferred_init) {
  if (run.dims.tp <= 1) return std::nullopt;
  parallel::tensor::TensorParallelOptions to = run.engines.tensor;
  to.deferred = deferred_init != nullptr && *deferred_init;
  auto plan = parallel::tensor::parallelize_tensor(*model, mesh.tp(), to);
  if (to.deferred) *deferred_init = parallel::tensor::tensor_parallel_init(*deferred_init, plan);
  return plan;
}

// Deferred parameters on a device are drawn in host memory and copied, so a
// model initializes to the same values on every device (the CPU generator's
// draws; a device's own generator would give others).
interfaces::InitFn drawn_on_host(interfaces::InitFn init) {
  return [init = std::move(init)](const std::string& name, at::Tensor& out) {
    if (out.device().is_cpu()) return init(name, out);
    at::Tensor host = at::empty(out.sizes(), out.options().device(at::DeviceType::CPU));  // host: meant
    init(name, host);
    torch::NoGradGuard no_grad;
    out.copy_(host);
  };
}

}  // namespace

namespace {

// Note [Expert parallelism]: each rank keeps its experts of the whole model.
void apply_expert_parallel(models::CausalLM& model, comm::World& world, comm::Mesh& mesh, const Plan& plan) {
  mesh.add_expert_parallel(world, plan.engines.ep);
  model.set_expert_parallel(parallel::expert::expert_parallel_hooks(mesh.ep(), plan.model.num_local_experts));
}

// DDP (and FSDP's NO_SHARD): the whole model on every rank, split over tp.
Parallelized parallelize_ddp(const Plan& plan, comm::World& world, comm::Mesh& mesh) {
  Parallelized out;
  torch::manual_seed(plan.engines.start.seed);
  out.model = whole_model(plan.engines.start, plan.model, plan.policy.param, plan.device);
  TensorPlan tp_plan = apply_tensor_parallel(out.model, mesh, plan, nullptr);
  comm::Mesh* experts = nullptr;
  if (plan.engines.ep > 1) {
    apply_expert_parallel(*out.model, world, mesh, plan);
    experts = &mesh;
  }
  apply_context_parallel(*out.model, mesh, plan);
  out.dp = ddp_strategy(out.model, mesh.dp_cp(), plan.engines.ddp, std::move(tp_plan), experts);
  return out;
}

}  // namespace

// The recipe, in order: the starting model (whole, or without bytes for an
// engine that fills its shards), then experts, tensor and context
// parallelism, which change what each rank holds, and data parallelism last,
// which broadcasts, buckets or shards what is left (pipelines cut their
// stages first: train/pipeline_strategy.cpp).
Parallelized parallelize(const Plan& plan, comm::World& world, comm::Mesh& mesh) {
  if (plan.dims.pp > 1) return parallelize_pipeline(plan, world, mesh);
  if (runs_ddp(plan.data_parallel)) return parallelize_ddp(plan, world, mesh);
  const StartingPlan& start = plan.engines.start;
  ShardedSetup setup = sharded_setup(plan, mesh);
  fsdp::ShardedOptions& o = setup.options;
  Parallelized out;
  torch::manual_seed(start.seed);
  // Deferred models are built without bytes in the parameter dtype and
  // initialized one tensor at a time (drawn in fp32, or read from
  // model.init_from); the engine keeps each rank's shard.
  if (setup.deferred) {
    DeferredModel d = deferred_model(plan);
    out.model = std::move(d.model);
    o.deferred_init = std::move(d.init);
    o.deferred_slice_init = std::move(d.slice_init);
  } else {
    out.model = whole_model(start, plan.model, plan.policy.param, plan.device);
  }
  if (plan.engines.ep > 1) {  // Note [Experts in the sharded engine] (parallel/fsdp): each rank keeps its experts
    // Drawn values are those of the whole model, whose experts this rank no longer has.
    if (o.deferred_init && start.init_from.empty())
      o.deferred_init = interfaces::replaying_draws(std::move(o.deferred_init), interfaces::param_shapes(*out.model));
    apply_expert_parallel(*out.model, world, mesh, plan);
    o.expert_shard = &mesh.expert_dp();
    o.expert_param = [m = out.model.get()](const std::string& name) { return m->is_expert_parameter(name); };
    o.expert_scale = 1.0 / static_cast<double>(plan.engines.ep);
  }
  if (o.deferred_init) o.deferred_init = drawn_on_host(std::move(o.deferred_init));
  TensorPlan tp_plan = apply_tensor_parallel(out.model, mesh, plan, &o.deferred_init);
  apply_context_parallel(*out.model, mesh, plan);
  select_fp8_weights(o, *out.model);
  try {
    out.dp = sharded_strategy(out.model, world, *setup.shard, setup.replicate, o, setup.no_sync, setup.label,
                              std::move(tp_plan));
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // a wrap policy the model cannot take, etc.
  }
  return out;
}

}  // namespace scaletrain::train

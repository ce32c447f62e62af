// The parallelize recipe (recipe.h): one order for every layout, for our
// families and for a user's module.
//
// Note [Recipe order]: each step changes what the next one sees, so the
// order is fixed, the same for every strategy:
//   1. The starting model: whole and identical on every rank (built from the
//      same seed, or read from model.init_from), or without parameter bytes
//      when the sharded engine fills its shards tensor by tensor.
//   2. Tensor (and sequence) parallelism splits the weights of that whole
//      model: each rank keeps its part of every planned parameter (tp rank
//      0's values broadcast, or, deferred, each part drawn from the full
//      tensor's draws). It must see every block, so it comes before the
//      pipeline cut, which frees the blocks a stage does not keep.
//   3. Context parallelism sets every layer's attention to the split one;
//      it changes no parameter.
//   4. Expert parallelism keeps this rank's experts and drops the others
//      (tensor parallelism of MoE layers is refused, so 2 and 4 never touch
//      the same parameters).
//   5. The pipeline cuts the model into chunks and keeps this stage's.
//   6. Data parallelism comes last: DDP broadcasts, buckets and reduces,
//      the sharded engine flattens and shards, exactly what each rank holds
//      after 2-5 (per chunk under a pipeline), over the dp x cp group (Note
//      [Context-parallel groups] in comm/mesh.h).
// Activation checkpointing, LoRA, FP8 linears and the parameter dtype are
// part of the starting model (the plan builds them in), so every later step
// sees the layers it will run. torchtitan cuts the pipeline first and
// splits each stage; cutting after the split is the same model, since the
// split is per parameter and the cut per block.
// A user's module follows the same order with the steps that apply to any
// module: tensor parallelism by a plan of names, activation checkpointing
// and the storage dtypes (what the families build in), then the
// data-parallel engine. Under a pipeline (a Sequential cut by children) the
// cut comes first, as torchtitan's does, and each chunk gets its own engine:
// the chunks share the module's children, so checkpointing applied to the
// whole reaches them, and their parameters keep the module's names.
#include "scaletrain/train/recipe.h"

#include <algorithm>
#include <string>
#include <vector>

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/parallel/expert/expert_parallel.h"
#include "scaletrain/parallel/pipeline/module_pipeline.h"
#include "scaletrain/parallel/pipeline/stage.h"
#include "scaletrain/train/engines.h"
#include "scaletrain/train/starting_model.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

namespace fsdp = parallel::fsdp;

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

// 1. The starting model. Deferred, the engine's options receive how to fill
// each parameter: drawn whole in the parameter order of the whole model
// (replayed, when expert parallelism will drop parameters whose draws come
// first), on the host, or read from model.init_from.
models::ModelPtr start_model(const Plan& plan, ShardedSetup* setup) {
  const StartingPlan& start = plan.engines.start;
  torch::manual_seed(start.seed);
  if (setup == nullptr || !setup->deferred) return whole_model(start, plan.model, plan.policy.param, plan.device);
  DeferredModel d = deferred_model(plan);
  fsdp::ShardedOptions& o = setup->options;
  o.deferred_init = std::move(d.init);
  o.deferred_slice_init = std::move(d.slice_init);
  if (plan.engines.ep > 1 && o.deferred_init && start.init_from.empty())
    o.deferred_init = interfaces::replaying_draws(std::move(o.deferred_init), interfaces::param_shapes(*d.model));
  if (o.deferred_init) o.deferred_init = drawn_on_host(std::move(o.deferred_init));
  return std::move(d.model);
}

// 2. Tensor parallelism over the mesh's tp group. A deferred model is split
// in shape only, and its init function wrapped to draw each full tensor and
// keep this rank's part (Note [Deferred tensor-parallel init] in parallel/tensor).
TensorPlan apply_tensor_parallel(models::CausalLM& model, comm::Mesh& mesh, const Plan& run,
                                 interfaces::InitFn* deferred_init) {
  if (run.dims.tp <= 1) return std::nullopt;
  parallel::tensor::TensorParallelOptions to = run.engines.tensor;
  to.deferred = deferred_init != nullptr && *deferred_init;
  auto plan = parallel::tensor::parallelize_tensor(model, mesh.tp(), to);
  if (to.deferred) *deferred_init = parallel::tensor::tensor_parallel_init(*deferred_init, plan);
  return plan;
}

// 3. Note [Split attention] (models/attention.h): with cp > 1 every layer's
// attention runs over the cp group on the tokens this rank holds.
void apply_context_parallel(models::CausalLM& model, comm::Mesh& mesh, const Plan& run) {
  if (run.dims.cp == 1) return;
  const parallel::context::AttentionOptions o = run.engines.context;
  model.set_split_attention([group = &mesh.cp(), o](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const models::SequenceLayout* layout) {
    return parallel::context::attention(q, k, v, layout != nullptr ? layout->segments : at::Tensor(), *group, o);
  });
}

// 4. Note [Expert parallelism]: each rank keeps its experts of the whole
// model; their gradients are averaged over the expert-data groups, and the
// sharded engine shards them there (Note [Experts in the sharded engine]).
bool apply_expert_parallel(const models::ModelPtr& model, comm::World& world, comm::Mesh& mesh, const Plan& plan,
                           fsdp::ShardedOptions* sharded) {
  if (plan.engines.ep <= 1) return false;
  mesh.add_expert_parallel(world, plan.engines.ep);
  model->set_expert_parallel(parallel::expert::expert_parallel_hooks(mesh.ep(), plan.model.num_local_experts));
  if (sharded != nullptr) {
    sharded->expert_shard = &mesh.expert_dp();
    sharded->expert_param = [m = model.get()](const std::string& name) { return m->is_expert_parameter(name); };
    sharded->expert_scale = 1.0 / static_cast<double>(plan.engines.ep);
  }
  return true;
}

// 5 and 6. The pipeline's chunks, each under its engine; or the engine over
// the whole (split) model.
std::unique_ptr<DataParallel> apply_data_parallel(const models::ModelPtr& model, comm::World& world, comm::Mesh& mesh,
                                                  const Plan& plan, std::optional<ShardedSetup>& setup,
                                                  TensorPlan tp, bool experts) {
  if (plan.dims.pp > 1) return pipeline_strategy(model, world, mesh, plan, std::move(tp));
  if (!setup) return ddp_strategy(model, mesh.dp_cp(), plan.engines.ddp, std::move(tp), experts ? &mesh : nullptr);
  select_fp8_weights(setup->options, *model);
  return sharded_strategy(model, world, *setup->shard, setup->replicate, setup->options, setup->no_sync,
                          setup->label, std::move(tp));
}

// The storage dtypes of a user's module (ModuleRecipe::param_dtype): its
// floating parameters and buffers cast in place (the tensors keep their
// identity), and the sharded engine's masters in fp32 unless set.
void apply_storage_dtypes(torch::nn::Module& module, const ModuleRecipe& r, fsdp::ShardedOptions& so) {
  const at::ScalarType param = r.param_dtype, buffer = r.buffer_dtype == at::ScalarType::Undefined ? param : r.buffer_dtype;
  for (at::ScalarType t : {param, buffer})
    if (t != at::ScalarType::Undefined && t != at::kFloat && t != at::kBFloat16)
      throw std::invalid_argument(std::string("parallelize: param_dtype and buffer_dtype take kFloat or kBFloat16, got ") +
                                  c10::toString(t) + (t == at::kHalf ? " (fp16 storage needs loss scaling)" : ""));
  if (param == at::kBFloat16 && !is_sharded(r.strategy))
    throw std::invalid_argument(
        "parallelize: param_dtype kBFloat16 needs fp32 master weights, which the sharded strategies keep "
        "(zero1-3, fsdp); DDP would step the bf16 parameters themselves");
  torch::NoGradGuard no_grad;
  auto cast = [](const at::Tensor& t, at::ScalarType dtype) {
    if (dtype != at::ScalarType::Undefined && t.defined() && t.is_floating_point() && t.scalar_type() != dtype)
      t.set_data(t.to(dtype));
  };
  for (const auto& p : module.parameters()) cast(p, param);
  for (const auto& b : module.buffers()) cast(b, buffer);
  if (param == at::kBFloat16 && so.master_dtype == at::ScalarType::Undefined) so.master_dtype = at::kFloat;
}

// ModuleRecipe::pp > 1: the Sequential cut into chunks over a pp x dp x tp
// mesh (HybridShard: pp x dp_replicate x dp_shard x tp); tensor
// parallelism, activation checkpointing and the storage dtypes on the
// whole, then an engine per chunk this rank runs.
ParallelModule parallelize_pipeline(const std::shared_ptr<torch::nn::Module>& module, comm::World& world,
                                    const ModuleRecipe& r) {
  auto bad = [&r](const std::string& what) {
    throw std::invalid_argument("parallelize: pp=" + std::to_string(r.pp) + " " + what);
  };
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module);
  if (!seq)
    bad("cuts a torch::nn::Sequential into stages; this module is " + module->name() +
        " (put its layers in a Sequential, or compose ModulePipeline by hand)");
  if (r.virtual_stages < 1) bad("needs virtual_stages >= 1, got " + std::to_string(r.virtual_stages));
  if (r.tp < 1) bad("needs tp >= 1, got " + std::to_string(r.tp));
  if ((r.tp > 1) != !r.tensor_plan.empty())
    bad(r.tp > 1 ? "x tp=" + std::to_string(r.tp) + " needs a tensor_plan naming the submodules to split"
                 : "has a tensor_plan but tp is 1");
  if (r.shard_group || r.replicate_group) bad("runs over a pp x dp mesh of its own: give no shard_group or replicate_group");
  const bool hybrid = r.strategy == ModuleStrategy::HybridShard;
  const int replicas = hybrid ? r.dp_replicate : 1;
  if (world.size() % (r.pp * replicas * r.tp) != 0)
    bad("x dp_replicate=" + std::to_string(replicas) + " x tp=" + std::to_string(r.tp) +
        " does not divide the world of " + std::to_string(world.size()) + " ranks");
  ParallelModule out;
  out.mesh = std::make_unique<comm::Mesh>(world, comm::MeshDims{r.pp, replicas, -1, r.tp, 1});
  out.pp = &out.mesh->pp();
  out.shard = hybrid ? &out.mesh->dp_shard() : &out.mesh->dp();
  if (hybrid) out.replicate = &out.mesh->dp_replicate();
  out.dp_size = out.shard->size() * replicas;
  out.dp_rank = (out.replicate ? out.replicate->rank() * out.shard->size() : 0) + out.shard->rank();
  out.chunks = r.pp * r.virtual_stages;
  std::vector<int64_t> balance = r.pp_balance;
  if (balance.empty()) {
    std::vector<int64_t> sizes;
    for (const auto& child : seq->children()) {
      int64_t n = 0;
      for (const auto& p : child->parameters()) n += p.numel();
      sizes.push_back(n);
    }
    balance = balance_by_parameters(sizes, out.chunks);
  }
  if (static_cast<int>(balance.size()) != out.chunks)
    bad("x virtual_stages=" + std::to_string(r.virtual_stages) + " makes " + std::to_string(out.chunks) +
        " chunks, but pp_balance has " + std::to_string(balance.size()) + " entries");
  // The whole module split over tp (its chunks hold the same submodules), as
  // without a pipeline: the observer finds the planned layers wherever they run.
  if (r.tp > 1) out.tp = parallel::tensor::parallelize_module(module, out.mesh->tp(), r.tensor_plan);
  if (r.activation_checkpointing) apply_activation_checkpointing(*module, *r.activation_checkpointing);
  fsdp::ShardedOptions so = r.sharded;
  apply_storage_dtypes(*module, r, so);  // the whole module's tensors, so every chunk's
  so.sharding = sharding_of(r.strategy);
  const std::vector<torch::nn::Sequential> pieces = parallel::pipeline::split(torch::nn::Sequential(seq), balance);
  for (const auto& piece : pieces) {
    out.chunk_children.emplace_back();
    for (const auto& child : piece->named_children()) out.chunk_children.back().push_back(child.key());
  }
  // Units are chosen on the whole module (the same ones as without a
  // pipeline); each chunk's engine gets those among its children, by the
  // same dotted names.
  const bool units = !r.units.names.empty() || !r.units.types.empty() || r.units.min_num_params > 0;
  const std::vector<std::string> unit_names = units ? fsdp::select_units(*module, r.units) : std::vector<std::string>{};
  for (int c = out.pp->rank(); c < out.chunks; c += r.pp) {
    ModuleStage st;
    st.chunk = c;
    st.module = pieces[static_cast<size_t>(c)];
    if (is_sharded(r.strategy)) {
      fsdp::ModuleUnits mine;
      const std::vector<std::string>& children = out.chunk_children[static_cast<size_t>(c)];
      for (const auto& name : unit_names)
        if (std::find(children.begin(), children.end(), name.substr(0, name.find('.'))) != children.end())
          mine.names.push_back(name);
      st.sharded = fsdp::fully_shard(st.module.ptr(), world, *out.shard, mine, so, out.replicate);
    } else {
      st.ddp = std::make_shared<parallel::DistributedDataParallel>(st.module.ptr(), *out.shard, r.ddp);
    }
    out.stages.push_back(std::move(st));
  }
  return out;
}

}  // namespace

std::vector<int64_t> balance_by_parameters(const std::vector<int64_t>& sizes, int chunks) {
  const std::vector<double> costs(sizes.begin(), sizes.end());
  std::vector<int64_t> out;
  for (const auto& [begin, end] : parallel::pipeline::balance_blocks(costs, 0, 0, chunks)) out.push_back(end - begin);
  return out;
}

Parallelized parallelize(const Plan& plan, comm::World& world, comm::Mesh& mesh) {
  std::optional<ShardedSetup> setup;
  if (!runs_ddp(plan.data_parallel)) setup = sharded_setup(plan, mesh);
  fsdp::ShardedOptions* sharded = setup ? &setup->options : nullptr;
  Parallelized out;
  out.model = start_model(plan, setup ? &*setup : nullptr);
  TensorPlan tp = apply_tensor_parallel(*out.model, mesh, plan, sharded ? &sharded->deferred_init : nullptr);
  apply_context_parallel(*out.model, mesh, plan);
  const bool experts = apply_expert_parallel(out.model, world, mesh, plan, sharded);
  try {
    out.dp = apply_data_parallel(out.model, world, mesh, plan, setup, std::move(tp), experts);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // a wrap policy the model cannot take, a schedule the shape cannot run
  }
  return out;
}

// A user's module: tensor parallelism by its plan over a dp x tp mesh
// (HybridShard's dp_replicate x dp_shard x tp), then the engine over the
// data-parallel group(s).
ParallelModule parallelize(std::shared_ptr<torch::nn::Module> module, comm::World& world, const ModuleRecipe& r) {
  auto bad = [](const std::string& what) { throw std::invalid_argument("parallelize: " + what); };
  if (!module) bad("no module");
  if (r.pp < 1) bad("pp must be at least 1, got " + std::to_string(r.pp));
  if (r.pp > 1) return parallelize_pipeline(module, world, r);
  if (r.virtual_stages != 1 || !r.pp_balance.empty()) bad("virtual_stages and pp_balance are for pp > 1");
  if (r.tp < 1) bad("tp must be at least 1, got " + std::to_string(r.tp));
  if (r.tp > 1 && r.tensor_plan.empty()) bad("tp=" + std::to_string(r.tp) + " needs a tensor_plan naming the submodules to split");
  if (r.tp == 1 && !r.tensor_plan.empty()) bad("a tensor_plan is given but tp is 1");
  if (r.tp > 1 && (r.shard_group || r.replicate_group)) bad("tp builds its own mesh: give no shard_group or replicate_group");
  const bool hybrid = r.strategy == ModuleStrategy::HybridShard;
  ParallelModule out;
  out.shard = world.group().get();
  if (hybrid && r.shard_group) {
    out.shard = r.shard_group;
    out.replicate = r.replicate_group;
  } else if (r.tp > 1 || hybrid) {  // dp_replicate x dp_shard x tp, tp innermost
    const int replicas = hybrid ? r.dp_replicate : 1;
    if (world.size() % (r.tp * replicas) != 0)
      bad("tp=" + std::to_string(r.tp) + " x dp_replicate=" + std::to_string(replicas) +
          " does not divide the world of " + std::to_string(world.size()) + " ranks");
    out.mesh = std::make_unique<comm::Mesh>(world, comm::MeshDims{1, replicas, -1, r.tp, 1});
    out.shard = hybrid ? &out.mesh->dp_shard() : &out.mesh->dp();
    if (hybrid) out.replicate = &out.mesh->dp_replicate();
    if (r.tp > 1) out.tp = parallel::tensor::parallelize_module(module, out.mesh->tp(), r.tensor_plan);
  }
  if (hybrid && (out.replicate == nullptr || out.shard->size() * out.replicate->size() * r.tp != world.size()))
    bad("HybridShard's shard group of " + std::to_string(out.shard->size()) + " ranks x replicate group of " +
        std::to_string(out.replicate ? out.replicate->size() : 0) + " must cover the world of " +
        std::to_string(world.size()));
  out.dp_size = out.shard->size() * (out.replicate ? out.replicate->size() : 1);
  out.dp_rank = (out.replicate ? out.replicate->rank() * out.shard->size() : 0) + out.shard->rank();
  if (r.activation_checkpointing) apply_activation_checkpointing(*module, *r.activation_checkpointing);
  fsdp::ShardedOptions so = r.sharded;
  apply_storage_dtypes(*module, r, so);
  if (!is_sharded(r.strategy)) {
    out.ddp = std::make_unique<parallel::DistributedDataParallel>(module, *out.shard, r.ddp);
    if (out.tp) out.tp_norm = parallel::tensor::grad_norm_params(*module, out.tp->plan());
    return out;
  }
  so.sharding = sharding_of(r.strategy);
  out.sharded = fsdp::fully_shard(module, world, *out.shard, r.units, so, out.replicate);
  return out;
}

std::vector<at::Tensor> ParallelModule::trainable() const {
  if (sharded) return sharded->shards();
  std::vector<at::Tensor> out;
  for (const ModuleStage& st : stages) {
    if (st.sharded) {
      for (const auto& t : st.sharded->shards()) out.push_back(t);
    } else {
      for (const auto& p : st.module->parameters())
        if (p.requires_grad()) out.push_back(p);
    }
  }
  if (ddp)
    for (const auto& p : ddp->module()->parameters())
      if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace scaletrain::train

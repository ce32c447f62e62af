// The data-parallel strategies behind train::DataParallel (DDP and the
// sharded engine), and the parallelize recipe: tensor parallelism, experts,
// context parallelism, then the data-parallel engine the plan names, over the
// starting model that train/starting_model.cpp builds.
#include "scaletrain/train/strategy.h"

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
#include "scaletrain/train/device.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/parallel/zero/zero.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

namespace fsdp = parallel::fsdp;
using TensorPlan = std::optional<parallel::tensor::TensorParallelPlan>;

// What a strategy's rank holds for checkpoints, in full-model coordinates
// when the model is tensor parallel.
checkpoint::Layout in_full_coordinates(checkpoint::Layout l, const TensorPlan& plan) {
  return plan ? tensor_parallel_layout(std::move(l), *plan) : l;
}

// Micro-batches before the last accumulate locally (no communication) under
// DDP, ZeRO-1 and FSDP; ZeRO-2/3 reduce every micro-batch into their gradient
// shards, as DeepSpeed does, so whole gradients never pile up.
class DDPStrategy final : public DataParallel {
 public:
  // `plan`: the model is tensor-parallel (clipping counts split and
  // replicated parameters over tp; see parallel/tensor).
  // `experts`: the mesh with expert parallelism added (Note [Expert
  // parallelism]): expert gradients are averaged over its expert-data groups.
  DDPStrategy(models::ModelPtr model, comm::Group& group, const ParallelOptions& p,
              const precision::PrecisionOptions& precision,
              std::optional<parallel::tensor::TensorParallelPlan> plan = std::nullopt, comm::Mesh* experts = nullptr)
      : model_(std::move(model)), plan_(std::move(plan)), rank_(group.rank()), find_unused_(p.find_unused_parameters) {
    parallel::DDPOptions o = ddp_options(p, precision);
    if (experts) {
      ep_ = &experts->ep();
      o.expert_group = &experts->expert_dp();
      o.expert_param = [m = model_.get()](const std::string& name) { return m->is_expert_parameter(name); };
      o.expert_scale = 1.0 / static_cast<double>(ep_->size());
      ddp_options_expert_dp_ = experts->expert_dp().size();
      expert_dp_rank_ = experts->expert_dp().rank();
    }
    ddp_ = std::make_unique<parallel::DistributedDataParallel>(model_, group, o);
    for (auto& item : model_->named_parameters()) {
      if (!item.value().requires_grad()) continue;  // frozen ones (finetune) do not train
      params_.push_back(item.value());
      (ep_ && model_->is_expert_parameter(item.key()) ? expert_params_ : shared_params_).push_back(item.value());
    }
  }
  double forward_backward(const std::function<at::Tensor()>& fn, int64_t micro, int64_t accum) override {
    at::Tensor loss;
    {
      trace::Span span("forward", "forward micro-batch", micro);
      loss = fn();
    }
    trace::Span span("backward", "backward micro-batch", micro);
    if (micro + 1 < accum) {
      auto guard = ddp_->no_sync();
      loss.backward();
    } else {
      loss.backward();
    }
    return loss.item<double>();
  }
  std::vector<at::Tensor> optimizer_params() override { return params_; }
  std::vector<int64_t> decay_numel() override {
    std::vector<int64_t> n;
    for (auto& p : params_) n.push_back(p.dim() >= 2 ? p.numel() : 0);
    return n;
  }
  double clip_grad_norm(double max_norm) override {
    if (plan_)
      return parallel::tensor::clip_grad_norm(parallel::tensor::grad_norm_params(*model_, *plan_), max_norm,
                                              *plan_->tp);
    if (ep_) return expert_clip_grad_norm(max_norm);
    return optim::clip_grad_norm(params_, max_norm);
  }
  std::vector<comm::Group*> grad_groups() override {
    if (plan_) return {plan_->tp};
    if (ep_) return {ep_};  // the ranks of an ep group hold different experts' gradients
    return {};
  }
  void after_step() override {}
  void zero_grad() override {
    for (auto& p : params_)
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  double comm_wait_ms() const override { return ddp_->comm_wait_ms(); }
  void reset_stats() override { ddp_->reset_stats(); }
  int64_t model_state_bytes() const override {
    int64_t b = 0;  // frozen parameters too: held, only not trained
    for (auto& p : model_->parameters()) b += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
    return b;
  }
  void with_full_parameters(const std::function<void()>& fn) override { fn(); }
  std::string describe() const override {
    std::string s = "ddp, " + std::to_string(ddp_->num_buckets()) + " buckets";
    if (find_unused_) s += ", unused parameters found after each forward";
    if (ep_)
      s += ", experts split over ep=" + std::to_string(ep_->size()) + " (expert gradients averaged over " +
           std::to_string(ddp_options_expert_dp_) + " ranks)";
    if (plan_)
      s += ", tensor parallel x" + std::to_string(plan_->tp->size()) +
           (plan_->options.sequence_parallel ? " (sequence parallel)" : "");
    return s;
  }
  // Parameters are identical on every data-parallel rank: rank 0 saves,
  // every rank loads.
  // Under expert parallelism the first rank of each expert-data group saves
  // its experts, and only dp rank 0 the parameters every rank shares; every
  // rank loads what it holds (Note [Expert parallelism]).
  checkpoint::Layout checkpoint_layout() const override {
    if (!ep_) return in_full_coordinates(checkpoint::replicated_layout(*model_, rank_ == 0), plan_);
    checkpoint::Layout l = checkpoint::replicated_layout(*model_, expert_dp_rank_ == 0);
    if (rank_ != 0)
      for (auto& slot : l.slots)
        for (auto& piece : slot.pieces) piece.saved = model_->is_expert_parameter(piece.name);
    return l;
  }
  void after_load() override {}

 private:
  models::ModelPtr model_;
  std::optional<parallel::tensor::TensorParallelPlan> plan_;
  int rank_;
  bool find_unused_;
  // The global norm under expert parallelism: the shared parameters' squares
  // are the same on every rank; the experts' add over the ep group (which
  // holds each expert once).
  double expert_clip_grad_norm(double max_norm) {
    torch::NoGradGuard no_grad;
    auto squares = [](const std::vector<at::Tensor>& ps) {
      at::Tensor sq = at::zeros({1}, at::kDouble);
      for (auto& p : ps)
        if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum().cpu();  // host: one scalar per tensor
      return sq;
    };
    at::Tensor experts = squares(expert_params_);
    ep_->all_reduce(experts).wait();
    const double norm = std::sqrt((squares(shared_params_) + experts).item<double>());
    if (max_norm > 0 && norm > max_norm) {
      const double scale = max_norm / (norm + 1e-6);  // as optim::clip_grad_norm
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().mul_(scale);
    }
    return norm;
  }

  std::unique_ptr<parallel::DistributedDataParallel> ddp_;
  std::vector<at::Tensor> params_;
  comm::Group* ep_ = nullptr;  // expert parallelism's group
  int ddp_options_expert_dp_ = 1;  // ranks holding the same experts
  int expert_dp_rank_ = 0;         // this rank's place among them
  std::vector<at::Tensor> shared_params_, expert_params_;
};

class ShardedStrategy final : public DataParallel {
 public:
  // `plan`: the model is tensor-parallel; the engine shards each rank's part
  // (Note [Sharding tensor-parallel parameters] in parallel/fsdp).
  ShardedStrategy(models::ModelPtr model, comm::World& world, comm::Group& shard, comm::Group* replicate,
                  const fsdp::ShardedOptions& o, bool no_sync, std::string label, TensorPlan plan)
      : model_(std::move(model)), shard_(shard), no_sync_(no_sync), label_(std::move(label)), plan_(std::move(plan)) {
    engine_ = std::make_unique<fsdp::ShardedDataParallel>(model_, *model_, world, shard, replicate, o);
    if (plan_) {
      split_.group = plan_->tp;
      std::set<std::string> split;
      for (const auto& l : plan_->params)
        if (l.sharded()) split.insert(l.name);
      split_.is_split = [split](const std::string& name) { return split.count(name) > 0; };
    }
  }
  double forward_backward(const std::function<at::Tensor()>& fn, int64_t micro, int64_t accum) override {
    at::Tensor loss;
    {
      trace::Span span("forward", "forward micro-batch", micro);
      loss = engine_->forward(fn);
    }
    trace::Span span("backward", "backward micro-batch", micro);
    if (no_sync_ && micro + 1 < accum) {
      auto guard = engine_->no_sync();
      loss.backward();
    } else {
      loss.backward();
    }
    return loss.item<double>();
  }
  std::vector<at::Tensor> optimizer_params() override { return engine_->shards(); }
  std::vector<int64_t> decay_numel() override { return engine_->shard_decay_numel(); }
  double clip_grad_norm(double max_norm) override { return engine_->clip_grad_norm(max_norm, split_); }
  std::vector<comm::Group*> grad_groups() override {
    if (plan_) return {&shard_, plan_->tp};
    return {&shard_};
  }
  void after_step() override { engine_->after_step(); }
  void zero_grad() override { engine_->zero_grad(); }
  double comm_wait_ms() const override { return engine_->comm_wait_ms(); }
  void reset_stats() override { engine_->reset_stats(); }
  int64_t model_state_bytes() const override { return engine_->param_bytes() + engine_->grad_bytes(); }
  void with_full_parameters(const std::function<void()>& fn) override {
    fsdp::ShardedDataParallel::FullParams full(*engine_);
    fn();
  }
  std::string describe() const override {
    std::string s = label_ + ", " + std::to_string(engine_->num_units()) + " units (root + " +
                    std::to_string(engine_->num_units() - 1) + " wrapped)";
    // The engine's own options, as it runs them.
    const fsdp::ShardedOptions& o = engine_->options();
    s += std::string(", prefetch backward ") +
         (o.backward_prefetch == fsdp::BackwardPrefetch::Pre    ? "PRE"
          : o.backward_prefetch == fsdp::BackwardPrefetch::Post ? "POST"
                                                                : "none") +
         " forward " + (o.forward_prefetch ? "on" : "off");
    if (o.limit_all_gathers) s += ", at most two units gathered";
    if (o.prefetch_bytes > 0) s += ", prefetch " + std::to_string(o.prefetch_bytes) + " bytes ahead";
    if (o.max_live_numel > 0) s += ", at most " + std::to_string(o.max_live_numel) + " elements live";
    if (o.allgather_bucket_numel > 0)
      s += ", gathers of at most " + std::to_string(o.allgather_bucket_numel) + " elements";
    if (o.deferred_slice_init)
      s += ", each rank reading its shards from model.init_from";
    else
      s += std::string(o.deferred_init ? ", initialized shard by shard" : ", built whole then sharded") +
           (o.sync_module_states ? " from rank 0's weights" : " on every rank");
    if (o.offload_alloc)  // Note [Offloaded shards]
      s += std::string(", shards and their gradients offloaded (") +
           (o.offload_params ? (o.read_ahead ? "parameters in files, read ahead" : "parameters, gathered from host")
                             : "optimizer: a device copy of each shard for gathers") +
           "; " + std::to_string(engine_->offloaded_bytes() >> 10) + " KiB off the device)";
    if (o.expert_shard)  // Note [Experts in the sharded engine]
      s += ", experts split over ep=" + std::to_string(std::lround(1.0 / o.expert_scale)) + " and sharded over " +
           std::to_string(o.expert_shard->size()) + " ranks";
    if (plan_)
      s += ", tensor parallel x" + std::to_string(plan_->tp->size()) +
           (plan_->options.sequence_parallel ? " (sequence parallel)" : "");
    return s;
  }
  checkpoint::Layout checkpoint_layout() const override {
    checkpoint::Layout l = in_full_coordinates(sharded_layout(*engine_), plan_);
    l.strategy = label_;
    return l;
  }
  // Replicated strategies (zero1/2) refresh their parameters from the loaded shards.
  void after_load() override { engine_->after_step(); }

 private:
  models::ModelPtr model_;
  comm::Group& shard_;
  bool no_sync_;
  std::string label_;
  TensorPlan plan_;
  fsdp::NormSplit split_;
  std::unique_ptr<fsdp::ShardedDataParallel> engine_;
};

int64_t mib_to_numel(double mib, at::ScalarType dtype) {
  return static_cast<int64_t>(mib * (1 << 20)) / static_cast<int64_t>(c10::elementSize(dtype));
}

}  // namespace

std::optional<precision::Fp8Format> fp8_wire_format(const ParallelOptions& parallel,
                                                    const precision::PrecisionOptions& p) {
  if (p.fp8_opt_level.empty() && parallel.comm_dtype != "fp8") return std::nullopt;
  return precision::fp8_format(p.fp8_format == "e4m3" ? precision::Fp8Mix::E4M3 : precision::Fp8Mix::Hybrid,
                               /*gradient=*/true);
}

parallel::DDPOptions ddp_options(const ParallelOptions& p, const precision::PrecisionOptions& precision) {
  parallel::DDPOptions o;
  o.gradient_as_bucket_view = true;  // our optimizers zero in place; no copies
  o.fp8_comm = fp8_wire_format(p, precision);
  o.bucket_cap_bytes = static_cast<int64_t>(p.bucket_cap_mb * (1 << 20));
  o.first_bucket_cap_bytes = static_cast<int64_t>(p.first_bucket_mb * (1 << 20));
  o.last_bucket_cap_bytes = static_cast<int64_t>(p.last_bucket_mb * (1 << 20));
  o.find_unused_parameters = p.find_unused_parameters;
  o.comm_dtype = p.comm_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  return o;
}

namespace {

// Tensor parallelism comes first, then data parallelism over the split
// parameters (DDP and the sharded engine broadcast, bucket and shard what each
// rank now holds). A deferred model is split in shape only, and its init
// function wrapped to draw each full tensor and keep this rank's part (Note
// [Deferred tensor-parallel init] in parallel/tensor).
TensorPlan apply_tensor_parallel(models::ModelPtr& model, comm::Mesh& mesh, const ParallelOptions& p,
                                 interfaces::InitFn* deferred_init) {
  if (p.tp <= 1) return std::nullopt;
  parallel::tensor::TensorParallelOptions to;
  to.sequence_parallel = p.sequence_parallel;
  to.deferred = deferred_init != nullptr && *deferred_init;
  auto plan = parallel::tensor::parallelize_tensor(*model, mesh.tp(), to);
  if (to.deferred) *deferred_init = parallel::tensor::tensor_parallel_init(*deferred_init, plan);
  return plan;
}

}  // namespace

namespace {

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

// Note [Offloaded shards] (parallel/fsdp/flat_param.h): where the sharded
// engine keeps shards off the device. Shards of parameter offload to nvme are
// file-backed mappings under offload_dir (read ahead per unit); every other
// offloaded shard, and every gradient, is host memory, page-locked on a GPU.
void set_offload(const Config& c, const Plan& plan, parallel::fsdp::ShardedOptions& o) {
  const bool params = plan.offload_params != Offload::kNone;
  if (!params && plan.offload_optimizer == Offload::kNone) return;
  const bool files = plan.offload_params == Offload::kNvme;
  const bool pin = plan.cuda;  // copies to and from the GPU can then be asynchronous
  o.offload_params = params;
  o.read_ahead = files;
  const std::string dir = c.parallel.zero.offload_dir;
  o.offload_alloc = [files, pin, dir](int64_t numel, at::ScalarType dtype, bool gradient) {
    if (files && !gradient) return optim::file_backed_zeros(dir, numel, dtype);
    return host_empty(numel, dtype, pin);
  };
}

}  // namespace


void select_fp8_weights(parallel::fsdp::ShardedOptions& o, torch::nn::Module& module) {
  if (!o.fp8_gather) return;
  const auto names = models::fp8_weight_names(module);
  o.fp8_gather_param = [set = std::set<std::string>(names.begin(), names.end())](const std::string& name) {
    return set.count(name) > 0;
  };
}

namespace {

// Note [Split attention] (models/attention.h): with cp > 1 every layer's
// attention runs over the cp group on the tokens this rank holds.
void apply_context_parallel(models::CausalLM& model, comm::Mesh& mesh, const ParallelOptions& p,
                            const models::ModelConfig& m) {
  if (p.cp == 1) return;
  parallel::context::AttentionOptions o;
  o.mode = parallel::context::parse_mode(p.cp_mode);
  o.flash = models::attention_path(m.attention) == models::AttentionPath::Flash;
  model.set_split_attention([group = &mesh.cp(), o](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const models::SequenceLayout* layout) {
    return parallel::context::attention(q, k, v, layout != nullptr ? layout->segments : at::Tensor(), *group, o);
  });
}

}  // namespace

// Shared with the pipeline strategy (train/pipeline_strategy.cpp).
ShardedSetup sharded_setup(const Config& c, const Plan& plan, comm::Mesh& mesh) {
  const auto& p = c.parallel;
  const at::ScalarType param_dtype = plan.policy.param;
  ShardedSetup out;
  fsdp::ShardedOptions& o = out.options;
  o.master_dtype = at::kFloat;
  out.shard = &mesh.dp_cp();  // Note [Context-parallel groups] (comm/mesh.h)
  out.label = to_string(plan.data_parallel);
  if (uses_fsdp_keys(plan.data_parallel)) {
    const auto& f = p.fsdp;
    o.sharding = plan.data_parallel == DataParallelism::kFullShard     ? fsdp::Sharding::FullShard
                 : plan.data_parallel == DataParallelism::kShardGradOp ? fsdp::Sharding::ShardGradOp
                                                                       : fsdp::Sharding::HybridShard;
    o.wrap.policy = fsdp::parse_wrap_policy(f.auto_wrap_policy);
    o.wrap.layer_cls = f.transformer_layer_cls;
    o.wrap.min_num_params = f.min_num_params;
    o.backward_prefetch = fsdp::parse_backward_prefetch(f.backward_prefetch);
    o.forward_prefetch = f.forward_prefetch;
    o.limit_all_gathers = f.limit_all_gathers;
    o.sync_module_states = f.sync_module_states;
    if (o.sharding == fsdp::Sharding::HybridShard) {
      out.shard = &mesh.dp_shard_cp();
      out.replicate = &mesh.dp_replicate();
    }
  } else {
    parallel::zero::ZeroOptions z;
    z.stage = zero_stage(plan.data_parallel);
    z.reduce_bucket_numel = mib_to_numel(p.zero.reduce_bucket_mb, param_dtype);
    // Stage 1/2 units taper at both ends as DDP's buckets do, with DDP's caps.
    z.first_bucket_numel = std::max<int64_t>(1, mib_to_numel(p.first_bucket_mb, param_dtype));
    z.last_bucket_numel = mib_to_numel(p.last_bucket_mb, param_dtype);
    z.allgather_bucket_numel = std::max<int64_t>(1, mib_to_numel(p.zero.allgather_bucket_mb, param_dtype));
    z.prefetch_bytes = static_cast<int64_t>(p.zero.prefetch_bucket_mb * (1 << 20));
    z.max_live_numel = p.zero.max_live_parameters;
    o = parallel::zero::sharded_options(z);
    o.master_dtype = at::kFloat;
    out.no_sync = z.stage == 1;
  }
  o.reduce_dtype = plan.policy.reduce;
  o.fp8_reduce = fp8_wire_format(c.parallel, c.precision);
  if (plan.fp8_level == Fp8OptLevel::kO3) {
    // MS-AMP's O3: fp16 masters (fp32 gradient shards), and the FP8 linears'
    // weights gathered as E4M3 (Note [FP8 weight gathers] in parallel/fsdp);
    // select_fp8_weights() names them once the model exists.
    o.master_dtype = at::kHalf;
    o.grad_dtype = at::kFloat;
    o.fp8_gather = precision::Fp8Format::E4M3;
    if (p.tp > 1) o.fp8_amax_groups = {&mesh.tp()};
  }
  set_offload(c, plan, o);
  // zero3 always, fsdp with cpu_ram_efficient_loading (like DeepSpeed's
  // zero.Init): never build the whole model; make_plan says when it cannot.
  out.deferred = plan.deferred_init;
  return out;
}

Parallelized parallelize(const Config& c, const Plan& plan, comm::World& world, comm::Mesh& mesh) {
  const auto& p = c.parallel;
  const models::ModelConfig& mcfg = plan.model;
  const at::ScalarType param_dtype = plan.policy.param;
  Parallelized out;
  if (p.pp > 1) return parallelize_pipeline(c, plan, world, mesh);
  if (runs_ddp(plan.data_parallel)) {  // FSDP's NO_SHARD is DDP
    torch::manual_seed(c.train.seed);
    out.model = whole_model(c, mcfg, param_dtype, plan.device);
    TensorPlan tp_plan = apply_tensor_parallel(out.model, mesh, p, nullptr);
    ParallelOptions dp_options = p;
    if (plan.policy.reduce == at::kBFloat16) dp_options.comm_dtype = "bf16";  // DDP sums in fp32 either way
    comm::Mesh* experts = nullptr;
    if (p.ep > 1) {  // Note [Expert parallelism]: each rank keeps its experts of the whole model built above
      mesh.add_expert_parallel(world, p.ep);
      out.model->set_expert_parallel(parallel::expert::expert_parallel_hooks(mesh.ep(), mcfg.num_local_experts));
      experts = &mesh;
    }
    apply_context_parallel(*out.model, mesh, c.parallel, mcfg);
    out.dp = std::make_unique<DDPStrategy>(out.model, mesh.dp_cp(), dp_options, c.precision, std::move(tp_plan),
                                           experts);
    return out;
  }
  ShardedSetup setup = sharded_setup(c, plan, mesh);
  fsdp::ShardedOptions& o = setup.options;
  torch::manual_seed(c.train.seed);
  // Deferred models are built without bytes in the parameter dtype and
  // initialized one tensor at a time (drawn in fp32, or read from
  // model.init_from); the engine keeps each rank's shard.
  if (setup.deferred) {
    DeferredModel d = deferred_model(c, plan);
    out.model = std::move(d.model);
    o.deferred_init = std::move(d.init);
    o.deferred_slice_init = std::move(d.slice_init);
  } else {
    out.model = whole_model(c, mcfg, param_dtype, plan.device);
  }
  if (p.ep > 1) {  // Note [Experts in the sharded engine] (parallel/fsdp): each rank keeps its experts
    // Drawn values are those of the whole model, whose experts this rank no longer has.
    if (o.deferred_init && c.model.init_from.empty())
      o.deferred_init = interfaces::replaying_draws(std::move(o.deferred_init), interfaces::param_shapes(*out.model));
    mesh.add_expert_parallel(world, p.ep);
    out.model->set_expert_parallel(parallel::expert::expert_parallel_hooks(mesh.ep(), mcfg.num_local_experts));
    o.expert_shard = &mesh.expert_dp();
    o.expert_param = [m = out.model.get()](const std::string& name) { return m->is_expert_parameter(name); };
    o.expert_scale = 1.0 / static_cast<double>(p.ep);
  }
  if (o.deferred_init) o.deferred_init = drawn_on_host(std::move(o.deferred_init));
  TensorPlan tp_plan = apply_tensor_parallel(out.model, mesh, p, &o.deferred_init);
  apply_context_parallel(*out.model, mesh, p, mcfg);
  select_fp8_weights(o, *out.model);
  try {
    out.dp = std::make_unique<ShardedStrategy>(out.model, world, *setup.shard, setup.replicate, o, setup.no_sync,
                                               setup.label, std::move(tp_plan));
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());  // a wrap policy the model cannot take, etc.
  }
  return out;
}

}  // namespace scaletrain::train

// The data-parallel engines behind train::DataParallel: DDP and the sharded
// engine (ZeRO-1/2/3 and FSDP's strategies), over a model that may be split
// by tensor parallelism and hold experts.
#include "scaletrain/train/engines.h"

#include <set>

#include "scaletrain/models/linear.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {

double MicroBatchStrategy::step(const StepWork& work) {
  const auto accum = static_cast<int64_t>(work.inputs.size());
  double sum = 0;
  for (int64_t k = 0; k < accum; ++k) {
    if (work.prepare) work.prepare(k);
    sum += forward_backward([&] { return work.forward(k); }, k, accum) / work.loss_scale;
  }
  return sum;
}

namespace {

namespace fsdp = parallel::fsdp;

// What a strategy's rank holds for checkpoints, in full-model coordinates
// when the model is tensor parallel.
checkpoint::Layout in_full_coordinates(checkpoint::Layout l, const TensorPlan& plan) {
  return plan ? tensor_parallel_layout(std::move(l), *plan) : l;
}

// Micro-batches before the last accumulate locally (no communication) under
// DDP, ZeRO-1 and FSDP; ZeRO-2/3 reduce every micro-batch into their gradient
// shards, as DeepSpeed does, so whole gradients never pile up.
class DDPStrategy final : public MicroBatchStrategy {
 public:
  // `plan`: the model is tensor-parallel (clipping counts split and
  // replicated parameters over tp; see parallel/tensor).
  // `experts`: the mesh with expert parallelism added (Note [Expert
  // parallelism]): expert gradients are averaged over its expert-data groups.
  DDPStrategy(models::ModelPtr model, comm::Group& group, parallel::DDPOptions o,
              std::optional<parallel::tensor::TensorParallelPlan> plan = std::nullopt, comm::Mesh* experts = nullptr)
      : model_(std::move(model)), plan_(std::move(plan)), rank_(group.rank()), find_unused_(o.find_unused_parameters) {
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
    at::Tensor experts = optim::grad_square_sum(expert_params_);
    ep_->all_reduce(experts).wait();
    // fp64 sums: adding on the device is the host's addition, with one sync.
    experts.add_(optim::grad_square_sum(shared_params_).to(experts.device()));
    const double norm = std::sqrt(experts.item<double>());
    if (max_norm > 0 && norm > max_norm) {
      const double scale = max_norm / (norm + 1e-6);  // as optim::clip_grad_norm
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().mul_(scale);
    }
    return norm;
  }

  std::unique_ptr<parallel::DistributedDataParallel> ddp_;
  std::vector<at::Tensor> params_;
  comm::Group* ep_ = nullptr;      // expert parallelism's group
  int ddp_options_expert_dp_ = 1;  // ranks holding the same experts
  int expert_dp_rank_ = 0;         // this rank's place among them
  std::vector<at::Tensor> shared_params_, expert_params_;
};

class ShardedStrategy final : public MicroBatchStrategy {
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

}  // namespace

std::unique_ptr<DataParallel> ddp_strategy(models::ModelPtr model, comm::Group& group, parallel::DDPOptions o,
                                           TensorPlan plan, comm::Mesh* experts) {
  return std::make_unique<DDPStrategy>(std::move(model), group, std::move(o), std::move(plan), experts);
}

std::unique_ptr<DataParallel> sharded_strategy(models::ModelPtr model, comm::World& world, comm::Group& shard,
                                               comm::Group* replicate, const parallel::fsdp::ShardedOptions& o,
                                               bool no_sync, std::string label, TensorPlan plan) {
  return std::make_unique<ShardedStrategy>(std::move(model), world, shard, replicate, o, no_sync, std::move(label),
                                           std::move(plan));
}

void select_fp8_weights(parallel::fsdp::ShardedOptions& o, torch::nn::Module& module) {
  if (!o.fp8_gather) return;
  const auto names = models::fp8_weight_names(module);
  o.fp8_gather_param = [set = std::set<std::string>(names.begin(), names.end())](const std::string& name) {
    return set.count(name) > 0;
  };
}

ShardedSetup sharded_setup(const Plan& plan, comm::Mesh& mesh) {
  const ShardedPlan& sp = plan.engines.sharded;
  ShardedSetup out;
  out.options = sp.options;
  out.no_sync = sp.no_sync;
  out.label = sp.label;
  out.shard = &mesh.dp_cp();  // Note [Context-parallel groups] (comm/mesh.h)
  if (sp.hybrid) {
    out.shard = &mesh.dp_shard_cp();
    out.replicate = &mesh.dp_replicate();
  }
  // O3 agrees on the FP8 weights' scales over tp (Note [FP8 weight gathers]).
  if (out.options.fp8_gather && plan.dims.tp > 1) out.options.fp8_amax_groups = {&mesh.tp()};
  // zero3 always, fsdp with cpu_ram_efficient_loading (like DeepSpeed's
  // zero.Init): never build the whole model; make_plan says when it cannot.
  out.deferred = plan.deferred_init;
  return out;
}

}  // namespace scaletrain::train

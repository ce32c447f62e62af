// The trainer's pipeline strategy (parallel.pp > 1): the model, whole and
// split by tensor parallelism, cut into stages (parallel/pipeline), with DDP
// or a sharded engine (ZeRO-1/2/3, FSDP) per chunk over the stage's dp x cp
// group: the cp ranks of a stage hold the same chunk and parts of every
// sequence (Note [Context-parallel groups]). Steps 5 and 6 of Note [Recipe
// order] (train/recipe.cpp).
#include <sstream>

#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/pipeline/data_parallel.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/train/engines.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

namespace pl = parallel::pipeline;

class PipelineStrategy final : public DataParallel {
 public:
  PipelineStrategy(models::ModelPtr model, comm::World& world, comm::Mesh& mesh, const Plan& run_plan, TensorPlan tp)
      : model_(std::move(model)), mesh_(mesh), plan_(std::move(tp)) {
    pipe_ = std::make_unique<pl::Pipeline>(model_, mesh.pp(), &mesh.dp_cp(), run_plan.engines.pipeline,
                                           world.group().get());

    std::vector<std::shared_ptr<pl::ChunkRunner>> runners;
    sharded_ = !runs_ddp(run_plan.data_parallel);
    if (sharded_) {
      ShardedSetup setup = sharded_setup(run_plan, mesh);
      label_ = setup.label;
      shard_group_ = setup.shard;
      for (const auto& ch : pipe_->chunks()) {
        parallel::fsdp::ShardedOptions o = setup.options;
        select_fp8_weights(o, *ch.ptr());
        auto r = std::make_shared<pl::ShardedRunner>(ch, world, *setup.shard, setup.replicate, o);
        for (auto& s : r->engine().shards()) params_.push_back(s);
        for (auto d : r->engine().shard_decay_numel()) decay_.push_back(d);
        engines_.push_back(r);
        runners.push_back(r);
      }
      counted_ = params_;  // shards partition each stage's gradient over the shard group
    } else {
      label_ = "ddp";
      const parallel::DDPOptions& o = run_plan.engines.ddp;
      for (const auto& ch : pipe_->chunks()) {
        auto r = std::make_shared<pl::DdpRunner>(ch, mesh.dp_cp(), o);
        ddps_.push_back(r);
        runners.push_back(r);
        for (auto& item : ch->named_parameters()) {
          const at::Tensor& t = item.value();
          if (!t.requires_grad()) continue;  // frozen (finetune): no gradient, no optimizer state
          params_.push_back(t);
          decay_.push_back(t.dim() >= 2 ? t.numel() : 0);
          (plan_ && !split(item.key()) ? shared_ : counted_).push_back(t);
        }
      }
    }
    pipe_->set_runners(runners);
  }

  std::optional<Bubble> pipeline_bubble() const override {
    return Bubble{pipe_->last_stats().bubble(), pl::expected_bubble(pipe_->shape())};
  }
  // The schedule interleaves the micro-batches' forwards and backwards; each
  // stage runs its pieces of the model (work.forward needs the whole model),
  // with micro-batch k's preparation (its layout) before each of its pieces.
  double step(const StepWork& work) override {
    return pipe_->step(work.inputs, work.targets, work.loss_scale, work.autocast, work.weights, work.prepare);
  }
  std::vector<at::Tensor> optimizer_params() override { return params_; }
  std::vector<int64_t> decay_numel() override { return decay_; }
  double clip_grad_norm(double max_norm) override {
    return pl::clip_grad_norm(counted_, shared_, mesh_.dims().tp, grad_groups(), max_norm);
  }
  std::vector<comm::Group*> grad_groups() override {
    std::vector<comm::Group*> g{&mesh_.pp()};
    if (mesh_.dims().tp > 1) g.push_back(&mesh_.tp());
    if (sharded_) g.push_back(shard_group_);
    return g;
  }
  void after_step() override {
    for (auto& e : engines_) e->engine().after_step();
  }
  void zero_grad() override {
    for (auto& e : engines_) e->engine().zero_grad();
    pipe_->zero_grad();  // the chunks' own gradients (DDP's) and the tied head copy's
  }
  double comm_wait_ms() const override {
    double ms = pipe_->last_stats().wait_ms;
    for (auto& d : ddps_) ms += d->ddp().comm_wait_ms();
    for (auto& e : engines_) ms += e->engine().comm_wait_ms();
    return ms;
  }
  void reset_stats() override {
    for (auto& d : ddps_) d->ddp().reset_stats();
    for (auto& e : engines_) e->engine().reset_stats();
  }
  int64_t model_state_bytes() const override {
    int64_t b = 0;
    for (auto& e : engines_) b += e->engine().param_bytes() + e->engine().grad_bytes();
    if (!sharded_)  // frozen parameters too: they are held, only not trained
      for (const auto& ch : pipe_->chunks())
        for (const auto& t : ch->parameters()) b += t.nbytes() + (t.grad().defined() ? t.grad().nbytes() : 0);
    if (pipe_->holds_head_copy()) {  // Note [Tied head across stages]
      const at::Tensor w = model_->tied_head().second;
      b += w.nbytes() + (w.grad().defined() ? w.grad().nbytes() : 0);
    }
    return b;
  }
  void with_full_parameters(const std::function<void()>&) override {
    throw UsageError("sampling a pipeline-parallel model is not available; set train.sample_tokens=0");
  }
  std::string describe() const override {
    std::ostringstream s;
    const auto& o = pipe_->options();
    s << "pipeline " << pl::to_string(o.schedule) << " pp=" << pipe_->stages() << " microbatches=" << o.microbatches;
    if (o.virtual_stages > 1) s << " virtual_stages=" << o.virtual_stages;
    s << " (blocks per chunk, cut by " << (o.balance == pl::Balance::Time ? "measured time" : "parameters") << ":";
    for (const auto& spec : pipe_->all_chunks()) s << " " << spec.end - spec.begin;
    s << ")";
    if (plan_) s << ", tensor parallel x" << mesh_.dims().tp << (plan_->options.sequence_parallel ? " (sp)" : "");
    s << ", " << label_ << " per stage over dp=" << mesh_.dims().dp();
    if (mesh_.dims().cp > 1) s << " x cp=" << mesh_.dims().cp;
    return s.str();
  }
  checkpoint::Layout checkpoint_layout() const override {
    // Each stage saves its own chunks' tensors (parameter names are the
    // whole model's), so any layout can load them; optimizer state indices
    // continue across chunks in optimizer_params() order.
    checkpoint::Layout out;
    int offset = 0;
    for (size_t j = 0; j < pipe_->chunks().size(); ++j) {
      checkpoint::Layout l =
          sharded_ ? sharded_layout(engines_[j]->engine())
                   : checkpoint::replicated_layout(*pipe_->chunks()[j],
                                                   mesh_.coord().dp(mesh_.dims()) == 0 && mesh_.coord().cp == 0);
      if (plan_) l = tensor_parallel_layout(std::move(l), *plan_);  // full-model coordinates
      append_chunk_layout(out, std::move(l), &offset);
    }
    out.strategy = "pipeline " + label_;
    return out;
  }
  void after_load() override {
    for (auto& e : engines_) e->engine().after_step();
  }

 private:
  bool split(const std::string& name) const {
    for (const auto& l : plan_->params)
      if (l.name == name) return l.sharded();
    return false;
  }

  models::ModelPtr model_;
  comm::Mesh& mesh_;
  std::optional<parallel::tensor::TensorParallelPlan> plan_;
  std::unique_ptr<pl::Pipeline> pipe_;
  bool sharded_ = false;
  comm::Group* shard_group_ = nullptr;
  std::string label_;
  std::vector<std::shared_ptr<pl::DdpRunner>> ddps_;
  std::vector<std::shared_ptr<pl::ShardedRunner>> engines_;
  std::vector<at::Tensor> params_, counted_, shared_;
  std::vector<int64_t> decay_;
};

}  // namespace

std::unique_ptr<DataParallel> pipeline_strategy(models::ModelPtr model, comm::World& world, comm::Mesh& mesh,
                                                const Plan& run, TensorPlan plan) {
  return std::make_unique<PipelineStrategy>(std::move(model), world, mesh, run, std::move(plan));
}

}  // namespace scaletrain::train

// A user's module under pipeline parallelism (ModuleRecipe::pp > 1), behind
// DataParallel (module_engine.h): the recipe cut the module's Sequential
// into chunks, each with its engine over dp; here a ModulePipeline runs
// them, the global norm is clipped over every chunk, and the parameters are
// described and gathered by the module's own names.
//
// Note [The last chunk runs in the loss]: ModulePipeline computes
// loss(chunk(x), target) on the last chunk's rank. The trainer's loss
// function takes a module and an input and runs the forward itself, so the
// last chunk's forward is the identity and the loss function is called with
// that chunk's Sequential and its input: the same function then serves the
// whole module (one process) and its tail (a pipeline), and autograd reaches
// the chunk's parameters and its input either way.
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "scaletrain/parallel/pipeline/module_pipeline.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/module_engine.h"
#include "scaletrain/train/module_trainer_internal.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

namespace pl = parallel::pipeline;

class PipelineModuleEngine final : public ModuleEngine {
 public:
  explicit PipelineModuleEngine(ModuleEngineSetup s) : s_(std::move(s)), par_(*s_.par) {
    std::vector<pl::StageModule> chunks;
    for (const ModuleStage& st : par_.stages) {
      pl::StageModule sm;
      sm.module = st.module.ptr();
      torch::nn::Sequential seq = st.module;
      if (st.chunk == par_.chunks - 1)
        sm.forward = [](const at::Tensor& x) { return x; };  // Note [The last chunk runs in the loss]
      else
        sm.forward = [this, seq](const at::Tensor& x) mutable {
          return detail::in_precision(s_.options->autocast, s_.device.type(), [&] { return seq->forward(x); });
        };
      if (st.ddp)
        sm.runner = std::make_shared<pl::DdpStageRunner>(st.ddp);
      else
        sm.runner = std::make_shared<pl::ShardedStageRunner>(st.sharded);
      chunks.push_back(std::move(sm));
    }
    pl::ModulePipelineOptions po;
    po.schedule = s_.options->pp_schedule;
    po.microbatches = static_cast<int>(s_.accum);
    po.virtual_stages = s_.options->virtual_stages;
    try {
      pipeline_ = std::make_unique<pl::ModulePipeline>(std::move(chunks), *par_.pp, po);
    } catch (const std::invalid_argument& e) {
      detail::bad("pp_schedule", std::string("cannot run here: ") + e.what());
    } catch (const UsageError& e) {  // check_schedule's
      detail::bad("pp_schedule", std::string("cannot run here: ") + e.what());
    }
  }

  // The step's micro-batches (which weigh the same) as one batch through the
  // schedule; returns the mean of their losses (the same on every pp rank).
  double step(const StepWork& work) override {
    for (double w : work.weights)
      if (w != work.weights.front())
        throw std::logic_error("a module pipeline runs micro-batches of equal weight");
    torch::nn::Module* last =
        par_.stages.back().chunk == par_.chunks - 1 ? par_.stages.back().module.ptr().get() : nullptr;
    const double scale = work.loss_scale;
    const pl::LossFn loss = [&](const at::Tensor& x, const at::Tensor& y) {
      at::Tensor l = detail::in_precision(s_.options->autocast, s_.device.type(), [&] { return s_.loss(*last, x, y); });
      if (!l.defined() || l.numel() != 1)
        throw std::invalid_argument("ModuleTrainer: the loss function must return one value (the micro-batch's mean)");
      return l.reshape({}) * scale;
    };
    const double sum = pipeline_->step(at::cat(work.inputs), at::cat(work.targets), loss) / scale;
    if (par_.tp) par_.tp->check();  // a collective that failed inside forward
    return sum;
  }
  std::vector<at::Tensor> optimizer_params() override { return par_.trainable(); }
  std::vector<int64_t> decay_numel() override {
    std::vector<int64_t> n;
    for (const auto& p : par_.trainable()) n.push_back(p.dim() >= 2 ? p.numel() : 0);
    return n;
  }
  double clip_grad_norm(double max_norm) override;
  std::vector<comm::Group*> grad_groups() override { return {s_.world->group().get()}; }
  void after_step() override {
    for (const ModuleStage& st : par_.stages)
      if (st.sharded) st.sharded->after_step();
  }
  void zero_grad() override {
    for (const ModuleStage& st : par_.stages) st.ddp ? st.ddp->zero_grad() : st.sharded->zero_grad();
  }
  double comm_wait_ms() const override {
    double ms = 0;
    for (const ModuleStage& st : par_.stages) ms += st.ddp ? st.ddp->comm_wait_ms() : st.sharded->comm_wait_ms();
    return ms;
  }
  void reset_stats() override {
    for (const ModuleStage& st : par_.stages) st.ddp ? st.ddp->reset_stats() : st.sharded->reset_stats();
  }
  int64_t model_state_bytes() const override {
    int64_t b = 0;
    for (const ModuleStage& st : par_.stages) {
      if (st.sharded) {
        b += st.sharded->param_bytes() + st.sharded->grad_bytes();
        continue;
      }
      for (const auto& p : st.module->parameters()) b += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
    }
    return b;
  }
  // Every chunk runs only on its own pp rank: nothing can run the whole module.
  void with_full_parameters(const std::function<void()>&) override {
    throw UsageError("a module cut into pipeline stages cannot run whole; full_parameters() gathers its tensors");
  }
  std::string describe() const override {
    return "module trainer, pp " + std::to_string(par_.pp->size()) + " (" + std::to_string(par_.chunks) +
           " chunks), " + to_string(s_.options->strategy) + " per chunk" +
           (par_.tp ? ", tensor parallel x" + std::to_string(s_.options->tp) : "");
  }
  checkpoint::Layout checkpoint_layout() const override;
  void after_load() override { after_step(); }
  std::vector<at::Tensor> full_parameters() override;

 private:
  ModuleEngineSetup s_;
  ParallelModule& par_;
  std::unique_ptr<pl::ModulePipeline> pipeline_;
};

// The global gradient norm over every chunk, clipped as torch clips: every
// gradient times max_norm / (norm + 1e-6) when that is below 1. Each rank's
// squares are summed over the world, apart for the parameters tensor
// parallelism splits (each tp rank holds its part) and the ones it
// replicates (every tp rank holds the same), then divided by how many ranks
// hold the same tensors: DDP's chunks are whole on every dp rank; sharded
// chunks' shards are their own within the shard group, and HybridShard's
// replicas hold the same ones.
double PipelineModuleEngine::clip_grad_norm(double max_norm) {
  std::vector<at::Tensor> grads, parts[2];  // parts: squares of split, of replicated parameters
  at::TensorOptions opts = at::TensorOptions().dtype(at::kDouble);
  auto add = [&](const std::string& name, const at::Tensor& g) {
    opts = opts.device(g.device());
    parts[par_.tp && par_.tp->plan().layout(name).sharded() ? 0 : 1].push_back(g.to(at::kDouble).pow(2).sum());
  };
  for (const ModuleStage& st : par_.stages) {
    if (st.sharded) {
      for (const auto& v : st.sharded->shard_views()) {
        const at::Tensor g = v.shard.grad();
        if (!v.trainable || !g.defined()) continue;
        grads.push_back(g);
        for (const auto& piece : v.pieces) add(piece.name, g.narrow(0, piece.shard_offset, piece.numel));
      }
      continue;
    }
    for (const auto& p : st.module->named_parameters())
      if (p.value().grad().defined()) {
        grads.push_back(p.value().grad());
        add(p.key(), p.value().grad());
      }
  }
  auto total = [&](const std::vector<at::Tensor>& v) { return v.empty() ? at::zeros({}, opts) : at::stack(v).sum(); };
  at::Tensor sq = at::stack({total(parts[0]), total(parts[1])});
  s_.world->group()->all_reduce(sq, comm::ReduceOp::Sum).wait();
  const bool sharded = par_.stages.front().sharded != nullptr;
  const double same = sharded ? (par_.replicate ? par_.replicate->size() : 1) : par_.dp_size;
  const double tp = par_.tp ? par_.mesh->tp().size() : 1;
  const at::Tensor host = sq.cpu();  // host: two scalars
  const double norm = std::sqrt(host[0].item<double>() / same + host[1].item<double>() / (same * tp));
  if (max_norm > 0 && norm > max_norm) {
    const double coef = max_norm / (norm + 1e-6);
    torch::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(coef);
  }
  return norm;
}

// Every chunk's layout in turn (their optimizer states follow one another,
// as trainable() lists them), named by the module's own names; each chunk's
// buffers saved by dp rank 0 of its pp rank.
checkpoint::Layout PipelineModuleEngine::checkpoint_layout() const {
  checkpoint::Layout out;
  int states = 0;
  for (const ModuleStage& st : par_.stages) {
    checkpoint::Layout l = st.sharded ? sharded_layout(*st.sharded)
                                      : checkpoint::replicated_layout(*st.module, par_.dp_rank == 0);
    // Tensor parallel: the split parameters' pieces in the whole parameters'
    // coordinates, the replicated ones saved by tp rank 0.
    if (par_.tp) l = tensor_parallel_layout(std::move(l), par_.tp->plan());
    out.strategy = l.strategy;
    append_chunk_layout(out, std::move(l), &states);
    append_buffers(out, *st.module, par_.dp_rank == 0 && (!par_.tp || par_.mesh->tp().rank() == 0));
  }
  out.mesh = "pp " + std::to_string(par_.pp->size()) + " x dp " +
             (par_.replicate ? std::to_string(par_.replicate->size()) + " x " + std::to_string(par_.shard->size())
                             : std::to_string(par_.dp_size)) +
             (par_.tp ? " x tp " + std::to_string(par_.mesh->tp().size()) : "");
  return out;
}

// Every parameter of the module, whole, in named_parameters() order: each
// chunk's from its pp rank (after its dp group gathered its shards).
std::vector<at::Tensor> PipelineModuleEngine::full_parameters() {
  std::map<std::string, at::Tensor> mine;
  std::map<std::string, int> owner;
  for (const ModuleStage& st : par_.stages) {
    std::vector<at::Tensor> whole;
    if (st.sharded) whole = st.sharded->full_parameters();
    const auto named = st.module->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      at::Tensor t = st.sharded ? whole.at(i) : named[i].value().detach().clone();
      // whole over dp; a split parameter's pieces joined over tp
      if (par_.tp) t = parallel::tensor::gather_parameter(t, par_.tp->plan().layout(named[i].key()), par_.mesh->tp());
      mine[named[i].key()] = t;
    }
  }
  // Which pp rank runs each child: chunk c runs on pp rank c % pp.
  for (int c = 0; c < par_.chunks; ++c)
    for (const auto& name : par_.chunk_children.at(static_cast<size_t>(c))) owner[name] = c % par_.pp->size();
  std::vector<at::Tensor> out;
  for (const auto& item : s_.module->named_parameters()) {
    const std::string child = item.key().substr(0, item.key().find('.'));
    const int root = owner.at(child);
    const std::vector<int64_t> shape =
        par_.tp ? par_.tp->plan().layout(item.key()).full_shape : item.value().sizes().vec();
    at::Tensor t = root == par_.pp->rank() ? mine.at(item.key()).contiguous() : at::empty(shape, item.value().options());
    par_.pp->broadcast(t, root).wait();
    out.push_back(t);
  }
  return out;
}

}  // namespace

std::unique_ptr<ModuleEngine> module_pipeline_engine(const ModuleEngineSetup& setup) {
  return std::make_unique<PipelineModuleEngine>(setup);
}

}  // namespace scaletrain::train

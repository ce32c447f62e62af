// The module trainer under pipeline parallelism (ModuleRecipe::pp > 1): the
// recipe cut the module's Sequential into chunks, each with its engine over
// dp; here the loop runs them through a ModulePipeline, clips the global
// norm over every chunk, and describes and gathers the parameters by the
// module's own names.
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
#include <string>

#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/module_trainer_internal.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace pl = parallel::pipeline;

void ModuleTrainer::build_pipeline() {
  std::vector<pl::StageModule> chunks;
  for (const ModuleStage& st : par_.stages) {
    pl::StageModule sm;
    sm.module = st.module.ptr();
    torch::nn::Sequential seq = st.module;
    if (st.chunk == par_.chunks - 1)
      sm.forward = [](const at::Tensor& x) { return x; };  // Note [The last chunk runs in the loss]
    else
      sm.forward = [this, seq](const at::Tensor& x) mutable {
        return detail::in_precision(options_.autocast, device_.type(), [&] { return seq->forward(x); });
      };
    if (st.ddp)
      sm.runner = std::make_shared<pl::DdpStageRunner>(st.ddp);
    else
      sm.runner = std::make_shared<pl::ShardedStageRunner>(st.sharded);
    chunks.push_back(std::move(sm));
  }
  pl::ModulePipelineOptions po;
  po.schedule = options_.pp_schedule;
  po.microbatches = static_cast<int>(accum_);
  po.virtual_stages = options_.virtual_stages;
  try {
    pipeline_ = std::make_unique<pl::ModulePipeline>(std::move(chunks), *par_.pp, po);
  } catch (const std::invalid_argument& e) {
    detail::bad("pp_schedule", std::string("cannot run here: ") + e.what());
  } catch (const UsageError& e) {  // check_schedule's
    detail::bad("pp_schedule", std::string("cannot run here: ") + e.what());
  }
}

// This rank's share of the step through the pipeline; returns the mean of
// its micro-batches' losses (the same on every pp rank).
double ModuleTrainer::pipeline_step(const ModuleData& data, const std::vector<int64_t>& mine) {
  const ModuleBatch b = data.get(mine);
  const double scale = scaler_ ? scaler_->scale() : 1.0;
  torch::nn::Module* last = par_.stages.back().chunk == par_.chunks - 1 ? par_.stages.back().module.ptr().get() : nullptr;
  const pl::LossFn loss = [&](const at::Tensor& x, const at::Tensor& y) {
    at::Tensor l = detail::in_precision(options_.autocast, device_.type(), [&] { return loss_(*last, x, y); });
    if (!l.defined() || l.numel() != 1)
      throw std::invalid_argument("ModuleTrainer: the loss function must return one value (the micro-batch's mean)");
    return l.reshape({}) * scale;
  };
  return pipeline_->step(b.input.to(device_), b.target.to(device_), loss) / scale;
}

// The global gradient norm over every chunk (DDP: each chunk's gradients
// are whole on every dp rank, so the squares add over pp; sharded: each
// rank's shards are its own, so they add over the world), clipped as torch
// clips: every gradient times max_norm / (norm + 1e-6) when that is below 1.
double ModuleTrainer::pipeline_clip(double max_norm) {
  at::Tensor sq = at::zeros({1}, at::kDouble);
  std::vector<at::Tensor> grads;
  for (const auto& p : opt_params_)
    if (p.grad().defined()) {
      grads.push_back(p.grad());
      sq += p.grad().to(at::kDouble).pow(2).sum();
    }
  const bool sharded = par_.stages.front().sharded != nullptr;
  (sharded ? *world_.group() : *par_.pp).all_reduce(sq, comm::ReduceOp::Sum).wait();
  const double norm = std::sqrt(sq.item<double>());
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
checkpoint::Layout ModuleTrainer::pipeline_layout() const {
  checkpoint::Layout out;
  int states = 0;
  for (const ModuleStage& st : par_.stages) {
    checkpoint::Layout l = st.sharded ? sharded_layout(*st.sharded)
                                      : checkpoint::replicated_layout(*st.module, par_.dp_rank == 0);
    out.strategy = l.strategy;
    append_chunk_layout(out, std::move(l), &states);
    for (const auto& item : st.module->named_buffers()) {
      const at::Tensor& b = item.value();
      if (!b.defined() || b.numel() == 0) continue;
      checkpoint::SlotPiece piece{item.key(), b.sizes().vec(), 0, 0, b.numel()};
      piece.saved = par_.dp_rank == 0;
      out.slots.push_back({b, -1, {piece}});
    }
  }
  out.mesh = "pp " + std::to_string(par_.pp->size()) + " x dp " + std::to_string(par_.dp_size);
  return out;
}

// Every parameter of the module, whole, in named_parameters() order: each
// chunk's from its pp rank (after its dp group gathered its shards).
std::vector<at::Tensor> ModuleTrainer::pipeline_full_parameters() {
  std::map<std::string, at::Tensor> mine;
  std::map<std::string, int> owner;
  for (const ModuleStage& st : par_.stages) {
    std::vector<at::Tensor> whole;
    if (st.sharded) whole = st.sharded->full_parameters();
    const auto named = st.module->named_parameters();
    for (size_t i = 0; i < named.size(); ++i)
      mine[named[i].key()] = st.sharded ? whole.at(i) : named[i].value().detach().clone();
  }
  // Which pp rank runs each child: chunk c runs on pp rank c % pp.
  for (int c = 0; c < par_.chunks; ++c)
    for (const auto& name : par_.chunk_children.at(static_cast<size_t>(c))) owner[name] = c % par_.pp->size();
  std::vector<at::Tensor> out;
  for (const auto& item : module_->named_parameters()) {
    const std::string child = item.key().substr(0, item.key().find('.'));
    const int root = owner.at(child);
    at::Tensor t = root == par_.pp->rank() ? mine.at(item.key()).contiguous()
                                           : at::empty(item.value().sizes(), item.value().options());
    par_.pp->broadcast(t, root).wait();
    out.push_back(t);
  }
  return out;
}

}  // namespace scaletrain::train

// A user's whole module under DDP or a sharded strategy (over tensor
// parallelism when the recipe split it), behind DataParallel (module_engine.h).
#include "scaletrain/train/module_engine.h"

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "scaletrain/optim/adamw.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/module_checkpointing.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

namespace fsdp = parallel::fsdp;

class WholeModuleEngine final : public ModuleEngine {
 public:
  explicit WholeModuleEngine(ModuleEngineSetup s) : s_(std::move(s)), par_(*s_.par) {}

  // Micro-batches in turn, all but the last under the engine's no_sync
  // (Note [Module trainer step]); returns the sum of their weighted losses.
  double step(const StepWork& work) override {
    const auto accum = static_cast<int64_t>(work.inputs.size());
    const int64_t uses_before = s_.options->activation_checkpointing ? checkpointed_uses(*s_.module) : 0;
    double sum = 0;
    for (int64_t k = 0; k < accum; ++k) {
      if (work.prepare) work.prepare(k);
      at::Tensor loss;
      {
        trace::Span span("forward", "forward micro-batch", k);
        loss = work.forward(k);
      }
      trace::Span span("backward", "backward micro-batch", k);
      if (k + 1 == accum) {
        loss.backward();  // reduces the accumulated gradients
      } else if (par_.ddp) {
        auto guard = par_.ddp->no_sync();
        loss.backward();
      } else {
        auto guard = par_.sharded->no_sync();
        loss.backward();
      }
      sum += loss.item<double>() / work.loss_scale;
    }
    // A policy nothing used would be accepted and ignored: every rank runs the same module, so all stop here.
    if (s_.options->activation_checkpointing && uses_before == 0 && checkpointed_uses(*s_.module) == 0)
      throw UsageError(
          "activation checkpointing is set but no selected submodule called train::checkpointed in the forward, so "
          "nothing would recompute: mark the blocks in the module's forward (Note [Checkpointing a user's module])");
    if (par_.tp) par_.tp->check();  // a collective that failed inside forward
    return sum;
  }
  std::vector<at::Tensor> optimizer_params() override { return par_.trainable(); }
  std::vector<int64_t> decay_numel() override {
    if (par_.sharded) return par_.sharded->shard_decay_numel();
    std::vector<int64_t> n;
    for (const auto& p : par_.trainable()) n.push_back(p.dim() >= 2 ? p.numel() : 0);
    return n;
  }
  double clip_grad_norm(double max_norm) override {
    if (par_.sharded && par_.tp) {  // a split parameter's squares add over tp, a replicated one counts once
      const parallel::tensor::TensorParallelPlan& plan = par_.tp->plan();
      return par_.sharded->clip_grad_norm(
          max_norm,
          fsdp::NormSplit{&par_.mesh->tp(), [&plan](const std::string& n) { return plan.layout(n).sharded(); }});
    }
    if (par_.sharded) return par_.sharded->clip_grad_norm(max_norm);
    if (par_.tp) return parallel::tensor::clip_grad_norm(par_.tp_norm, max_norm, par_.mesh->tp());
    return optim::clip_grad_norm(par_.trainable(), max_norm);
  }
  // Every rank checks for an overflow (sharded gradients differ by rank).
  std::vector<comm::Group*> grad_groups() override { return {s_.world->group().get()}; }
  void after_step() override {
    if (par_.sharded) par_.sharded->after_step();
  }
  void zero_grad() override {
    if (par_.ddp) par_.ddp->zero_grad();
    if (par_.sharded) par_.sharded->zero_grad();
  }
  double comm_wait_ms() const override { return par_.ddp ? par_.ddp->comm_wait_ms() : par_.sharded->comm_wait_ms(); }
  void reset_stats() override { par_.ddp ? par_.ddp->reset_stats() : par_.sharded->reset_stats(); }
  int64_t model_state_bytes() const override {
    if (par_.sharded) return par_.sharded->param_bytes() + par_.sharded->grad_bytes();
    int64_t b = 0;
    for (const auto& p : s_.module->parameters()) b += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
    return b;
  }
  void with_full_parameters(const std::function<void()>& fn) override {
    if (!par_.sharded) return fn();
    fsdp::ShardedDataParallel::FullParams full(*par_.sharded);
    fn();
  }
  std::string describe() const override {
    return "module trainer, " + to_string(s_.options->strategy) +
           (par_.tp ? ", tensor parallel x" + std::to_string(s_.options->tp) : "");
  }
  // What this rank holds, as pieces of the module's parameters (any layout
  // loads it), and the module's buffers (BatchNorm's running statistics):
  // each rank keeps its own, as in PyTorch; rank 0's are saved and every
  // rank loads them.
  checkpoint::Layout checkpoint_layout() const override {
    checkpoint::Layout l = par_.sharded ? sharded_layout(*par_.sharded)
                                        : checkpoint::replicated_layout(*s_.module, par_.dp_rank == 0);
    // Tensor parallel: the split parameters' pieces in the whole parameters'
    // coordinates, the replicated ones saved by tp rank 0 (any layout loads them).
    if (par_.tp) l = tensor_parallel_layout(std::move(l), par_.tp->plan());
    append_buffers(l, *s_.module, s_.world->rank() == 0);
    l.mesh = par_.replicate ? "dp_replicate " + std::to_string(par_.replicate->size()) + " x dp_shard " +
                                  std::to_string(par_.shard->size())
                            : "dp " + std::to_string(par_.dp_size);
    if (par_.tp) l.mesh += " x tp " + std::to_string(s_.options->tp);
    return l;
  }
  // Replicated strategies gather the loaded shards in the next forward.
  void after_load() override { after_step(); }
  std::vector<at::Tensor> full_parameters() override {
    std::vector<at::Tensor> out;
    if (par_.sharded) {
      out = par_.sharded->full_parameters();
    } else {
      for (const auto& p : s_.module->parameters()) out.push_back(p.detach().clone());
    }
    if (par_.tp)  // whole over dp; the pieces of split parameters joined over tp
      for (size_t i = 0; i < out.size(); ++i)
        out[i] = parallel::tensor::gather_parameter(out[i], par_.tp->plan().params.at(i), par_.mesh->tp());
    return out;
  }

 private:
  ModuleEngineSetup s_;
  ParallelModule& par_;
};

}  // namespace

std::unique_ptr<ModuleEngine> module_engine(const ModuleEngineSetup& setup) {
  return std::make_unique<WholeModuleEngine>(setup);
}

}  // namespace scaletrain::train

// fully_shard: the sharded engine over any torch::nn::Module, units chosen
// by a wrap policy (module_units.h) and gathered on use (gather_on_use.h).
#include <torch/csrc/autograd/graph_task.h>

#include <cstdio>
#include <stdexcept>

#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/ddp/ddp_comm.h"
#include "scaletrain/parallel/ddp/sync_batchnorm.h"
#include "scaletrain/parallel/fsdp/engine_state.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/fsdp/gather_on_use.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::fsdp {

namespace {

std::string unit_label(const std::string& name, size_t u) {
  return u == 0 ? "the root unit (the parameters outside every unit)" : "unit '" + name + "'";
}

// One device for every parameter, and no parameter already in an engine.
void check_module(const torch::nn::Module& module) {
  auto named = module.named_parameters();
  for (auto& item : named) {
    const at::Tensor& p = item.value();
    if (p.device() != named[0].value().device())
      throw std::invalid_argument("fully_shard: parameters on different devices: '" + named[0].key() + "' on " +
                                  named[0].value().device().str() + ", '" + item.key() + "' on " + p.device().str());
    if (p.has_storage() && GatherOnUse::claimed(p.storage().unsafeGetStorageImpl()))
      throw std::invalid_argument("fully_shard: parameter '" + item.key() +
                                  "' is already sharded by another engine (the module is wrapped twice)");
    if (DistributedDataParallel::reduces(p))
      throw std::invalid_argument("fully_shard: parameter '" + item.key() +
                                  "' is already in a live DDP (the module is wrapped twice)");
  }
  const std::string unbound = unbound_sync_batchnorm(module);
  if (!unbound.empty())
    throw std::invalid_argument("fully_shard: SyncBatchNorm '" + unbound +
                                "' is bound to no group: call convert_sync_batchnorm(module, group) first");
}

}  // namespace

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, const ModuleUnits& units,
                                         comm::World& world, comm::Group& shard, comm::Group* replicate,
                                         ShardedOptions options)
    : module_(std::move(module)), options_(options), state_(std::make_shared<State>()) {
  if (options_.wrap.policy != WrapPolicy::Transformer || !options_.wrap.layer_cls.empty())
    throw std::invalid_argument("fully_shard: units of a module are chosen by ModuleUnits, not options.wrap");
  if (options_.keep_root_between_backwards)
    throw std::invalid_argument("fully_shard: keep_root_between_backwards is for pipeline chunks");
  check_module(*module_);
  own_blocks_ = std::make_unique<ModuleBlocks>(select_units(*module_, units));
  blocks_ = own_blocks_.get();
  GatherOnUse::Quiet quiet;
  init(world, shard, replicate);
  // The parameters now live in the units' flat buffers: a layer split by
  // parallelize_module is found there (Note [Tensor parallelism under fully_shard]).
  tensor::tensor_parallel_weights_moved();
  // Buffers (BatchNorm's running statistics) start as rank 0's, as
  // PyTorch's sync_module_states does; after that each rank keeps its own.
  std::vector<at::Tensor> buffers = module_->buffers();
  if (options_.sync_module_states && !buffers.empty()) {
    ddp_comm::broadcast_coalesced(shard, buffers, 0);
    if (replicate != nullptr) ddp_comm::broadcast_coalesced(*replicate, buffers, 0);
  }
  // Note [Gather on use]: the units' flat buffers, by storage, and their
  // parameters, by tensor (the thread rule).
  State& s = *state_;
  s.user_module = true;
  for (size_t u = 0; u < s.units.size(); ++u)
    for (auto& f : s.units[u].flats) {
      s.unit_of_storage[f->params().front().storage().unsafeGetStorageImpl()] = u;
      for (size_t i = 0; i < f->params().size(); ++i)
        s.param_of[f->params()[i].unsafeGetTensorImpl()] = {u, f->names()[i]};
    }
  std::weak_ptr<State> weak = state_;
  GatherOnUse::Hooks hooks;
  hooks.unit_of = [weak](const c10::StorageImpl* storage) -> int64_t {
    auto st = weak.lock();
    if (!st) return -1;
    auto it = st->unit_of_storage.find(storage);
    return it == st->unit_of_storage.end() ? -1 : static_cast<int64_t>(it->second);
  };
  hooks.use = [weak](size_t u) {
    if (auto st = weak.lock()) st->use_unit(u);
  };
  hooks.foreign = [weak](const at::Tensor& t) {
    if (auto st = weak.lock()) st->note_foreign_use(t);
  };
  s.make_spent_markers();
  hooks.read = [weak](const c10::StorageImpl* storage, const char* op) {
    if (auto st = weak.lock()) st->note_spent_read(storage, op);
  };
  gather_on_use_ = std::make_unique<GatherOnUse>(std::move(hooks));
}

std::unique_ptr<ShardedDataParallel> fully_shard(std::shared_ptr<torch::nn::Module> module, comm::World& world,
                                                 comm::Group& shard, const ModuleUnits& units, ShardedOptions options,
                                                 comm::Group* replicate) {
  return std::make_unique<ShardedDataParallel>(std::move(module), units, world, shard, replicate, options);
}

// Note [Gather on use]: an operator is about to read unit u's buffer.
void ShardedDataParallel::State::use_unit(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mu);
  if (summoned) return;
  Unit& unit = units[u];
  const bool backward = torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr;
  const bool ready = !unit.gathering && (replicated() ? !unit.stale : unit.unsharded());
  size_t& current = backward ? backward_unit : forward_unit;
  const bool moved = u != 0 && u != current;
  if (moved && !backward && forward_unit != 0 && engine::reshard_after_forward(options.sharding))
    reshard(forward_unit);  // forward moved on to another unit: the one before it is done
  if (moved) current = u;
  if (!backward && unit.spent_grads) clear_spent_grads(unit);
  if (!ready) {
    if (unit.gathering) ++stats.prefetched;
    if (backward) begin_backward();
    unshard(u);
  }
  if (!moved) return;
  if (backward && options.backward_prefetch == BackwardPrefetch::Pre) prefetch(u - 1, -1);
  if (!backward && (options.forward_prefetch || replicated())) prefetch(u + 1, +1);
}

// Note [Gather on use], the thread rule: an operator on a thread that does
// not carry the engine's callback read `t`. Runs on that thread, under the
// registry's lock: notes the first such read and says so, never throws.
void ShardedDataParallel::State::note_foreign_use(const at::Tensor& t) {
  auto it = param_of.find(t.unsafeGetTensorImpl());
  if (it == param_of.end()) return;
  std::lock_guard<std::mutex> lock(foreign_mu);
  if (!foreign_use.empty()) return;
  foreign_use = "parameter '" + it->second.second + "' of " +
                unit_label(units[it->second.first].name, it->second.first) +
                " was read on a thread other than the one that called fully_shard; units are gathered only "
                "there (Note [Gather on use]): run the module's forward and backward on the thread that called "
                "fully_shard";
  std::fprintf(stderr, "scaletrain: fully_shard: %s (the engine's next call throws this)\n", foreign_use.c_str());
}

// Note [Spent gradients]: the optimizer must step engine->shards(), and a
// PyTorch habit builds it over module->parameters() (before fully_shard, or
// after). Those parameters get no gradient: each unit's are reduce-scattered
// into the shards, so an optimizer over them skips every one (a .grad that
// is undefined), the model never changes, and nothing says so (after_step(),
// which would notice, is the same habit's other omission). So once a unit's
// gradients are reduced, each of its trainable parameters gets as .grad a
// marker of its own: a zero of one element, whose storage names the
// parameter. An operator on the engine's thread that reads a marker (the
// optimizer's step, a clip or a norm over module->parameters()) is noted
// with one line on stderr, and the engine's next call throws it (the end of
// the next backward, zero_grad(), after_step(), clip_grad_norm()): reads
// that only clear a gradient (detach, zero_: libtorch's zero_grad()s) pass.
// The first read of a unit in the next forward takes the markers away,
// before any backward can accumulate into them. A marker is a zero, so the
// step it slips into changes nothing, as before.
void ShardedDataParallel::State::make_spent_markers() {
  for (auto& unit : units)
    for (auto& f : unit.flats) {
      if (!f->trainable()) continue;
      for (size_t i = 0; i < f->params().size(); ++i) {
        const at::Tensor& p = f->params()[i];
        at::Tensor marker = at::zeros({}, p.options().requires_grad(false));
        spent_param[marker.storage().unsafeGetStorageImpl()] = f->names()[i];
        spent_marker[p.unsafeGetTensorImpl()] = std::move(marker);
      }
    }
}

void ShardedDataParallel::State::mark_grads_spent(size_t u) {
  for (auto& f : units[u].flats)
    if (f->trainable())
      for (const at::Tensor& p : f->params()) p.mutable_grad() = spent_marker.at(p.unsafeGetTensorImpl());
  units[u].spent_grads = true;
}

void ShardedDataParallel::State::clear_spent_grads(Unit& unit) {
  unit.spent_grads = false;
  for (auto& f : unit.flats)
    if (f->trainable())
      for (const at::Tensor& p : f->params())
        if (p.grad().defined() && p.grad().is_alias_of(spent_marker.at(p.unsafeGetTensorImpl())))
          p.mutable_grad().reset();  // the marker, or a detached alias of it (Module::zero_grad)
}

void ShardedDataParallel::State::note_spent_read(const c10::StorageImpl* storage, const char* op) {
  auto it = spent_param.find(storage);
  if (it == spent_param.end()) return;
  std::string name = op;
  if (name.rfind("aten::", 0) == 0) name = name.substr(6);
  if (name == "detach" || name == "detach_" || name == "zero_") return;  // clearing, not reading
  std::lock_guard<std::mutex> lock(foreign_mu);
  if (!spent_read.empty()) return;
  spent_read = "the gradient of parameter '" + it->second + "' was read through the module (" + name +
               ": an optimizer, a clip or a norm over module->parameters()), but under fully_shard the gradients "
               "are reduce-scattered into engine->shards() and the module's parameters hold none: build the "
               "optimizer over engine->shards(), clip with engine->clip_grad_norm() (Note [Spent gradients])";
  std::fprintf(stderr, "scaletrain: fully_shard: %s (the engine's next call throws this)\n", spent_read.c_str());
}

// Note [Units that took no part]: a unit can get no gradient in a step:
// forward skipped its submodule (an auxiliary head run every other step, a
// branch some inputs take) or its output did not reach the loss. The engine
// cannot leave it without one: its gradient shard comes from a
// reduce-scatter every rank joins, so the end of backward reduces zeros for
// it, and the optimizer steps it with a zero gradient. One process differs
// by convention: torch::optim skips a parameter whose .grad is undefined
// (one that never had a gradient; after PyTorch's zero_grad(set_to_none),
// and PyTorch's FSDP leaves an unused flat parameter so), while libtorch
// 1.13's zero_grad() zeroes .grad, so there a parameter that had one is
// stepped with zeros, as here. Under Adam the two differ: a zero gradient
// still counts a step, the moments keep moving the unit, weight decay
// shrinks it. And a unit forward left out is most often a mistake. So by
// default the end of a synchronized backward throws UsageError naming the
// units, after its collectives and bookkeeping are complete (the ranks stay
// in step, the engine stays usable), and after_step() throws it again until
// zero_grad() discards the step's gradients. Gradients are counted over the
// step (no_sync micro-batches included), and on this rank: a unit another
// rank used and this one skipped is an error here too, although its zeros
// are then the right contribution; allow_unused_units accepts zero
// gradients for all these cases. A unit some of whose parameters got a
// gradient is not flagged: the others get zeros, as PyTorch's FSDP gives a
// partly used flat parameter.
void ShardedDataParallel::State::end_user_backward() {
  if (sync) {
    std::string names;
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].trainable > 0 && !units[u].grad_seen)
        names += (names.empty() ? "" : ", ") + unit_label(units[u].name, u);
      units[u].grad_seen = false;
    }
    if (!names.empty() && !options.allow_unused_units)
      unused_units = names +
                     " took no part in this step: none of its trainable parameters got a gradient (forward did not "
                     "use it on this rank, or its output did not reach the loss), and the optimizer would step it "
                     "with zero gradients. Every unit must take part in each step's forward: call it, freeze its "
                     "parameters (requires_grad false before fully_shard), or set "
                     "ShardedOptions::allow_unused_units to accept zero gradients (Note [Units that took no part])";
  }
  check_user_rules("backward");
}

void ShardedDataParallel::State::check_user_rules(const char* where) {
  if (!user_module) return;
  std::string foreign;
  {
    std::lock_guard<std::mutex> lock(foreign_mu);
    foreign.swap(foreign_use);  // reported once
  }
  if (!foreign.empty()) throw UsageError(std::string(where) + ": fully_shard: " + foreign);
  {
    std::lock_guard<std::mutex> lock(foreign_mu);
    foreign.swap(spent_read);  // reported once
  }
  if (!foreign.empty()) throw UsageError(std::string(where) + ": fully_shard: " + foreign);
  if (!unused_units.empty()) throw UsageError(std::string(where) + ": fully_shard: " + unused_units);
}

}  // namespace scaletrain::parallel::fsdp

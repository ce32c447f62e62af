// fully_shard: the sharded engine over any torch::nn::Module, units chosen
// by a wrap policy (module_units.h) and gathered on use (gather_on_use.h).
#include <torch/csrc/autograd/graph_task.h>

#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

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

// The live fully_shard engines, by the module each holds (Note [Nested fully_shard]).
std::mutex g_live_mu;
std::unordered_map<const torch::nn::Module*, ShardedDataParallel*>& live_engines() {
  static std::unordered_map<const torch::nn::Module*, ShardedDataParallel*> m;
  return m;
}

// What a child engine's options must share with its parent's call: the
// parent's engine runs every unit with its own options.
std::string options_differ(const ShardedOptions& a, const ShardedOptions& b) {
  auto same = [](bool x, bool y) { return x == y; };
  if (a.sharding != b.sharding) return "sharding " + to_string(a.sharding) + " and " + to_string(b.sharding);
  if (a.master_dtype != b.master_dtype || a.reduce_dtype != b.reduce_dtype || a.grad_dtype != b.grad_dtype)
    return "master, reduce or gradient dtypes";
  if (a.backward_prefetch != b.backward_prefetch || a.forward_prefetch != b.forward_prefetch ||
      a.limit_all_gathers != b.limit_all_gathers || a.prefetch_bytes != b.prefetch_bytes ||
      a.max_live_numel != b.max_live_numel || a.max_inflight_reduces != b.max_inflight_reduces ||
      a.allgather_bucket_numel != b.allgather_bucket_numel)
    return "prefetching or communication limits";
  if (a.allow_unused_units != b.allow_unused_units) return "allow_unused_units";
  if (!same(static_cast<bool>(a.offload_alloc), static_cast<bool>(b.offload_alloc)) ||
      a.offload_params != b.offload_params)
    return "offloading";
  if (!same(a.fp8_reduce.has_value(), b.fp8_reduce.has_value()) ||
      !same(a.fp8_gather.has_value(), b.fp8_gather.has_value()))
    return "FP8 communication";
  if (static_cast<bool>(a.expert_param) || static_cast<bool>(a.deferred_init) ||
      static_cast<bool>(a.deferred_slice_init))
    return "experts or deferred initialization (give them to the parent's call only)";
  return "";
}

}  // namespace

ShardedDataParallel::State& ShardedDataParallel::st() const {
  if (!state_) throw UsageError("fully_shard: " + absorbed_);
  return *state_;
}

// Note [Nested fully_shard]: FSDP2's habit is fully_shard(block) for each
// block, then fully_shard(model); each call marks a module, and the model's
// call makes the blocks units of one engine. Here each call returns a
// working engine (a block trained alone works), so the model's call finds
// the live engines over its submodules (registration order, the same on
// every rank), checks that they share its groups and options (one engine
// runs every unit one way), has each give its module back (its parameters
// gathered whole into tensors of their own: a collective, one block at a
// time) and adds each block to its units by name. The blocks' engines are
// then empty: any call on one is a UsageError that says which call absorbed
// it, and their hooks are gone with their state. A block engine with units
// of its own cannot become one unit (units do not nest): refused. The cost
// is one gather of each block at the model's call, before any step.
ModuleUnits ShardedDataParallel::absorb_children(const ModuleUnits& units, comm::Group& shard,
                                                 comm::Group* replicate) {
  std::vector<std::pair<std::string, ShardedDataParallel*>> children;
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
      auto it = live_engines().find(item.value().get());
      if (it != live_engines().end()) children.emplace_back(item.key(), it->second);
    }
  }
  ModuleUnits out = units;
  for (auto& [name, child] : children) {
    const std::string what = "fully_shard: submodule '" + name + "' is under fully_shard already, ";
    if (child->st().shard != &shard || child->st().replicate != replicate)
      throw std::invalid_argument(what + "over other groups than this call's: give both calls the same groups");
    const std::string differ = options_differ(child->options_, options_);
    if (!differ.empty())
      throw std::invalid_argument(what + "with other options (" + differ +
                                  "): one engine runs every unit one way, so give both calls the same options");
    if (child->num_units() > 1)
      throw std::invalid_argument(what + "with units of its own (" + child->unit_names()[1] +
                                  ", ...), and units do not nest: shard the submodule with one call and no units");
  }
  for (auto& [name, child] : children) {
    child->give_back_module(name);
    out.names.push_back(name);
  }
  return out;
}

void ShardedDataParallel::give_back_module(const std::string& name) {
  std::vector<at::Tensor> whole = full_parameters();  // collective, in named_parameters() order
  {
    torch::NoGradGuard no_grad;
    auto params = module_->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(whole[i]);
  }
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    live_engines().erase(module_.get());
  }
  gather_on_use_.reset();
  state_.reset();  // the hooks hold it weakly: they do nothing from now on
  absorbed_ = "the engine of submodule '" + name +
              "' was taken in by fully_shard of a module holding it (Note [Nested fully_shard]): use the engine "
              "that call returned";
}

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, const ModuleUnits& units,
                                         comm::World& world, comm::Group& shard, comm::Group* replicate,
                                         ShardedOptions options)
    : module_(std::move(module)), options_(options), state_(std::make_shared<State>()) {
  if (options_.wrap.policy != WrapPolicy::Transformer || !options_.wrap.layer_cls.empty())
    throw std::invalid_argument("fully_shard: units of a module are chosen by ModuleUnits, not options.wrap");
  if (options_.keep_root_between_backwards)
    throw std::invalid_argument("fully_shard: keep_root_between_backwards is for pipeline chunks");
  const ModuleUnits all = absorb_children(units, shard, replicate);
  check_module(*module_);
  own_blocks_ = std::make_unique<ModuleBlocks>(select_units(*module_, all));
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
  hooks.read = [weak, spent = s.spent_units](const c10::StorageImpl* storage, const char* op) {
    if (spent->load(std::memory_order_relaxed) == 0) return;  // the hot path: no markers out
    if (auto st = weak.lock()) st->note_spent_read(storage, op);
  };
  gather_on_use_ = std::make_unique<GatherOnUse>(std::move(hooks));
  std::lock_guard<std::mutex> lock(g_live_mu);
  live_engines()[module_.get()] = this;
}

ShardedDataParallel::~ShardedDataParallel() {
  {
    std::lock_guard<std::mutex> lock(g_live_mu);
    auto it = live_engines().find(module_.get());
    if (it != live_engines().end() && it->second == this) live_engines().erase(it);
  }
  gather_on_use_.reset();
  blocks_->set_block_runner(nullptr);
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
  if (!units[u].spent_grads) spent_units->fetch_add(1, std::memory_order_relaxed);
  units[u].spent_grads = true;
}

void ShardedDataParallel::State::clear_spent_grads(Unit& unit) {
  unit.spent_grads = false;
  spent_units->fetch_sub(1, std::memory_order_relaxed);
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

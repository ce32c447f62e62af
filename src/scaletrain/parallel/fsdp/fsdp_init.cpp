// The sharded engine's construction: the strategy names, the groups it runs
// over, its units and flat buffers (deferred initialization included), its
// hooks, and what it reports it holds. The hooks and the step API are in
// fsdp.cpp, the engine's state in engine_state.h.
#include "scaletrain/parallel/fsdp/fsdp.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "scaletrain/comm/compat.h"
#include "scaletrain/parallel/ddp/ddp_comm.h"
#include "scaletrain/parallel/fsdp/engine_state.h"
#include "scaletrain/parallel/fsdp/flat_param.h"
#include "scaletrain/parallel/fsdp/gather_on_use.h"

namespace scaletrain::parallel::fsdp {

using engine::replicated_params;
using engine::Slot;
using engine::Unit;

Sharding parse_sharding(const std::string& s) {
  if (s == "zero1") return Sharding::Zero1;
  if (s == "zero2") return Sharding::Zero2;
  if (s == "zero3") return Sharding::Zero3;
  if (s == "FULL_SHARD") return Sharding::FullShard;
  if (s == "SHARD_GRAD_OP") return Sharding::ShardGradOp;
  if (s == "HYBRID_SHARD") return Sharding::HybridShard;
  throw std::invalid_argument("unknown sharding '" + s +
                              "' (zero1 | zero2 | zero3 | FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD)");
}

std::string to_string(Sharding s) {
  switch (s) {
    case Sharding::Zero1:
      return "zero1";
    case Sharding::Zero2:
      return "zero2";
    case Sharding::Zero3:
      return "zero3";
    case Sharding::FullShard:
      return "FULL_SHARD";
    case Sharding::ShardGradOp:
      return "SHARD_GRAD_OP";
    case Sharding::HybridShard:
      return "HYBRID_SHARD";
  }
  return "?";
}

BackwardPrefetch parse_backward_prefetch(const std::string& s) {
  if (s == "BACKWARD_PRE") return BackwardPrefetch::Pre;
  if (s == "BACKWARD_POST") return BackwardPrefetch::Post;
  if (s == "NONE" || s == "NO_PREFETCH") return BackwardPrefetch::None;
  throw std::invalid_argument("unknown backward_prefetch '" + s + "' (BACKWARD_PRE | BACKWARD_POST | NONE)");
}

ShardedDataParallel::ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, interfaces::Blockwise& blocks,
                                         comm::World& world, comm::Group& shard, comm::Group* replicate,
                                         ShardedOptions options)
    : module_(std::move(module)), blocks_(&blocks), options_(options), state_(std::make_shared<State>()) {
  init(world, shard, replicate);
}

namespace {

using State = ShardedDataParallel::State;
using NamedParams = torch::OrderedDict<std::string, at::Tensor>;
// key: (dtype, trainable, FP8-gathered, expert) -> (decayed, not decayed) indices into `named`
using ParamGroups = std::map<std::tuple<int, bool, bool, bool>, std::pair<std::vector<size_t>, std::vector<size_t>>>;

bool is_expert(const State& s, const ShardedOptions& options, const std::string& name) {
  return s.expert_shard != nullptr && options.expert_param(name);
}

// The groups the engine runs over, checked against the strategy, and its own
// reduce groups (Note [Unit order]).
void init_groups(State& s, const ShardedOptions& options, comm::World& world, comm::Group& shard,
                 comm::Group* replicate) {
  s.options = options;
  s.shard = &shard;
  if (options.sharding == Sharding::HybridShard) {
    if (replicate == nullptr) throw std::invalid_argument("HYBRID_SHARD needs a replicate group");
    s.replicate = replicate;
  } else if (replicate != nullptr && replicate->size() > 1) {
    throw std::invalid_argument(to_string(options.sharding) +
                                " shards over one group; use HYBRID_SHARD to replicate across another");
  }
  if (options.max_inflight_reduces < 1) throw std::invalid_argument("max_inflight_reduces must be at least 1");
  // Every engine gets its own reduce group; members create engines in the
  // same order, so the number agrees across them.
  const std::string instance = std::to_string(world.next_instance("sharded"));
  s.grads_group = world.new_group(shard.name() + "/grads/" + instance, shard.ranks());
  if (static_cast<bool>(options.expert_param) != (options.expert_shard != nullptr))
    throw std::invalid_argument("sharded data parallel: expert_param and expert_shard go together");
  if (options.expert_shard != nullptr) {  // Note [Experts in the sharded engine]
    if (options.sharding == Sharding::HybridShard)
      throw std::invalid_argument("HYBRID_SHARD does not shard experts; use FULL_SHARD or SHARD_GRAD_OP");
    s.expert_shard = options.expert_shard;
    s.expert_grads_group = world.new_group(s.expert_shard->name() + "/grads/" + instance, s.expert_shard->ranks());
  }
}

// Rank 0's weights everywhere (over the shard group, then across replicas);
// an expert's from the first rank of its expert-data group.
void broadcast_weights(const State& s, const ShardedOptions& options, comm::Group& shard, const NamedParams& named) {
  std::vector<at::Tensor> shared, experts;
  for (auto& item : named) (is_expert(s, options, item.key()) ? experts : shared).push_back(item.value());
  ddp_comm::broadcast_coalesced(shard, shared, 0);
  if (s.replicate) ddp_comm::broadcast_coalesced(*s.replicate, shared, 0);
  if (!experts.empty()) ddp_comm::broadcast_coalesced(*s.expert_shard, experts, 0);
}

// The wrap policy over blocks, the rest in the root: fills the units, the
// block-to-unit map and the reduce order; returns each parameter's block
// (-1: the root's).
std::vector<int64_t> plan_engine_units(State& s, interfaces::Blockwise& blocks, const ShardedOptions& options,
                                       const NamedParams& named) {
  const int64_t nblocks = blocks.num_blocks();
  std::vector<int64_t> block_numel(static_cast<size_t>(nblocks), 0);
  std::vector<int64_t> block_of_param;
  for (auto& item : named) {
    int64_t b = -1;
    for (int64_t i = 0; i < nblocks && b < 0; ++i)
      if (item.key().rfind(blocks.block_prefix(i), 0) == 0) b = i;
    block_of_param.push_back(b);
    if (b >= 0) block_numel[static_cast<size_t>(b)] += item.value().numel();
  }
  const std::vector<UnitPlan> plan = plan_units(blocks, block_numel, options.wrap);
  s.units.resize(plan.size() + 1);
  s.units[0].name = "root";
  s.unit_of_block.assign(static_cast<size_t>(nblocks), 0);
  for (size_t u = 0; u < plan.size(); ++u) {
    s.units[u + 1].name = plan[u].name;
    s.units[u + 1].first_block = plan[u].first_block;
    s.units[u + 1].last_block = plan[u].last_block;
    for (int64_t b = plan[u].first_block; b <= plan[u].last_block; ++b) s.unit_of_block[static_cast<size_t>(b)] = u + 1;
  }
  for (size_t u = s.units.size(); u-- > 1;) s.reduce_order.push_back(u);
  s.reduce_order.push_back(0);
  return block_of_param;
}

// Unit u's parameters by the flat buffer they go to, decayed matrices first.
ParamGroups group_unit_params(const State& s, const ShardedOptions& options, const NamedParams& named,
                              const std::vector<int64_t>& block_of_param, size_t u) {
  ParamGroups groups;
  for (size_t i = 0; i < named.size(); ++i) {
    const int64_t b = block_of_param[i];
    const size_t owner = b < 0 ? 0 : s.unit_of_block[static_cast<size_t>(b)];
    if (owner != u) continue;
    const at::Tensor& p = named[i].value();
    const bool fp8 =
        options.fp8_gather && p.requires_grad() && options.fp8_gather_param && options.fp8_gather_param(named[i].key());
    auto& g =
        groups[{static_cast<int>(p.scalar_type()), p.requires_grad(), fp8, is_expert(s, options, named[i].key())}];
    (p.requires_grad() && p.dim() >= 2 ? g.first : g.second).push_back(i);
  }
  return groups;
}

// One flat buffer of unit u, of the parameters of one group; records where
// each parameter went and, for trainable ones, their hook slots.
void add_flat(State& s, const ShardedOptions& options, comm::Group& shard, const NamedParams& named, size_t u,
              const ParamGroups::value_type& group, FlatParamOptions& fo, bool deferred, std::vector<Slot>& where) {
  Unit& unit = s.units[u];
  const auto& [key_fp8, members] = group;
  const std::pair<int, bool> key{std::get<0>(key_fp8), std::get<1>(key_fp8)};
  fo.fp8_gather = std::get<2>(key_fp8) ? options.fp8_gather : std::nullopt;
  fo.grad_dtype = key.second ? options.grad_dtype : at::ScalarType::Undefined;
  const bool expert = std::get<3>(key_fp8);
  comm::Group& flat_group = expert ? *s.expert_shard : shard;
  fo.reduce_group = expert ? s.expert_grads_group.get() : s.grads_group.get();
  fo.grad_scale = expert ? options.expert_scale : 1.0;
  std::vector<size_t> order = members.first;
  order.insert(order.end(), members.second.begin(), members.second.end());
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (size_t i : order) {
    names.push_back(named[i].key());
    params.push_back(named[i].value());
  }
  // Frozen flats are never updated: their shard stays in the parameter
  // dtype (a uint8 NF4 flat must not become fp32, nor a bf16 one double).
  fo.master_dtype = options.master_dtype == at::ScalarType::Undefined || !key.second ? params.front().scalar_type()
                                                                                     : options.master_dtype;
  // Note [Offloaded shards]: optimizer offload moves what the optimizer
  // steps; parameter offload moves every shard.
  const bool offload = options.offload_alloc && (key.second || options.offload_params);
  fo.offload_alloc = offload ? options.offload_alloc : nullptr;
  fo.gather_from_host = offload && options.offload_params;
  fo.read_ahead = fo.gather_from_host && options.read_ahead;
  unit.flats.push_back(
      std::make_unique<FlatParam>(unit.name, names, params, members.first.size(), flat_group, fo, deferred));
  for (size_t j = 0; j < order.size(); ++j) where[order[j]] = {u, unit.flats.size() - 1, j};
  if (key.second) {
    for (size_t j = 0; j < params.size(); ++j) s.slots.push_back({u, unit.flats.size() - 1, j});
    unit.trainable += static_cast<int>(params.size());
  }
}

// Flat buffers per unit: one per (dtype, trainable), decayed matrices first.
// Returns every parameter's place, for deferred init.
std::vector<Slot> build_flats(State& s, const ShardedOptions& options, comm::Group& shard, const NamedParams& named,
                              const std::vector<int64_t>& block_of_param, bool deferred) {
  FlatParamOptions fo;
  fo.replicated_params = replicated_params(options.sharding);
  fo.keep_full_grads = options.sharding == Sharding::Zero1;
  fo.reduce_dtype = options.reduce_dtype;
  fo.fp8_reduce = options.fp8_reduce;
  if (options.fp8_gather && replicated_params(options.sharding))
    throw std::invalid_argument(to_string(options.sharding) +
                                " keeps parameters whole: FP8 weight gathers need "
                                "sharded parameters");
  std::vector<Slot> where(named.size());
  for (size_t u = 0; u < s.units.size(); ++u) {
    const ParamGroups groups = group_unit_params(s, options, named, block_of_param, u);
    for (const auto& group : groups) add_flat(s, options, shard, named, u, group, fo, deferred, where);
    Unit& unit = s.units[u];
    unit.pending = unit.trainable;
    for (auto& f : unit.flats) {
      unit.numel += f->padded_numel();
      unit.bytes += f->padded_numel() * static_cast<int64_t>(f->params().front().element_size());
    }
  }
  return where;
}

// Deferred initialization: fills the shards from deferred_slice_init or
// deferred_init, then optimizer offload's device copies of those values.
void load_deferred(State& s, const ShardedOptions& options, comm::Group& shard, const NamedParams& named,
                   const std::vector<Slot>& where, bool deferred) {
  if (options.deferred_slice_init) {
    // Each rank reads its own part of each parameter: the peak is the shards.
    for (size_t i = 0; i < named.size(); ++i)
      s.units[where[i].unit].flats[where[i].flat]->load_param_slice(where[i].index, options.deferred_slice_init);
  } else if (deferred) {
    // One parameter at a time: the peak is the shards plus one tensor. An
    // expert comes from the first rank of its expert-data group.
    const bool source = shard.rank() == 0 && (s.replicate == nullptr || s.replicate->rank() == 0);
    for (size_t i = 0; i < named.size(); ++i) {
      const at::Tensor& p = named[i].value();
      at::Tensor value = at::empty(p.sizes(), p.options().requires_grad(false));
      const bool expert = is_expert(s, options, named[i].key());
      if ((expert ? s.expert_shard->rank() == 0 : source) || !options.sync_module_states)
        options.deferred_init(named[i].key(), value);
      if (options.sync_module_states && expert) {
        s.expert_shard->broadcast(value, 0).wait();
      } else if (options.sync_module_states) {
        shard.broadcast(value, 0).wait();
        if (s.replicate) s.replicate->broadcast(value, 0).wait();
      }
      s.units[where[i].unit].flats[where[i].flat]->load_param(where[i].index, value);
    }
  }
  if (deferred)  // optimizer offload's device copies of the values just loaded
    for (auto& unit : s.units)
      for (auto& f : unit.flats) f->refresh_device_copy();
}

// Hooks: after each gradient's accumulation, and around every block.
void install_hooks(const std::shared_ptr<State>& state, interfaces::Blockwise& blocks) {
  State& s = *state;
  std::weak_ptr<State> weak = state;
  for (size_t k = 0; k < s.slots.size(); ++k) {
    const Slot& sl = s.slots[k];
    const at::Tensor& p = s.units[sl.unit].flats[sl.flat]->params()[sl.index];
    auto acc = torch::autograd::impl::grad_accumulator(p);
    acc->add_post_hook(comm::compat::post_hook([weak, k] {
      if (auto st = weak.lock()) st->on_grad_ready(k);
    }));
    s.accumulators.push_back(std::move(acc));
  }
  blocks.set_block_runner([weak](int64_t i, const interfaces::BlockBody& body, const at::Tensor& x) {
    if (auto st = weak.lock()) return st->run_block(i, body, x);
    return body(x);
  });
}

}  // namespace

void ShardedDataParallel::init(comm::World& world, comm::Group& shard, comm::Group* replicate) {
  State& s = *state_;
  init_groups(s, options_, world, shard, replicate);

  // 1. Rank 0's weights everywhere (unless deferred init fills the shards).
  auto named = module_->named_parameters();
  const bool deferred = static_cast<bool>(options_.deferred_init) || static_cast<bool>(options_.deferred_slice_init);
  if (options_.sync_module_states && !deferred) broadcast_weights(s, options_, shard, named);

  // 2. Units: the wrap policy over blocks, the rest in the root.
  const std::vector<int64_t> block_of_param = plan_engine_units(s, *blocks_, options_, named);

  // 3. Flat buffers per unit: one per (dtype, trainable), decayed matrices first.
  const std::vector<Slot> where = build_flats(s, options_, shard, named, block_of_param, deferred);
  if (s.slots.empty()) throw std::invalid_argument("sharded data parallel: the module has no trainable parameters");
  load_deferred(s, options_, shard, named, where, deferred);
  s.refresh_fp8_scales();

  // 4. Hooks: after each gradient's accumulation, and around every block.
  install_hooks(state_, *blocks_);
}

std::vector<ShardedDataParallel::ShardView> ShardedDataParallel::shard_views() const {
  std::vector<ShardView> out;
  for (bool trainable : {true, false})
    for (auto& unit : st().units)
      for (auto& f : unit.flats)
        if (f->trainable() == trainable) out.push_back({f->shard(), trainable, f->pieces()});
  return out;
}

int ShardedDataParallel::replica_rank() const { return st().replicate ? st().replicate->rank() : 0; }

int ShardedDataParallel::num_units() const { return static_cast<int>(st().units.size()); }

std::vector<std::string> ShardedDataParallel::unit_names() const {
  std::vector<std::string> out;
  for (auto& u : st().units) out.push_back(u.name);
  return out;
}

int64_t ShardedDataParallel::param_bytes() const {
  int64_t b = 0;
  for (auto& unit : st().units)
    for (auto& f : unit.flats) b += f->param_bytes();
  return b;
}

int64_t ShardedDataParallel::offloaded_bytes() const {
  int64_t b = 0;
  for (auto& unit : st().units)
    for (auto& f : unit.flats) b += f->offloaded_bytes();
  return b;
}

int64_t ShardedDataParallel::grad_bytes() const {
  int64_t b = 0;
  for (auto& unit : st().units)
    for (auto& f : unit.flats) b += f->grad_bytes();
  return b;
}

double ShardedDataParallel::comm_wait_ms() const { return st().wait_ms; }
ShardedDataParallel::Stats ShardedDataParallel::stats() const { return st().stats; }
void ShardedDataParallel::reset_stats() {
  st().wait_ms = 0;
  st().stats = {};
}

int ShardedDataParallel::stale_units() const {
  int n = 0;
  for (auto& unit : st().units) n += unit.stale ? 1 : 0;
  return n;
}

}  // namespace scaletrain::parallel::fsdp

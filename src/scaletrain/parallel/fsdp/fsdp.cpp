// The sharded engine's hooks (gathers, prefetches, the backward's reduces,
// Note [Step protocol]) and its step API: forward, gradients, the optimizer's
// shards, after_step, FullParams. Its construction is in fsdp_init.cpp, its
// state in engine_state.h, user modules' path in fully_shard.cpp.
#include "scaletrain/parallel/fsdp/fsdp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/fsdp/engine_state.h"
#include "scaletrain/parallel/fsdp/flat_param.h"
#include "scaletrain/parallel/fsdp/gather_on_use.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::fsdp {

using engine::ms_since;
using engine::Slot;
using engine::Unit;
using engine::replicated_params;
using engine::reshard_after_forward;

void ShardedDataParallel::State::start_unshard(size_t u) {
  Unit& unit = units[u];
  if (unit.gathering) return;
  if (replicated()) {
    if (!unit.stale) return;
    for (auto& f : unit.flats)
      if (f->trainable())  // frozen parameters never change
        for (auto& w : f->start_refresh_replicated(options.allgather_bucket_numel)) unit.gathers.push_back(std::move(w));
    unit.stale = false;
  } else {
    if (unit.unsharded()) return;
    for (auto& f : unit.flats) unit.gathers.push_back(f->start_unshard(exact_gathers));
    // File-backed shards of the units next in either direction (Note [Offloaded shards]).
    for (size_t v : {u + 1, u - 1})
      if (v < units.size())
        for (auto& f : units[v].flats) f->read_ahead();
  }
  unit.gathering = true;
  stats.all_gathers += static_cast<int64_t>(unit.gathers.size());
  int in_flight = 0;
  for (auto& v : units) in_flight += v.gathering ? 1 : 0;
  stats.max_gathers_in_flight = std::max(stats.max_gathers_in_flight, in_flight);
  if (!replicated()) stats.peak_gathered_numel = std::max(stats.peak_gathered_numel, live_numel());
}

int64_t ShardedDataParallel::State::live_numel() const {
  int64_t n = 0;
  for (auto& unit : units)
    if (unit.gathering || unit.unsharded()) n += unit.numel;
  return n;
}

void ShardedDataParallel::State::refresh_fp8_scales() {
  if (!options.fp8_gather) return;
  // Each buffer's amax is agreed over the group it is sharded over: the
  // shard group, then (Note [Experts in the sharded engine]) the experts'.
  for (comm::Group* group : {shard, expert_shard}) {
    if (group == nullptr) continue;
    std::vector<FlatParam*> flats;
    std::vector<double> amax;
    for (auto& unit : units)
      for (auto& f : unit.flats)
        if (f->fp8_gathered() && &f->group() == group) {
          flats.push_back(f.get());
          for (double a : f->fp8_local_amax()) amax.push_back(a);
        }
    if (flats.empty()) continue;
    at::Tensor t = at::tensor(amax, at::TensorOptions().dtype(at::kDouble));
    // NaN would be lost by MAX on some backends: it goes as infinity, which
    // keeps the previous scale all the same (Note [FP8 scaling] in precision/fp8.h).
    t = at::nan_to_num(t, std::numeric_limits<double>::infinity()).to(flats.front()->shard().device());
    group->all_reduce(t, comm::ReduceOp::Max).wait();
    for (comm::Group* g : options.fp8_amax_groups)
      if (g != nullptr && g->size() > 1) g->all_reduce(t, comm::ReduceOp::Max).wait();
    t = t.cpu();  // host: one scalar per parameter, read element by element
    const double* a = t.data_ptr<double>();
    for (FlatParam* f : flats) {
      const size_t n = f->params().size();
      f->set_fp8_amax(std::vector<double>(a, a + n));
      a += n;
    }
  }
}

// Before anything may write into the shards (the optimizer step), no gather
// may still be in flight: a deferred gather copies the pre-step shard.
void ShardedDataParallel::State::wait_gathers() {
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].gathering) unshard(u);
}

void ShardedDataParallel::State::unshard(size_t u) {
  start_unshard(u);
  Unit& unit = units[u];
  if (!unit.gathering) return;
  auto t0 = std::chrono::steady_clock::now();
  for (auto& w : unit.gathers) w.wait();
  wait_ms += ms_since(t0);
  unit.gathers.clear();
  unit.gathering = false;
}

void ShardedDataParallel::State::reshard(size_t u) {
  Unit& unit = units[u];
  if (unit.gathering) unshard(u);  // never free a buffer a gather still writes
  for (auto& f : unit.flats) f->reshard();
}

void ShardedDataParallel::State::reshard_flats(size_t u, bool trainable) {
  Unit& unit = units[u];
  if (unit.gathering) unshard(u);
  for (auto& f : unit.flats)
    if (f->trainable() == trainable) f->reshard();
}

// Note [Frozen parameters in backward]: a unit's backward is over for its
// trainable parameters once each has its gradient, but not for frozen ones:
// the backward of x W with W frozen (a LoRA base layer) still reads W to
// pass the gradient on to x, and may run after the last adapter gradient
// arrived. So when the unit's input needs a gradient, its frozen flats are
// kept until that gradient is complete (a hook on the input): every node of
// the unit lies between its output and its input, so all have run by then.
// When the input needs none (the first block after a frozen embedding), no
// node reads a frozen weight in backward at all. A pipeline runs several
// forwards before their backwards (GPipe, 1F1B's warm-up), so the hold is a
// count of forwards whose input gradient is still to come: the frozen flats
// go when the last of them has arrived, and a later backward regathers them
// (pre_backward) if the end of an earlier one resharded them.
void ShardedDataParallel::State::release_frozen(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mu);
  Unit& unit = units[u];
  if (unit.hold_frozen == 0) return;
  if (--unit.hold_frozen == 0 && unit.pending == 0) reshard_flats(u, /*trainable=*/false);
}

// Whether unit `u` may be gathered ahead of use: limit_all_gathers holds at
// most two block units at once, max_live_numel bounds the gathered elements.
// Decided from state every rank shares, so all ranks gather in one order.
bool ShardedDataParallel::State::may_prefetch(size_t u) const {
  if (options.limit_all_gathers) {
    int live = 0;
    for (size_t v = 1; v < units.size(); ++v)
      if (v != u && (units[v].gathering || units[v].unsharded())) ++live;
    if (live >= 2) return false;
  }
  return options.max_live_numel <= 0 || live_numel() + units[u].numel <= options.max_live_numel;
}

// Gathers block units ahead of use: one unit, or (prefetch_bytes) units until
// that many bytes are gathered or on the way ahead of the unit in use.
// Replicated strategies fetch the next stale unit only (Note [Deferred gather]).
void ShardedDataParallel::State::prefetch(size_t u, int dir) {
  if (replicated()) {
    if (u >= 1 && u < units.size()) start_unshard(u);
    return;
  }
  int64_t ahead = 0;
  for (auto v = static_cast<int64_t>(u); v >= 1 && v < static_cast<int64_t>(units.size()); v += dir) {
    Unit& unit = units[static_cast<size_t>(v)];
    if (!unit.gathering && !unit.unsharded()) {
      if (!may_prefetch(static_cast<size_t>(v))) return;
      start_unshard(static_cast<size_t>(v));
    }
    ahead += unit.bytes;
    if (options.prefetch_bytes <= 0 || ahead >= options.prefetch_bytes) return;
  }
}

at::Tensor ShardedDataParallel::State::run_block(int64_t i, const interfaces::BlockBody& body, const at::Tensor& x) {
  const size_t u = unit_of_block[static_cast<size_t>(i)];
  if (summoned || u == 0) return body(x);
  Unit& unit = units[u];
  if (i == unit.first_block) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (unit.gathering) ++stats.prefetched;
    unshard(u);
    if (options.forward_prefetch || replicated()) prefetch(u + 1, +1);
    const bool frozen = std::any_of(unit.flats.begin(), unit.flats.end(), [](const auto& f) { return !f->trainable(); });
    if (frozen && torch::GradMode::is_enabled() && x.requires_grad()) {
      ++unit.hold_frozen;
      std::weak_ptr<State> weak = weak_from_this();
      x.register_hook([weak, u](const at::Tensor& g) {
        if (auto st = weak.lock()) st->release_frozen(u);
        return g;
      });
    }
  }
  at::Tensor y = body(x);
  if (i != unit.last_block) return y;
  std::lock_guard<std::recursive_mutex> lock(mu);
  const bool grad = torch::GradMode::is_enabled() && y.requires_grad();
  if (grad) {
    std::weak_ptr<State> weak = weak_from_this();
    y.register_hook([weak, u](const at::Tensor& g) {
      if (auto st = weak.lock()) st->pre_backward(u);
      return g;
    });
  }
  if (!grad || reshard_after_forward(options.sharding)) reshard(u);
  return y;
}

void ShardedDataParallel::State::begin_backward() {
  if (in_backward) return;
  in_backward = true;
  // Note [Step protocol]: thrown from the first gradient hook (this may run
  // inside an operator callback, which cannot throw).
  missed_after_step = awaiting_step && shards_changed();
  torch::autograd::Engine::get_default_engine().queue_callback(
      [self = shared_from_this()] { self->finish_backward(); });
}

void ShardedDataParallel::State::pre_backward(size_t u) {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  std::lock_guard<std::recursive_mutex> lock(mu);
  begin_backward();
  if (units[u].gathering) ++stats.prefetched;
  unshard(u);
  if (options.backward_prefetch == BackwardPrefetch::Pre) prefetch(u - 1, -1);
}

void ShardedDataParallel::State::on_grad_ready(size_t s) {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  std::lock_guard<std::recursive_mutex> lock(mu);
  begin_backward();
  if (missed_after_step) check_after_step_called("backward");
  const Slot& slot = slots[s];
  Unit& unit = units[slot.unit];
  unit.grad_seen = true;
  unit.flats[slot.flat]->on_grad_ready(slot.index);
  if (--unit.pending > 0) return;
  // The unit's trainable parameters are done: they can go, their gradients
  // travel; frozen ones may still be read (Note [Frozen parameters in backward]).
  if (slot.unit != 0) {
    if (unit.hold_frozen > 0)
      reshard_flats(slot.unit, /*trainable=*/true);
    else
      reshard(slot.unit);
    if (options.backward_prefetch == BackwardPrefetch::Post) prefetch(slot.unit - 1, -1);
  }
  if (sync) issue_ready_reduces(/*flush=*/false);
}

// Issues the reduce-scatters of complete units in reduce_order (Note [Unit
// order]); `flush` treats every remaining unit as complete (end of backward:
// parameters nobody used contribute zeros).
void ShardedDataParallel::State::issue_ready_reduces(bool flush) {
  while (next_reduce < reduce_order.size()) {
    const size_t u = reduce_order[next_reduce];
    Unit& unit = units[u];
    if (unit.trainable == 0 || unit.reduced) {
      ++next_reduce;
      continue;
    }
    if (unit.pending > 0 && !flush) return;
    std::vector<comm::Work> works;
    for (auto& f : unit.flats)
      if (f->trainable()) {
        works.push_back(f->start_reduce(replicate));
        stats.grad_bytes_reduced += f->reduce_bytes();
      }
    unit.reduced = true;
    ++stats.reduces;
    if (!flush && std::any_of(units.begin(), units.end(), [](const Unit& v) { return v.pending > 0; }))
      ++stats.reduces_in_backward;
    inflight.emplace_back(u, std::move(works));
    ++next_reduce;
    while (static_cast<int>(inflight.size()) > options.max_inflight_reduces) finish_oldest_reduce();
  }
}

void ShardedDataParallel::State::finish_oldest_reduce() {
  auto [u, works] = std::move(inflight.front());
  inflight.pop_front();
  auto t0 = std::chrono::steady_clock::now();
  for (auto& w : works) w.wait();
  wait_ms += ms_since(t0);
  for (auto& f : units[u].flats)
    if (f->trainable()) f->finish_reduce();
  if (user_module) mark_grads_spent(u);
}

void ShardedDataParallel::State::finish_backward() {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  std::lock_guard<std::recursive_mutex> lock(mu);
  wait_gathers();
  if (sync) {
    issue_ready_reduces(/*flush=*/true);
    while (!inflight.empty()) finish_oldest_reduce();
  }
  // Everything not replicated goes back to its shard, the root included
  // (unless a pipeline still holds graphs that saved it).
  for (size_t u = options.keep_root_between_backwards ? 1 : 0; u < units.size(); ++u) reshard(u);
  for (auto& unit : units) {
    unit.pending = unit.trainable;
    unit.reduced = false;  // hold_frozen stays: a pipeline's other forwards still await their backward
  }
  next_reduce = 0;
  in_backward = false;
  forward_unit = backward_unit = 0;
  if (sync) {
    awaiting_step = true;
    reduced = mark_shards();
  }
  if (user_module) end_user_backward();  // may throw, the engine consistent (fully_shard.cpp)
}

// Note [Step protocol]: the optimizer writes the shards in place, and
// nothing else writes them between a backward and after_step(). So "no
// shard changed" at after_step() means the optimizer holds other tensors
// (the module's parameters, which the engine has emptied or replaced: it
// would step nothing, silently), and "shards changed" without after_step()
// means replicated units keep stale parameters and sharded ones stale
// device copies and FP8 scales. A change shows in a shard's version counter
// (torch::optim::Adam, AdamW, ours) or, for optimizers that write through
// .data() (libtorch's SGD, which leaves the counter alone), in the values:
// a few evenly spaced elements of every shard are compared. An optimizer
// step that changes nothing at all (SGD with a learning rate of 0) is taken
// for the first mistake; skip after_step() with such a step, as with a
// skipped one: nothing changed, so nothing is stale.
ShardedDataParallel::State::ShardMark ShardedDataParallel::State::mark_shards() const {
  constexpr int64_t kSamples = 64;
  torch::NoGradGuard no_grad;
  ShardMark m;
  std::vector<at::Tensor> values, grads;
  for (const Unit& unit : units)
    for (const auto& f : unit.flats) {
      if (!f->trainable()) continue;
      const at::Tensor& shard = f->shard();
      m.versions.push_back(static_cast<int64_t>(shard._version()));
      if (shard.numel() == 0) continue;
      const at::Tensor where = at::linspace(0, static_cast<double>(shard.numel() - 1),
                                            std::min<int64_t>(kSamples, shard.numel()), at::kDouble)
                                   .to(at::kLong)
                                   .to(shard.device());
      auto sample = [&](const at::Tensor& t) {
        return t.reshape({-1}).index_select(0, where).to(at::kCPU, at::kDouble);  // host: 64 samples, compared here
      };
      values.push_back(sample(shard));
      if (shard.grad().defined()) grads.push_back(sample(shard.grad()));
    }
  if (!values.empty()) m.values = at::cat(values);
  if (!grads.empty()) m.grads = at::cat(grads);
  return m;
}

bool ShardedDataParallel::State::shards_changed() const {
  const ShardMark now = mark_shards();
  if (now.versions != reduced.versions) return true;
  return now.values.defined() && reduced.values.defined() && !at::equal(now.values, reduced.values);
}

bool ShardedDataParallel::State::gradients_nonzero() const {
  return reduced.grads.defined() && reduced.grads.abs().max().item<double>() > 0;
}

void ShardedDataParallel::State::check_after_step_called(const char* where) const {
  if (!awaiting_step || !shards_changed()) return;
  throw UsageError(std::string(where) +
                   ": the optimizer changed the shards after the last backward, but after_step() was not called: "
                   "call engine->after_step() after every optimizer step");
}

at::Tensor ShardedDataParallel::forward(const std::function<at::Tensor()>& fn) {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  {
    std::lock_guard<std::recursive_mutex> lock(st().mu);
    st().start_unshard(0);
    if (options_.forward_prefetch || st().replicated()) st().prefetch(1, +1);
    st().unshard(0);
  }
  at::Tensor out = fn();
  // Without autograd no backward will come to free the root.
  if (!torch::GradMode::is_enabled() || !out.requires_grad()) st().reshard(0);
  return out;
}

void ShardedDataParallel::reshard_all() {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  std::lock_guard<std::recursive_mutex> lock(st().mu);
  for (size_t u = 0; u < st().units.size(); ++u) st().reshard(u);
}

void ShardedDataParallel::add_to_grad(const std::string& name, const at::Tensor& grad) {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  torch::NoGradGuard no_grad;
  const at::Tensor flat = grad.reshape({-1});
  for (auto& unit : st().units)
    for (auto& f : unit.flats) {
      if (!f->trainable()) continue;
      for (const ShardPiece& piece : f->pieces()) {
        if (piece.name != name) continue;
        at::Tensor& g = f->shard().mutable_grad();
        if (!g.defined()) g = at::zeros_like(f->shard(), f->shard().options().dtype(f->grad_dtype()));
        g.narrow(0, piece.shard_offset, piece.numel)
            .add_(flat.narrow(0, piece.param_offset, piece.numel).to(g.scalar_type()));
      }
    }
}

ShardedDataParallel::NoSync::NoSync(ShardedDataParallel& e) : e_(e), previous_(e.st().sync) {
  e_.st().sync = false;
}
ShardedDataParallel::NoSync::~NoSync() { if (e_.state_) e_.state_->sync = previous_; }

std::vector<at::Tensor> ShardedDataParallel::shards() const {
  std::vector<at::Tensor> out;
  for (auto& unit : st().units)
    for (auto& f : unit.flats)
      if (f->trainable()) out.push_back(f->shard());
  return out;
}

std::vector<int64_t> ShardedDataParallel::shard_decay_numel() const {
  std::vector<int64_t> out;
  for (auto& unit : st().units)
    for (auto& f : unit.flats)
      if (f->trainable()) out.push_back(f->shard_decay_numel());
  return out;
}

double ShardedDataParallel::clip_grad_norm(double max_norm, const NormSplit& split) {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  // Shards partition the gradient over the shard group; replicas hold the same.
  if (split.group == nullptr || split.group->size() == 1) {
    const double norm = optim::clip_grad_norm(shards(), max_norm, {st().shard});
    st().check_user_rules("clip_grad_norm");
    return norm;
  }
  // Note [Sharding tensor-parallel parameters]: squares of split and of
  // replicated parameters, summed apart; padding is in no piece.
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> parts[2];  // per piece: split, replicated
  at::TensorOptions opts = at::TensorOptions().dtype(at::kDouble);
  for (auto& unit : st().units)
    for (auto& f : unit.flats) {
      if (!f->trainable() || !f->shard().grad().defined()) continue;
      const at::Tensor g = f->shard().grad();
      opts = opts.device(g.device());
      for (const ShardPiece& p : f->pieces())
        parts[split.is_split(p.name) ? 0 : 1].push_back(
            g.narrow(0, p.shard_offset, p.numel).to(at::kDouble).pow(2).sum());
    }
  auto total = [&](const std::vector<at::Tensor>& v) { return v.empty() ? at::zeros({}, opts) : at::stack(v).sum(); };
  at::Tensor sq = at::stack({total(parts[0]), total(parts[1])});
  st().shard->all_reduce(sq).wait();
  at::Tensor split_sq = sq.narrow(0, 0, 1).clone();
  split.group->all_reduce(split_sq).wait();
  const double norm = std::sqrt(split_sq.item<double>() + sq[1].item<double>());
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);  // as optim::clip_grad_norm
    for (auto& t : shards())
      if (t.grad().defined()) t.mutable_grad().mul_(scale);
  }
  st().check_user_rules("clip_grad_norm");
  return norm;
}

// Note [Deferred gather]: nothing moves here; the next forward (or a
// FullParams) gathers each unit.
void ShardedDataParallel::after_step() {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  std::lock_guard<std::recursive_mutex> lock(st().mu);
  if (st().awaiting_step && st().gradients_nonzero() && !st().shards_changed())
    throw UsageError(
        "after_step: no shard changed since backward reduced the gradients: build the optimizer over "
        "engine->shards(), not the module's parameters (and when a step is skipped or changes nothing, skip "
        "after_step() too)");
  st().awaiting_step = false;
  if (!replicated_params(options_.sharding)) {
    st().wait_gathers();
    // Optimizer offload keeps a device copy of each stepped host shard.
    for (auto& unit : st().units)
      for (auto& f : unit.flats) f->refresh_device_copy();
    st().refresh_fp8_scales();
    st().check_user_rules("after_step");
    return;
  }
  st().wait_gathers();
  for (auto& unit : st().units) unit.stale = unit.trainable > 0;
  st().check_user_rules("after_step");
}

void ShardedDataParallel::zero_grad() {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  st().check_after_step_called("zero_grad");
  for (auto& unit : st().units)
    for (auto& f : unit.flats) f->zero_grad();
  st().unused_units.clear();  // the gradients it was about are gone
  st().check_user_rules("zero_grad");
}

ShardedDataParallel::FullParams::FullParams(ShardedDataParallel& e) : e_(e) {
  GatherOnUse::Quiet quiet;
  std::lock_guard<std::recursive_mutex> lock(e_.st().mu);
  e_.st().exact_gathers = true;
  for (size_t u = 0; u < e_.st().units.size(); ++u) e_.st().start_unshard(u);
  for (size_t u = 0; u < e_.st().units.size(); ++u) e_.st().unshard(u);
  e_.st().exact_gathers = false;
  e_.st().summoned = true;
}

ShardedDataParallel::FullParams::~FullParams() {
  if (!e_.state_) return;  // absorbed meanwhile (Note [Nested fully_shard]): nothing of it is left
  GatherOnUse::Quiet quiet;
  std::lock_guard<std::recursive_mutex> lock(e_.st().mu);
  e_.st().summoned = false;
  for (size_t u = 0; u < e_.st().units.size(); ++u) e_.st().reshard(u);
}

std::vector<at::Tensor> ShardedDataParallel::full_parameters() {
  GatherOnUse::Quiet quiet;  // Note [Gather on use]: the engine's own reads
  FullParams full(*this);
  std::vector<at::Tensor> out;
  for (auto& p : module_->parameters()) out.push_back(p.detach().clone());
  st().check_user_rules("full_parameters");
  return out;
}

torch::OrderedDict<std::string, at::Tensor> ShardedDataParallel::full_state_dict() {
  GatherOnUse::Quiet quiet;
  FullParams full(*this);
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& item : module_->named_parameters()) out.insert(item.key(), item.value().detach().clone());
  for (const auto& item : module_->named_buffers()) out.insert(item.key(), item.value().detach().clone());
  st().check_user_rules("full_state_dict");
  return out;
}

namespace {

// Every parameter and buffer of `module` has a tensor of its shape in
// `state`, and `state` names nothing else.
void check_state_dict(const torch::nn::Module& module, const torch::OrderedDict<std::string, at::Tensor>& state) {
  size_t known = 0;
  for (const auto& named : {module.named_parameters(), module.named_buffers()})
    for (const auto& item : named) {
      const at::Tensor* t = state.find(item.key());
      if (t == nullptr || !t->defined())
        throw std::invalid_argument("load_full_state_dict: no tensor for '" + item.key() + "'");
      if (t->sizes() != item.value().sizes())
        throw std::invalid_argument("load_full_state_dict: '" + item.key() + "' has shape " + c10::str(t->sizes()) +
                                    ", the module's is " + c10::str(item.value().sizes()));
      ++known;
    }
  if (known == state.size()) return;
  for (const auto& item : state) {
    const bool found =
        module.named_parameters().find(item.key()) != nullptr || module.named_buffers().find(item.key()) != nullptr;
    if (!found) throw std::invalid_argument("load_full_state_dict: the module has no '" + item.key() + "'");
  }
}

}  // namespace

void ShardedDataParallel::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  check_state_dict(*module_, state);
  torch::NoGradGuard no_grad;
  for (const ShardView& v : shard_views())
    for (const ShardPiece& p : v.pieces) {
      const at::Tensor whole = state[p.name].detach().reshape({-1});
      v.shard.narrow(0, p.shard_offset, p.numel).copy_(whole.narrow(0, p.param_offset, p.numel));
    }
  for (const auto& item : module_->named_buffers()) item.value().copy_(state[item.key()]);
  after_step();  // replicated strategies gather the written shards (Note [Step protocol])
}

}  // namespace scaletrain::parallel::fsdp

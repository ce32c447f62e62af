#pragma once
// The sharded engine's state (internal: fsdp.cpp, fsdp_init.cpp and fully_shard.cpp).
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::parallel::fsdp {

namespace engine {

inline bool replicated_params(Sharding s) { return s == Sharding::Zero1 || s == Sharding::Zero2; }
inline bool reshard_after_forward(Sharding s) {
  return s == Sharding::Zero3 || s == Sharding::FullShard || s == Sharding::HybridShard;
}

struct Unit {
  std::string name;
  int64_t first_block = -1, last_block = -1;  // -1: the root unit
  std::vector<std::unique_ptr<FlatParam>> flats;
  std::vector<comm::Work> gathers;  // in flight; empty once waited
  bool gathering = false;
  bool stale = false;  // replicated: parameters wait for the deferred gather (Note [Deferred gather])
  int64_t numel = 0;   // parameter elements of its flat buffers, padded
  int64_t bytes = 0;
  int trainable = 0;  // parameters with gradients
  int pending = 0;    // of those, not yet accumulated in this backward
  bool reduced = false;
  // Forwards whose input gradient has not arrived: frozen flats stay gathered
  // in backward while any is outstanding (Note [Frozen parameters in backward]).
  int hold_frozen = 0;
  // A trainable parameter's gradient arrived since the last synchronized
  // backward (Note [Units that took no part], fully_shard.cpp).
  bool grad_seen = false;
  // Its parameters' .grad are their spent markers (Note [Spent gradients]).
  bool spent_grads = false;

  bool unsharded() const {
    for (auto& f : flats)
      if (!f->unsharded()) return false;
    return true;
  }
};

// Where a trainable parameter lives.
struct Slot {
  size_t unit, flat, index;
};

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace engine


// Everything the autograd hooks touch; fsdp.cpp runs the engine,
// fully_shard.cpp adds what user modules need (Note [Gather on use]).
struct ShardedDataParallel::State : std::enable_shared_from_this<State> {
  using Unit = engine::Unit;
  using Slot = engine::Slot;
  ShardedOptions options;
  comm::Group* shard = nullptr;
  comm::Group* replicate = nullptr;
  std::shared_ptr<comm::Group> grads_group;  // reduce-scatters (Note [Unit order])
  // Note [Experts in the sharded engine]: experts' buffers and their reduces.
  comm::Group* expert_shard = nullptr;
  std::shared_ptr<comm::Group> expert_grads_group;
  std::vector<Unit> units;                   // 0 = root, then block units in forward order
  std::vector<size_t> unit_of_block;         // 0 = in the root unit
  std::vector<size_t> reduce_order;          // block units last to first, then root
  std::vector<Slot> slots;                   // per trainable parameter (hook index)
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::deque<std::pair<size_t, std::vector<comm::Work>>> inflight;  // unit, its reduces
  size_t next_reduce = 0;
  bool sync = true;
  bool in_backward = false;
  bool summoned = false;
  double wait_ms = 0;
  Stats stats;
  std::recursive_mutex mu;

  bool replicated() const { return engine::replicated_params(options.sharding); }
  // Gathering and freeing units. A replicated unit "unshards" by its
  // deferred gather when stale (Note [Deferred gather]), else does nothing.
  void start_unshard(size_t u);
  void unshard(size_t u);
  void reshard(size_t u);
  // Reshards the unit's flats that train (true) or the frozen ones (false).
  void reshard_flats(size_t u, bool trainable);
  void release_frozen(size_t u);
  void wait_gathers();
  // Note [FP8 weight gathers]: agrees every FP8-gathered parameter's amax
  // (collective over the shard group and fp8_amax_groups) and sets the scales.
  void refresh_fp8_scales();
  bool exact_gathers = false;  // FullParams: gather exact values
  // Starts gathering units from `u` on in direction `dir` (+1 forward, -1
  // backward) within the prefetch budget.
  void prefetch(size_t u, int dir);
  bool may_prefetch(size_t u) const;
  int64_t live_numel() const;
  // Hooks.
  at::Tensor run_block(int64_t i, const interfaces::BlockBody& body, const at::Tensor& x);
  void pre_backward(size_t u);
  void on_grad_ready(size_t slot);
  // Note [Gather on use] (user modules): the units' buffers by storage, the
  // block unit forward used last, and what an operator's read of unit u does.
  std::unordered_map<const c10::StorageImpl*, size_t> unit_of_storage;
  size_t forward_unit = 0, backward_unit = 0;
  void use_unit(size_t u);
  // What fully_shard checks of a user's step (fully_shard.cpp): the thread
  // rule of Note [Gather on use] and Note [Units that took no part].
  bool user_module = false;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, std::string>> param_of;  // unit, name
  std::mutex foreign_mu;
  std::string foreign_use;   // the first read on another thread, not yet reported
  std::string unused_units;  // a synchronized backward's units without gradients, until zero_grad()
  // Any thread, under the gather-on-use registry's lock: never throws or takes `mu`.
  void note_foreign_use(const at::Tensor& t);
  // Note [Spent gradients]: each trainable parameter's marker (by the
  // parameter), the parameter's name by the marker's storage, and the first
  // read of one, not yet reported.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> spent_marker;
  std::unordered_map<const c10::StorageImpl*, std::string> spent_param;
  std::string spent_read;
  // Units whose parameters hold markers now: the operator hook looks no
  // further while it is 0 (all of forward and backward).
  std::shared_ptr<std::atomic<int>> spent_units = std::make_shared<std::atomic<int>>(0);
  void make_spent_markers();
  void mark_grads_spent(size_t u);
  void clear_spent_grads(Unit& unit);
  // An operator on the engine's thread reads `storage`: notes the first read
  // of a marker (under the registry's lock, as note_foreign_use).
  void note_spent_read(const c10::StorageImpl* storage, const char* op);
  // The end of a backward: notes the units without gradients (a synchronized
  // one), then throws what check_user_rules() finds.
  void end_user_backward();
  // Throws UsageError for a read on another thread (once) or units that took no part.
  void check_user_rules(const char* where);
  // Note [Step protocol]: set when a synchronized backward has reduced into
  // the gradient shards, with the shards' version counters at that moment;
  // cleared by after_step().
  struct ShardMark {
    std::vector<int64_t> versions;  // each trainable shard's version counter
    at::Tensor values, grads;       // a few evenly spaced elements of each (float64)
  };
  bool awaiting_step = false;
  bool missed_after_step = false;  // found when this backward began
  ShardMark reduced;               // the shards when the gradients were reduced
  ShardMark mark_shards() const;
  bool shards_changed() const;
  // Whether the reduced gradients were large enough for a step to show.
  bool gradients_nonzero() const;
  // Throws UsageError if the optimizer stepped without after_step().
  void check_after_step_called(const char* where) const;
  void issue_ready_reduces(bool flush);
  void finish_oldest_reduce();
  void finish_backward();
  void begin_backward();
};

}  // namespace scaletrain::parallel::fsdp

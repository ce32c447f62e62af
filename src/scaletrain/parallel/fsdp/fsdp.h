#pragma once
// Sharded data parallelism: ZeRO stages 1-3 and FSDP's sharding strategies,
// one engine.
//
// Every strategy keeps each unit's parameters in flat buffers (Note [Flat
// parameters] in flat_param.h) and gives the optimizer only this rank's shard
// of them, so optimizer states always exist on the owning rank only. They
// differ in what else is sharded and when parameters are gathered:
//
//   strategy        params between steps   params in fwd/bwd         gradients kept
//   Zero1           replicated (stale      replicated                whole (reduced into shards per unit in
//                   until the next fwd)                              the step's last backward)
//   Zero2           replicated (stale      replicated                shard (reduce-scatter per unit in backward)
//                   until the next fwd)
//   Zero3/FullShard shard                  unit gathered per use,    shard
//                                          freed after fwd and bwd
//   ShardGradOp     shard                  gathered in fwd, kept     shard
//                                          until the unit's bwd ends
//   HybridShard     FullShard within the shard group, gradients averaged across the replicate group
//
// FSDP's NO_SHARD is DDP (parallel/ddp).
//
// A step: forward(fn) gathers the root unit and runs fn; the model's block
// runner gathers each unit before its first block and, for the strategies
// that reshard after forward, frees it after its last block and hooks its
// output so the unit is gathered again just before its backward. Each
// parameter's AccumulateGrad post-hook counts the unit's gradients; when a
// unit's are complete its reduce-scatter starts (Note [Unit order]) and its
// parameters are freed. A callback queued on the autograd engine waits for
// the reduces when backward ends. Then clip_grad_norm(), the optimizer on
// shards(), and after_step().
//
// Note [Deferred gather]: under ZeRO-1/2 every rank keeps whole parameters,
// but the optimizer updates only its shard, so after a step the other ranks'
// parts are out of date. Gathering them in after_step() would leave the link
// busy while nothing computes. Instead after_step() marks every unit stale,
// and the next forward gathers each unit just before it runs (the root at
// forward(), a block unit at its first block) while the next unit's gather
// is already in flight, so the gathers overlap the forward as the reduces
// overlap the backward. A stale unit's gather goes out in calls of at most
// allgather_bucket_numel elements. Whatever reads parameters outside a
// forward must gather first: FullParams (and full_parameters()) does; the
// shards themselves (shard_views(), the optimizer) are always current.
//
// Note [Unit order]: c10d matches collectives by issue order. Gathers run on
// the shard group in the order the hooks ask for them, which is the same on
// every rank (same graph). Reduce-scatters run on a second group of the same
// ranks, so they never interleave with gathers, and are issued strictly in
// the expected backward order (last block's unit first, root last): a unit
// that completes early waits for those before it.
//
// Note [Experts in the sharded engine]: under expert parallelism
// (parallel/expert) a rank holds only the experts of its place in its ep
// group; the ranks holding the same experts form its expert-data group
// (comm::Mesh::expert_dp). Expert parameters get flat buffers of their own,
// sharded over that group (`expert_shard`), beside the unit's other buffers
// sharded over the shard group; each of the two groups has its own pair of
// communicators (gathers, reduces), and every member of a group runs the same
// graph, so each keeps one issue order. An expert's local gradient already
// sums the gradients of every token its ep group routed to it, so the
// average over the expert-data group is multiplied by `expert_scale` (1/ep)
// to become the mean over all data-parallel ranks. Nothing else changes:
//   - the global norm sums squares over the shard group (all data-parallel
//     ranks), where expert shards partition each place's experts and the
//     places hold different experts, so every expert counts once;
//   - checkpoint pieces name experts by their global index, so each rank
//     saves what it holds and every element is saved once;
//   - starting weights: shared parameters from rank 0 of the shard group,
//     experts from rank 0 of their expert-data group.
// HYBRID_SHARD (a second data-parallel dimension) does not take experts.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/interfaces/blocks.h"
#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/parallel/fsdp/flat_param.h"
#include "scaletrain/parallel/fsdp/module_units.h"
#include "scaletrain/parallel/fsdp/wrap.h"

namespace scaletrain::parallel::fsdp {

class GatherOnUse;  // gather_on_use.h

enum class Sharding { Zero1, Zero2, Zero3, FullShard, ShardGradOp, HybridShard };

enum class BackwardPrefetch {
  Pre,   // gather the next unit when the current unit's backward starts
  Post,  // gather the next unit when the current unit's gradients are done
  None,
};

struct ShardedOptions {
  Sharding sharding = Sharding::FullShard;
  WrapOptions wrap;  // how parameters form units
  BackwardPrefetch backward_prefetch = BackwardPrefetch::Pre;
  bool forward_prefetch = false;   // gather unit i+1 while unit i runs forward
  bool limit_all_gathers = true;   // at most two block units gathered at once
  bool sync_module_states = true;  // start from rank 0's weights (broadcast)
  // Reduce-scatters in flight before backward waits for the oldest; bounds
  // the unsharded gradients held at once.
  int max_inflight_reduces = 2;
  // Dtype of the shards the optimizer updates; Undefined = the parameters'.
  at::ScalarType master_dtype = at::ScalarType::Undefined;
  // Dtype gradients are reduced in; Undefined = the parameters'.
  at::ScalarType reduce_dtype = at::ScalarType::Undefined;
  // FP8 gradient reduction (FlatParamOptions::fp8_reduce); unset: reduce_dtype.
  std::optional<precision::Fp8Format> fp8_reduce;
  // Note [FP8 weight gathers] (flat_param.h), sharded strategies only: the
  // trainable parameters fp8_gather_param selects travel as FP8 codes in
  // every gather of a step (FullParams gathers exact values). They get flat
  // buffers of their own, so the others keep the parameter dtype. Each
  // parameter's amax is agreed over the shard group and `fp8_amax_groups`
  // (tensor parallelism: the pieces of a split weight) after every step.
  std::optional<precision::Fp8Format> fp8_gather;
  std::function<bool(const std::string& name)> fp8_gather_param;
  std::vector<comm::Group*> fp8_amax_groups;
  // Dtype of the trainable gradient shards; Undefined = master_dtype.
  at::ScalarType grad_dtype = at::ScalarType::Undefined;
  // Note [Experts in the sharded engine]: the parameters `expert_param`
  // selects are sharded over `expert_shard` (the ranks holding the same
  // experts), and their averaged gradients multiplied by `expert_scale`.
  std::function<bool(const std::string& name)> expert_param;
  comm::Group* expert_shard = nullptr;
  double expert_scale = 1.0;
  // Memory-efficient initialization: the model was built without parameter
  // bytes (interfaces/deferred.h); each parameter is initialized by this function
  // into a temporary, one at a time in registration order (on rank 0 only and
  // broadcast, with sync_module_states), and only this rank's part is kept.
  interfaces::InitFn deferred_init;
  // Instead of deferred_init, from a source that can produce any part of a
  // parameter (model files): every rank fills only the part it keeps, straight
  // from the source, so no rank holds a whole tensor and nothing is broadcast
  // (FlatParam::load_param_slice).
  FlatParam::SliceFill deferred_slice_init;
  // Keep the root unit gathered after a backward, until reshard_all(): a
  // pipeline schedule runs several forwards before their backwards, and each
  // of those graphs saved views of the root's parameters (ln_f, the head).
  bool keep_root_between_backwards = false;
  // fully_shard: a unit whose trainable parameters got no gradient in a step
  // (forward skipped it on this rank) is an error (Note [Units that took no
  // part] in fully_shard.cpp); with this set it is reduced with zero
  // gradients instead, which the optimizer then steps (Adam's moments and
  // weight decay still move it; torch::optim skips an undefined gradient).
  bool allow_unused_units = false;
  // ZeRO-1/2: elements of parameters one all-gather call of the deferred
  // gather moves (Note [Deferred gather]); 0: one call per flat buffer.
  int64_t allgather_bucket_numel = 0;
  // Sharded parameters: a prefetch gathers units ahead of the one in use
  // until this many bytes of parameters are gathered or on the way ahead of
  // it (DeepSpeed's stage3_prefetch_bucket_size; the last unit may overshoot).
  // 0: one unit ahead (FSDP's prefetch).
  int64_t prefetch_bytes = 0;
  // Sharded parameters: a prefetch is not started when it would make more
  // than this many parameter elements gathered at once, the root's and the
  // unit in use included (DeepSpeed's stage3_max_live_parameters); a unit in
  // use is gathered regardless. 0: no bound (limit_all_gathers still applies).
  int64_t max_live_numel = 0;
  // Note [Offloaded shards] (flat_param.h): allocates trainable shards and
  // their gradients off the device (host or file); the optimizer then steps
  // them there. Null: shards stay beside the parameters.
  std::function<at::Tensor(int64_t numel, at::ScalarType dtype, bool gradient)> offload_alloc;
  // With offload_alloc, parameter offload: frozen shards are offloaded too,
  // no device copy is kept, and each gather copies from the host.
  bool offload_params = false;
  // With offload_params: read a unit's file-backed shards ahead, when a neighbouring unit is gathered.
  bool read_ahead = false;
};

// Note [Sharding tensor-parallel parameters]: under tensor parallelism the
// engine runs over the data-parallel group of one tp rank and shards that
// rank's parameters, which are split (a shard of a larger tensor) or
// replicated across tp. Gradients need nothing new: the tensor-parallel
// autograd functions and hooks have completed each local gradient before
// AccumulateGrad (the sequence-parallel all-reduce is a pre-accumulation
// hook), and the engine's hooks run after it. The global norm does: a split
// parameter's squared norm adds over tp, a replicated one is the same on
// every tp rank and counts once. NormSplit says which is which.
struct NormSplit {
  comm::Group* group = nullptr;                           // tp; null: nothing is split
  std::function<bool(const std::string& name)> is_split;  // by parameter name
};

Sharding parse_sharding(const std::string& s);  // zero1..3, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD
std::string to_string(Sharding s);
BackwardPrefetch parse_backward_prefetch(const std::string& s);  // BACKWARD_PRE | BACKWARD_POST | NONE

class ShardedDataParallel {
 public:
  // `module` is also `blocks` (e.g. a model). Parameters are sharded over
  // `shard`; HybridShard also needs `replicate` (the other data-parallel
  // dimension). `world` creates the engine's second group (Note [Unit order]).
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, interfaces::Blockwise& blocks, comm::World& world,
                      comm::Group& shard, comm::Group* replicate, ShardedOptions options = {});
  // Any module (fully_shard below): `units` picks the submodules gathered and
  // freed as one (module_units.h); each is gathered when an operator first
  // reads its parameters (Note [Gather on use] in gather_on_use.h), so the
  // module's own forward runs unchanged, on the thread that built the engine
  // (and the threads its backward runs on; a read on another thread makes
  // the engine's next call throw). options.wrap must stay default.
  ShardedDataParallel(std::shared_ptr<torch::nn::Module> module, const ModuleUnits& units, comm::World& world,
                      comm::Group& shard, comm::Group* replicate, ShardedOptions options = {});
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  // Runs a forward pass (fn calls the model) with the root unit gathered.
  at::Tensor forward(const std::function<at::Tensor()>& fn);

  // While a NoSync lives, backward keeps whole gradients locally and reduces
  // nothing; the next backward outside it reduces the accumulated sum.
  class NoSync {
   public:
    explicit NoSync(ShardedDataParallel& e);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ShardedDataParallel& e_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // The optimizer's tensors (this rank's shards; .grad is the reduced
  // gradient shard) and how many leading elements of each get weight decay.
  std::vector<at::Tensor> shards() const;
  std::vector<int64_t> shard_decay_numel() const;
  // Global gradient norm over every shard (and clipping to max_norm if > 0).
  // With `split`, the parameters are themselves parts of larger tensors
  // (Note [Sharding tensor-parallel parameters]).
  double clip_grad_norm(double max_norm, const NormSplit& split = {});
  // After the optimizer step: replicated strategies gather updated shards.
  // Note [Step protocol]: after a backward that reduced gradients, throws
  // UsageError if no shard changed (the optimizer was not built over
  // shards()); zero_grad() and the next backward throw if shards changed
  // but after_step() was not called. Skip both after_step() and the
  // optimizer step together (a loss-scaler overflow).
  void after_step();
  void zero_grad();
  // Frees every gathered unit, the root included (see keep_root_between_backwards).
  void reshard_all();
  // Adds `grad` (the whole gradient of parameter `name`, already averaged
  // over the shard group) to this rank's part of it in the gradient shards:
  // a tied weight's gradient computed elsewhere (pipeline's head copy).
  void add_to_grad(const std::string& name, const at::Tensor& grad);

  // Gathers every unit (collective: all ranks call it) for as long as it
  // lives; the model then runs without hooks (evaluation, sampling, export).
  class FullParams {
   public:
    explicit FullParams(ShardedDataParallel& e);
    ~FullParams();
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;

   private:
    ShardedDataParallel& e_;
  };
  // Every flat shard this rank holds, trainable ones first in shards() order
  // (so optimizer state i has layout i), then frozen ones: the tensor (master
  // dtype) and which parameter ranges it holds. Replicated strategies must
  // call after_step() after writing into them (checkpoint loading).
  struct ShardView {
    at::Tensor shard;
    bool trainable = false;
    std::vector<ShardPiece> pieces;
  };
  std::vector<ShardView> shard_views() const;
  // This rank's position among replicas holding identical shards (HYBRID_SHARD
  // replica index; 0 elsewhere): only replica 0 needs to save.
  int replica_rank() const;

  // Copies of every parameter, whole, in named_parameters() order (collective).
  std::vector<at::Tensor> full_parameters();
  // PyTorch's full state dict: a copy of every parameter, whole, and of every
  // buffer (this rank's: BatchNorm's running statistics), by the module's
  // names, parameters first (collective).
  torch::OrderedDict<std::string, at::Tensor> full_state_dict();
  // Writes a full state dict (every rank passes the same one; any dtype)
  // into this rank's shards and the module's buffers, then gathers what the
  // strategy keeps whole. A missing or unknown name, or another shape, is
  // std::invalid_argument naming it, before anything is written.
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& state);

  const ShardedOptions& options() const { return options_; }
  int num_units() const;  // including the root
  std::vector<std::string> unit_names() const;
  // Bytes this rank holds now for parameters and for gradients, and of
  // those the bytes held off the device (Note [Offloaded shards]).
  int64_t param_bytes() const;
  int64_t grad_bytes() const;
  int64_t offloaded_bytes() const;
  // Milliseconds spent blocked on gathers and reduces since reset_stats().
  double comm_wait_ms() const;
  // What the engine did since reset_stats() (tests and benchmarks).
  struct Stats {
    int64_t all_gathers = 0;          // parameter all-gather calls issued
    int64_t reduces = 0;              // unit gradient reduces issued
    int64_t reduces_in_backward = 0;  // of those, issued while gradients of the backward were still to come
    int max_gathers_in_flight = 0;    // most units with a gather issued and not yet waited, at once
    int64_t prefetched = 0;           // block units whose gather was in flight before they needed it
    int64_t peak_gathered_numel = 0;  // most elements of sharded parameters gathered (or arriving) at once
    int64_t grad_bytes_reduced = 0;   // bytes of gradient buffers handed to reduce-scatter (frozen ones have none)
  };
  Stats stats() const;
  void reset_stats();
  // Units whose parameters wait for their deferred gather (Note [Deferred gather]).
  int stale_units() const;

  struct State;  // shared with the autograd hooks (fsdp.cpp)

 private:
  void init(comm::World& world, comm::Group& shard, comm::Group* replicate);
  // Note [Nested fully_shard] (fully_shard.cpp): the live engines over
  // submodules of module_ give their modules back and become units here.
  ModuleUnits absorb_children(const ModuleUnits& units, comm::Group& shard, comm::Group* replicate);
  void give_back_module(const std::string& parent);
  // The engine's state; UsageError once another engine absorbed this one.
  State& st() const;
  std::string absorbed_;  // set by give_back_module
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<interfaces::Blockwise> own_blocks_;  // a user module's units (ModuleBlocks)
  interfaces::Blockwise* blocks_;
  ShardedOptions options_;
  std::shared_ptr<State> state_;
  std::unique_ptr<GatherOnUse> gather_on_use_;  // user modules only
};

// PyTorch's fully_shard for any torch::nn::Module: ZeRO-1/2/3 and every FSDP
// sharding strategy (options.sharding) over `shard` (and `replicate` for
// HYBRID_SHARD). FSDP2's habit composes: fully_shard each block, then the
// model; the model's call takes the blocks' engines in as its units (Note
// [Nested fully_shard] in fully_shard.cpp) and only its engine trains. The step: call the module as usual, loss.backward(),
// clip_grad_norm() if wanted, the optimizer over shards() (never over
// module->parameters()), after_step(), zero_grad(). Every unit with trainable
// parameters must take part in each step (Note [Units that took no part]).
// docs/own-model.md.
std::unique_ptr<ShardedDataParallel> fully_shard(std::shared_ptr<torch::nn::Module> module, comm::World& world,
                                                 comm::Group& shard, const ModuleUnits& units,
                                                 ShardedOptions options = {}, comm::Group* replicate = nullptr);

}  // namespace scaletrain::parallel::fsdp

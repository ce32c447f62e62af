// fully_shard: the sharded engine over any torch::nn::Module, units chosen
// by a wrap policy (module_units.h) and gathered on use (gather_on_use.h).
#include <torch/csrc/autograd/graph_task.h>

#include <stdexcept>

#include "scaletrain/parallel/ddp/ddp_comm.h"
#include "scaletrain/parallel/fsdp/engine_state.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/fsdp/gather_on_use.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"

namespace scaletrain::parallel::fsdp {

namespace {

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
    // Flattening would move a planned weight's storage, where parallelize_module finds the layer.
    if (tensor::is_tensor_parallel_weight(p))
      throw std::invalid_argument("fully_shard: parameter '" + item.key() +
                                  "' belongs to a layer split by parallelize_module; fully_shard over a "
                                  "tensor-parallel user module is not supported yet (use DDP over dp)");
  }
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
  // Buffers (BatchNorm's running statistics) start as rank 0's, as
  // PyTorch's sync_module_states does; after that each rank keeps its own.
  std::vector<at::Tensor> buffers = module_->buffers();
  if (options_.sync_module_states && !buffers.empty()) {
    ddp_comm::broadcast_coalesced(shard, buffers, 0);
    if (replicate != nullptr) ddp_comm::broadcast_coalesced(*replicate, buffers, 0);
  }
  // Note [Gather on use]: the units' flat buffers, by storage.
  State& s = *state_;
  for (size_t u = 0; u < s.units.size(); ++u)
    for (auto& f : s.units[u].flats) s.unit_of_storage[f->params().front().storage().unsafeGetStorageImpl()] = u;
  std::weak_ptr<State> weak = state_;
  gather_on_use_ = std::make_unique<GatherOnUse>(
      [weak](const c10::StorageImpl* storage) -> int64_t {
        auto st = weak.lock();
        if (!st) return -1;
        auto it = st->unit_of_storage.find(storage);
        return it == st->unit_of_storage.end() ? -1 : static_cast<int64_t>(it->second);
      },
      [weak](size_t u) {
        if (auto st = weak.lock()) st->use_unit(u);
      });
}

std::unique_ptr<ShardedDataParallel> fully_shard(std::shared_ptr<torch::nn::Module> module, comm::World& world,
                                                 comm::Group& shard, const ModuleUnits& units,
                                                 ShardedOptions options, comm::Group* replicate) {
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
  if (!ready) {
    if (unit.gathering) ++stats.prefetched;
    if (backward) begin_backward();
    unshard(u);
  }
  if (!moved) return;
  if (backward && options.backward_prefetch == BackwardPrefetch::Pre) prefetch(u - 1, -1);
  if (!backward && (options.forward_prefetch || replicated())) prefetch(u + 1, +1);
}

}  // namespace scaletrain::parallel::fsdp

#include "scaletrain/train/checkpoint_layout.h"

#include <algorithm>

#include "scaletrain/util/error.h"

namespace scaletrain::train {

checkpoint::Layout sharded_layout(const parallel::fsdp::ShardedDataParallel& engine) {
  checkpoint::Layout l;
  l.writer = engine.replica_rank() == 0;
  l.strategy = parallel::fsdp::to_string(engine.options().sharding);
  int i = 0;
  for (auto& v : engine.shard_views()) {
    checkpoint::Slot s{v.shard, v.trainable ? i++ : -1, {}};
    for (auto& p : v.pieces) s.pieces.push_back({p.name, p.shape, p.param_offset, p.shard_offset, p.numel});
    l.slots.push_back(std::move(s));
  }
  return l;
}

checkpoint::Layout tensor_parallel_layout(checkpoint::Layout local, const parallel::tensor::TensorParallelPlan& plan) {
  const int rank = plan.tp->rank(), size = plan.tp->size();
  for (auto& slot : local.slots) {
    std::vector<checkpoint::SlotPiece> full;
    for (const auto& p : slot.pieces) {
      const parallel::tensor::ParamLayout& l = plan.layout(p.name);
      for (const auto& run : parallel::tensor::full_runs(l, rank, size, p.param_offset, p.numel))
        full.push_back({p.name, l.full_shape, run.full_offset, p.local_offset + (run.local_offset - p.param_offset),
                        run.numel, p.saved && (l.sharded() || rank == 0)});
    }
    slot.pieces = std::move(full);
  }
  return local;
}

void append_chunk_layout(checkpoint::Layout& out, checkpoint::Layout chunk, int* states) {
  int n = 0;
  for (auto& s : chunk.slots) {
    if (s.optim_index >= 0) {
      n = std::max(n, s.optim_index + 1);
      s.optim_index += *states;
    }
    out.slots.push_back(std::move(s));
  }
  *states += n;
  out.writer = chunk.writer;
}

void append_buffers(checkpoint::Layout& l, const torch::nn::Module& module, bool saved) {
  for (const auto& item : module.named_buffers()) {
    const at::Tensor& b = item.value();
    if (!b.defined() || b.numel() == 0) continue;
    if (!b.is_contiguous())
      throw UsageError("checkpoint: cannot save buffer '" + item.key() + "': it is not contiguous");
    checkpoint::SlotPiece piece{item.key(), b.sizes().vec(), 0, 0, b.numel()};
    piece.saved = saved;
    l.slots.push_back({b, -1, {piece}});
  }
}

}  // namespace scaletrain::train

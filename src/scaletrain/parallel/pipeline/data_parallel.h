#pragma once
// Data parallelism inside a pipeline stage: one DDP or sharded engine per
// chunk, over the data-parallel group of this stage's ranks.
//
// A step runs m backwards per chunk. DDP reduces only in the chunk's last one
// (no_sync before: gradient accumulation). ZeRO-1 does the same (its
// gradients stay whole until the step). ZeRO-2/3 and the FSDP strategies
// reduce-scatter in every backward, so gradients stay sharded between
// micro-batches (as DeepSpeed and the trainer do without pipelines); the
// sharded engine keeps the root unit gathered from the first forward to the
// end of the step, because schedules run several forwards before their
// backwards (ShardedOptions::keep_root_between_backwards).
//
// Collectives of one dp group are matched by issue order: every replica of a
// stage runs the same schedule, so its chunks' reductions start in the same
// order everywhere.
#include <memory>

#include "scaletrain/comm/world.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/pipeline/pipeline.h"

namespace scaletrain::parallel::pipeline {

class DdpRunner : public ChunkRunner {
 public:
  DdpRunner(Chunk chunk, comm::Group& dp, DDPOptions options);
  void backward(const std::function<void()>& fn, bool last) override;
  DistributedDataParallel& ddp() { return *ddp_; }

 private:
  std::unique_ptr<DistributedDataParallel> ddp_;
};

class ShardedRunner : public ChunkRunner {
 public:
  // `replicate`: HYBRID_SHARD's other data-parallel group, else null.
  ShardedRunner(Chunk chunk, comm::World& world, comm::Group& shard, comm::Group* replicate,
                fsdp::ShardedOptions options);
  at::Tensor forward(const std::function<at::Tensor()>& fn) override;
  void backward(const std::function<void()>& fn, bool last) override;
  void end_step() override;
  void add_to_grad(const std::string& name, const at::Tensor& grad) override;
  fsdp::ShardedDataParallel& engine() { return *engine_; }

 private:
  std::unique_ptr<fsdp::ShardedDataParallel> engine_;
};

}  // namespace scaletrain::parallel::pipeline

#include "scaletrain/parallel/pipeline/data_parallel.h"

namespace scaletrain::parallel::pipeline {

DdpRunner::DdpRunner(Chunk chunk, comm::Group& dp, DDPOptions options)
    : ddp_(std::make_unique<DistributedDataParallel>(chunk.ptr(), dp, options)) {}

void DdpRunner::backward(const std::function<void()>& fn, bool last) {
  if (last) return fn();
  auto no_sync = ddp_->no_sync();
  fn();
}

ShardedRunner::ShardedRunner(Chunk chunk, comm::World& world, comm::Group& shard, comm::Group* replicate,
                             fsdp::ShardedOptions options) {
  options.keep_root_between_backwards = true;
  engine_ = std::make_unique<fsdp::ShardedDataParallel>(chunk.ptr(), *chunk, world, shard, replicate, options);
}

at::Tensor ShardedRunner::forward(const std::function<at::Tensor()>& fn) { return engine_->forward(fn); }

void ShardedRunner::backward(const std::function<void()>& fn, bool last) {
  if (last || engine_->options().sharding != fsdp::Sharding::Zero1) return fn();
  auto no_sync = engine_->no_sync();
  fn();
}

void ShardedRunner::end_step() { engine_->reshard_all(); }

void ShardedRunner::add_to_grad(const std::string& name, const at::Tensor& grad) { engine_->add_to_grad(name, grad); }

}  // namespace scaletrain::parallel::pipeline

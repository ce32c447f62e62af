#pragma once
// The engine behind the data-parallel dimension as one typed value, resolved
// once from parallel.strategy and parallel.fsdp.sharding_strategy: the typed
// plan (train/plan/plan.h) holds it, and code downstream of the plan switches on
// it; no one compares the strings again.
#include <string>

#include "scaletrain/config/config.h"

namespace scaletrain::config {

enum class DataParallelism {
  kDdp,      // ddp: gradients all-reduced in buckets (parallel/ddp)
  kNoShard,  // fsdp NO_SHARD: runs DDP
  kZero1,    // the sharded engine (parallel/fsdp) with DeepSpeed's stages...
  kZero2,
  kZero3,
  kFullShard,  // ...or with FSDP's sharding strategies
  kShardGradOp,
  kHybridShard,
};
bool runs_ddp(DataParallelism d);          // kDdp or kNoShard
bool shards_params(DataParallelism d);     // zero3, FULL_SHARD, HYBRID_SHARD
bool uses_fsdp_keys(DataParallelism d);    // parallel.strategy=fsdp (the parallel.fsdp section)
int zero_stage(DataParallelism d);         // 1-3 for kZero1-3, else 0
std::string to_string(DataParallelism d);  // "ddp", "zero2", "fsdp FULL_SHARD", ...
// parallel.strategy and parallel.fsdp.sharding_strategy as one value; throws
// UsageError for a name that is neither (validate_config refuses those first).
DataParallelism data_parallelism(const ParallelOptions& p);

}  // namespace scaletrain::config

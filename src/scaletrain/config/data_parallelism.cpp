#include "scaletrain/config/data_parallelism.h"

#include <map>

#include "scaletrain/util/error.h"

namespace scaletrain::config {

bool runs_ddp(DataParallelism d) { return d == DataParallelism::kDdp || d == DataParallelism::kNoShard; }

bool shards_params(DataParallelism d) {
  return d == DataParallelism::kZero3 || d == DataParallelism::kFullShard || d == DataParallelism::kHybridShard;
}

bool uses_fsdp_keys(DataParallelism d) {
  return d == DataParallelism::kNoShard || d == DataParallelism::kFullShard || d == DataParallelism::kShardGradOp ||
         d == DataParallelism::kHybridShard;
}

int zero_stage(DataParallelism d) {
  switch (d) {
    case DataParallelism::kZero1:
      return 1;
    case DataParallelism::kZero2:
      return 2;
    case DataParallelism::kZero3:
      return 3;
    default:
      return 0;
  }
}

std::string to_string(DataParallelism d) {
  switch (d) {
    case DataParallelism::kDdp:
      return "ddp";
    case DataParallelism::kNoShard:
      return "fsdp NO_SHARD";
    case DataParallelism::kZero1:
      return "zero1";
    case DataParallelism::kZero2:
      return "zero2";
    case DataParallelism::kZero3:
      return "zero3";
    case DataParallelism::kFullShard:
      return "fsdp FULL_SHARD";
    case DataParallelism::kShardGradOp:
      return "fsdp SHARD_GRAD_OP";
    case DataParallelism::kHybridShard:
      return "fsdp HYBRID_SHARD";
  }
  return "?";
}

DataParallelism data_parallelism(const ParallelOptions& p) {
  static const std::map<std::string, DataParallelism> strategies{{"ddp", DataParallelism::kDdp},
                                                                 {"zero1", DataParallelism::kZero1},
                                                                 {"zero2", DataParallelism::kZero2},
                                                                 {"zero3", DataParallelism::kZero3}};
  static const std::map<std::string, DataParallelism> fsdp{{"NO_SHARD", DataParallelism::kNoShard},
                                                           {"FULL_SHARD", DataParallelism::kFullShard},
                                                           {"SHARD_GRAD_OP", DataParallelism::kShardGradOp},
                                                           {"HYBRID_SHARD", DataParallelism::kHybridShard}};
  if (p.strategy == "fsdp") {
    const auto it = fsdp.find(p.fsdp.sharding_strategy);
    if (it == fsdp.end())
      throw UsageError("parallel.fsdp.sharding_strategy '" + p.fsdp.sharding_strategy +
                       "' is not one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD");
    return it->second;
  }
  const auto it = strategies.find(p.strategy);
  if (it == strategies.end())
    throw UsageError("parallel.strategy '" + p.strategy + "' is not one of ddp, zero1, zero2, zero3, fsdp");
  return it->second;
}

}  // namespace scaletrain::config

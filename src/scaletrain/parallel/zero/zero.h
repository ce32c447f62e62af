#pragma once
// ZeRO stages 1-3 as options of the sharded engine (parallel/fsdp/fsdp.h).
//
// The stages are the FSDP engine with DeepSpeed's knobs:
//   stage 1: optimizer states sharded; whole gradients reduced into shards
//            once per step; updated shards all-gathered after the step.
//   stage 2: gradients sharded as well: each bucket of gradients is
//            reduce-scattered during backward and only its shard is kept.
//   stage 3: parameters sharded as well: gathered per module just in time.
// Stage 1 and 2 group gradients into buckets of about reduce_bucket_numel
// elements (consecutive blocks, the size wrap policy); stage 3 gathers one
// transformer block at a time, as DeepSpeed gathers per submodule.
#include <cstdint>

#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::parallel::zero {

struct ZeroOptions {
  int stage = 2;                          // 1, 2 or 3 (0 is plain DDP: parallel/ddp)
  int64_t reduce_bucket_numel = 6553600;  // stage 1/2 bucket, elements (25 MiB of fp32)
  bool prefetch = true;                   // stage 3: gather the next block ahead
  int max_inflight_reduces = 2;           // reduce-scatters in flight during backward
};

// The engine options for a stage; throws std::invalid_argument naming a stage
// that does not exist.
fsdp::ShardedOptions sharded_options(const ZeroOptions& options);

}  // namespace scaletrain::parallel::zero

#pragma once
// ZeRO stages 1-3 as options of the sharded engine (parallel/fsdp/fsdp.h).
//
// The stages are the FSDP engine with DeepSpeed's knobs:
//   stage 1: optimizer states sharded; whole gradients reduced into shards
//            once per step, per unit during the last backward; the updated
//            shards are all-gathered per unit just before its next forward.
//   stage 2: gradients sharded as well: each unit's gradients are
//            reduce-scattered during backward and only its shard is kept.
//   stage 3: parameters sharded as well: gathered per module just in time.
// Stages 1 and 2 cut the blocks into units in backward order, as DDP cuts
// its buckets (Note [Backward buckets] in parallel/fsdp/wrap.h); stage 3
// gathers one transformer block at a time, as DeepSpeed gathers per
// submodule, and prefetches ahead within a byte budget and a bound on live
// parameters.
#include <cstdint>

#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::parallel::zero {

struct ZeroOptions {
  int stage = 2;                          // 1, 2 or 3 (0 is plain DDP: parallel/ddp)
  int64_t reduce_bucket_numel = 6553600;  // stage 1/2 bucket (unit) cap, elements (25 MiB of fp32)
  // Stage 1/2: caps of the first unit in backward order and of the last one,
  // and the taper between them (Note [Backward buckets]); 0 turns the taper off.
  int64_t first_bucket_numel = 1 << 18;
  int64_t last_bucket_numel = 1 << 18;
  double tail_growth = 1.5;
  // Stage 1/2: elements of updated parameters moved by one all-gather call
  // (DeepSpeed's allgather_bucket_size); a larger unit takes several calls.
  int64_t allgather_bucket_numel = 6553600;
  // Stage 3: bytes of parameters gathered ahead of the unit in use
  // (DeepSpeed's stage3_prefetch_bucket_size); 0: no prefetch.
  int64_t prefetch_bytes = 50ll << 20;
  // Stage 3: most parameter elements gathered at once before a prefetch
  // waits (stage3_max_live_parameters); a unit in use is always gathered.
  int64_t max_live_numel = 1000000000;
  int max_inflight_reduces = 2;  // reduce-scatters in flight during backward
};

// The engine options for a stage; throws std::invalid_argument naming a stage
// that does not exist or a size that is not positive.
fsdp::ShardedOptions sharded_options(const ZeroOptions& options);

}  // namespace scaletrain::parallel::zero

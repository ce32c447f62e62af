#include "scaletrain/parallel/zero/zero.h"

#include <stdexcept>
#include <string>

namespace scaletrain::parallel::zero {

fsdp::ShardedOptions sharded_options(const ZeroOptions& options) {
  fsdp::ShardedOptions o;
  o.max_inflight_reduces = options.max_inflight_reduces;
  switch (options.stage) {
    case 1:
    case 2:
      o.sharding = options.stage == 1 ? fsdp::Sharding::Zero1 : fsdp::Sharding::Zero2;
      if (options.reduce_bucket_numel <= 0) throw std::invalid_argument("zero: reduce_bucket_numel must be positive");
      if (options.allgather_bucket_numel <= 0)
        throw std::invalid_argument("zero: allgather_bucket_numel must be positive");
      o.wrap.policy = fsdp::WrapPolicy::Buckets;
      o.wrap.min_num_params = options.reduce_bucket_numel;
      o.wrap.first_bucket_numel = options.first_bucket_numel;
      o.wrap.last_bucket_numel = options.last_bucket_numel;
      o.wrap.tail_growth = options.tail_growth;
      o.allgather_bucket_numel = options.allgather_bucket_numel;
      return o;
    case 3:
      if (options.prefetch_bytes < 0) throw std::invalid_argument("zero: prefetch_bytes must be >= 0");
      if (options.max_live_numel <= 0) throw std::invalid_argument("zero: max_live_numel must be positive");
      o.sharding = fsdp::Sharding::Zero3;
      o.wrap.policy = fsdp::WrapPolicy::Transformer;
      o.backward_prefetch = options.prefetch_bytes > 0 ? fsdp::BackwardPrefetch::Pre : fsdp::BackwardPrefetch::None;
      o.forward_prefetch = options.prefetch_bytes > 0;
      o.prefetch_bytes = options.prefetch_bytes;
      // The live bound replaces FSDP's fixed two units.
      o.limit_all_gathers = false;
      o.max_live_numel = options.max_live_numel;
      return o;
    default:
      throw std::invalid_argument("ZeRO stage " + std::to_string(options.stage) +
                                  " does not exist (1, 2 or 3; stage 0 is parallel.strategy=ddp)");
  }
}

}  // namespace scaletrain::parallel::zero

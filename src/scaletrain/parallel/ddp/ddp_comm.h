#pragma once
// Communication helpers of the DDP strategy.
#include <ATen/ATen.h>

#include <vector>

#include "scaletrain/comm/group.h"

namespace scaletrain::parallel::ddp_comm {

// Copies `root`'s values of `tensors` to every rank, one flat broadcast per
// dtype (a few large messages instead of one per tensor).
void broadcast_coalesced(comm::Group& group, const std::vector<at::Tensor>& tensors, int root = 0);

// Starts the average of a gradient bucket across the group. `flat` holds the
// local gradients (fp32); with a 16-bit comm dtype, `staging` (same numel, that
// dtype) carries them and `flat` receives the result when the Work is waited on.
comm::Work start_bucket_average(comm::Group& group, at::Tensor flat, at::Tensor staging);

}  // namespace scaletrain::parallel::ddp_comm

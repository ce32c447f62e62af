#include "scaletrain/parallel/ddp/ddp_comm.h"

#include <torch/torch.h>

#include <map>

namespace scaletrain::parallel::ddp_comm {

void broadcast_coalesced(comm::Group& group, const std::vector<at::Tensor>& tensors, int root) {
  if (group.size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) by_dtype[t.scalar_type()].push_back(t);
  for (auto& [dtype, ts] : by_dtype) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : ts) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    group.broadcast(flat, root).wait();
    int64_t off = 0;
    for (auto& t : ts) {
      t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  }
}

comm::Work start_bucket_average(comm::Group& group, at::Tensor flat, at::Tensor staging) {
  // Divide before summing: the sum of averages cannot overflow where the
  // plain sum of large gradients might.
  flat.div_(group.size());
  if (!staging.defined()) return group.all_reduce(flat, comm::ReduceOp::Sum);
  staging.copy_(flat);
  comm::Work w = group.all_reduce(staging, comm::ReduceOp::Sum);
  return w;
}

}  // namespace scaletrain::parallel::ddp_comm

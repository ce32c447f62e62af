#pragma once
// Batch normalization over the whole data-parallel batch (PyTorch's
// SyncBatchNorm), for user modules under DDP or fully_shard.
//
// Under data parallelism each rank sees 1/W of the batch, and a plain
// BatchNorm normalizes with that part's statistics: the run differs from one
// process on the whole batch (by more the smaller the per-rank batch), and
// each rank's running statistics drift from the others'. SyncBatchNorm
// normalizes with the mean and variance of every rank's part together.
//
// Note [Statistics across ranks]: in training, per channel,
//   mean = S1 / n,  var = S2 / n,   S1 = sum over ranks of sum(x),
//                                   S2 = sum over ranks of sum((x - mean)^2),
// n the element count of the whole batch per channel: two passes, as one
// process computes them, so a float64 run matches one process to rounding
// (the one-pass sum of squares loses digits to cancellation). Each sum
// across ranks is an all-reduce whose backward is an all-reduce too: every
// rank's loss depends on every rank's input through the statistics, so the
// gradient of rank r's input is the sum over ranks s of d loss_s / d x_r.
// Under DDP the parameters' gradients are then averaged over ranks, which
// makes them the gradients of the mean of the ranks' losses: those of one
// process on the whole batch when the ranks' batches are equal. A forward
// costs two all-reduces of C+1 and C elements, its backward two of C.
// Running statistics are updated from the global mean and the global
// unbiased variance, so every rank keeps the same ones.
//
// A C++ module calls its submodules through its own fields (a holder such
// as torch::nn::BatchNorm2d always calls its own impl), so no function can
// swap a BatchNorm for another module from outside, as PyTorch's
// convert_sync_batchnorm does in Python. A module declares SyncBatchNorm
// where it wants synchronized statistics (same options and the same
// parameter and buffer names as BatchNorm{1,2,3}d, so state dicts move
// between the two), and convert_sync_batchnorm binds every one of them to
// the group. Unbound, it is a plain BatchNorm over the local batch (one
// process, the reference runs); DDP refuses a module with an unbound one.
#include <torch/nn/modules/batchnorm.h>

#include <string>

#include "scaletrain/comm/group.h"

namespace scaletrain::parallel {

class SyncBatchNormImpl
    : public torch::nn::NormImplBase<1, SyncBatchNormImpl, torch::nn::BatchNormOptions> {
 public:
  explicit SyncBatchNormImpl(int64_t num_features) : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options) : NormImplBase(options) {}

  // Input [N, C, ...] (any BatchNorm{1,2,3}d input).
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  // The group whose ranks' batches are normalized together (null: local).
  void bind(comm::Group* group) { group_ = group; }
  comm::Group* group() const { return group_; }

 protected:
  void _check_input_dim(const at::Tensor& input) override;

 private:
  comm::Group* group_ = nullptr;
};
TORCH_MODULE(SyncBatchNorm);

// Binds every SyncBatchNorm in `module` to `group` and returns how many
// there are. A torch::nn::BatchNorm{1,2,3}d inside is std::invalid_argument
// naming it (it cannot be replaced from outside: declare SyncBatchNorm).
int convert_sync_batchnorm(torch::nn::Module& module, comm::Group& group);

// The dotted name of the first SyncBatchNorm in `module` bound to no group,
// or "" (DDP refuses such a module).
std::string unbound_sync_batchnorm(const torch::nn::Module& module);

}  // namespace scaletrain::parallel

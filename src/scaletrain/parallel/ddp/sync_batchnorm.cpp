// SyncBatchNorm: Note [Statistics across ranks] in sync_batchnorm.h.
#include "scaletrain/parallel/ddp/sync_batchnorm.h"

#include <torch/autograd.h>
#include <torch/nn/functional/batchnorm.h>

#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <vector>

namespace scaletrain::parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A sum over the group's ranks whose backward is the same sum: each rank's
// loss reads the result, so each input's gradient is the sum of theirs.
struct SumAcross : torch::autograd::Function<SumAcross> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, comm::Group* group) {
    ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(group));
    at::Tensor y = x.contiguous().clone();
    group->all_reduce(y).wait();
    return {y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto* group = reinterpret_cast<comm::Group*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
    at::Tensor g = grad[0].contiguous().clone();
    group->all_reduce(g).wait();
    return {g, at::Tensor()};
  }
};

bool is_plain_batchnorm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m) != nullptr;
}

}  // namespace

void SyncBatchNormImpl::_check_input_dim(const at::Tensor& input) {
  if (input.dim() < 2)
    throw std::invalid_argument("SyncBatchNorm: expected an input [N, C, ...] of at least 2 dimensions, got " +
                                std::to_string(input.dim()));
  if (input.size(1) != options.num_features())
    throw std::invalid_argument("SyncBatchNorm: the input has " + std::to_string(input.size(1)) +
                                " channels (dimension 1), the layer " + std::to_string(options.num_features()));
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  _check_input_dim(input);
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats() && num_batches_tracked.defined()) {
    num_batches_tracked += 1;
    if (!options.momentum()) factor = 1.0 / num_batches_tracked.item<double>();  // cumulative average
  }
  // As PyTorch's: statistics of the batch in training, or whenever no
  // running ones are kept; synchronized only in training.
  if (group_ == nullptr || group_->size() == 1 || !is_training())
    return torch::nn::functional::detail::batch_norm(input, running_mean, running_var, weight, bias,
                                                     is_training() || !options.track_running_stats(), factor,
                                                     options.eps());
  const int64_t c = input.size(1);
  std::vector<int64_t> dims, shape(static_cast<size_t>(input.dim()), 1);
  for (int64_t d = 0; d < input.dim(); ++d)
    if (d != 1) dims.push_back(d);
  shape[1] = c;
  const bool low = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  const at::Tensor x = low ? input.to(at::kFloat) : input;
  // One all-reduce carries the sums and the element count (Note [Statistics across ranks]).
  at::Tensor first = at::cat({x.sum(dims), at::full({1}, static_cast<double>(x.numel() / c), x.options())});
  first = SumAcross::apply(first, group_)[0];
  const double n = first[c].item<double>();
  if (n <= 1)
    throw std::invalid_argument("SyncBatchNorm: expected more than 1 value per channel in training across the " +
                                std::to_string(group_->size()) + " ranks, got " + std::to_string(n));
  const at::Tensor mean = first.narrow(0, 0, c) / n;
  const at::Tensor centered = x - mean.view(shape);
  const at::Tensor var = SumAcross::apply((centered * centered).sum(dims), group_)[0] / n;
  at::Tensor y = centered * (var + options.eps()).rsqrt().view(shape);
  if (options.affine()) y = y * weight.view(shape) + bias.view(shape);
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    running_mean.mul_(1 - factor).add_(mean.detach().to(running_mean.scalar_type()), factor);
    running_var.mul_(1 - factor).add_(var.detach().to(running_var.scalar_type()) * (n / (n - 1)), factor);
  }
  return low ? y.to(input.scalar_type()) : y;
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "scaletrain::parallel::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
         << ", bound=" << (group_ != nullptr) << ")";
}

int convert_sync_batchnorm(torch::nn::Module& module, comm::Group& group) {
  int bound = 0;
  for (const auto& item : module.named_modules()) {
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(item.value().get())) {
      sync->bind(&group);
      ++bound;
    } else if (is_plain_batchnorm(*item.value())) {
      throw std::invalid_argument(
          "convert_sync_batchnorm: '" + (item.key().empty() ? std::string("the module") : item.key()) + "' is a " +
          item.value()->name() +
          ", which a C++ module calls through its own field and no function can replace from outside: declare it "
          "as scaletrain::parallel::SyncBatchNorm (same options, parameter and buffer names)");
    }
  }
  return bound;
}

std::string unbound_sync_batchnorm(const torch::nn::Module& module) {
  for (const auto& item : module.named_modules()) {
    const auto* sync = dynamic_cast<const SyncBatchNormImpl*>(item.value().get());
    if (sync != nullptr && sync->group() == nullptr) return item.key().empty() ? "the module" : item.key();
  }
  return "";
}

}  // namespace scaletrain::parallel

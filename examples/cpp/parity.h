#pragma once
// The examples' check against one process: the largest difference between
// two lists of tensors, each relative to the largest magnitude of `want`'s
// tensor.
#include <torch/torch.h>

#include <algorithm>
#include <vector>

inline double max_relative_difference(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>());
  return worst;
}

#pragma once
// The examples' check against one process. Each program trains in the
// precision its command line asks for and compares its weights with one
// process's:
//   ./program             float64, must agree to 1e-10
//   ./program --float32   float32, must agree to 1e-5
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

struct Precision {
  torch::Dtype dtype;  // of the models and the data
  double tolerance;    // the largest relative difference that passes
  const char* name;
};

// No argument: float64 / 1e-10; `--float32`: float32 / 1e-5; anything else
// prints the usage and exits 2.
inline Precision precision_from_args(int argc, char** argv) {
  if (argc == 1) return {torch::kDouble, 1e-10, "float64"};
  if (argc == 2 && std::strcmp(argv[1], "--float32") == 0) return {torch::kFloat, 1e-5, "float32"};
  std::fprintf(stderr, "usage: %s [--float32]  (default: float64)\n", argv[0]);
  std::exit(2);
}

// The largest difference between two lists of tensors, each relative to the
// largest magnitude of `want`'s tensor.
inline double max_relative_difference(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>());
  return worst;
}

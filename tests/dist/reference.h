#pragma once
// Shared pieces of the parity tests: the global batches every rank draws the
// same way, and the relative difference between two parameter lists.
#include <torch/torch.h>

#include <algorithm>
#include <vector>

namespace scaletrain::test {

struct Batch {
  at::Tensor x, y;  // inputs and next-token targets, [batch, seq]
};

// `steps` global batches of `batch` sequences of `seq` tokens below `vocab`,
// identical on every rank (a fixed seed).
inline std::vector<Batch> make_batches(int steps, int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<Batch> d;
  for (int s = 0; s < steps; ++s) {
    auto tokens = torch::randint(0, vocab, {batch, seq + 1}, gen, torch::kLong);
    d.push_back({tokens.narrow(1, 0, seq).contiguous(), tokens.narrow(1, 1, seq).contiguous()});
  }
  return d;
}

// Per tensor (strict): max over tensors of max|a - b| / max|b|.
// Global: max|a - b| over all tensors / max|b| over all tensors.
// Zero-initialised biases make the per-tensor form divide by ~lr x steps, so
// in fp32 it measures Adam's amplified rounding (Note [Adam amplifies
// summation order] in ddp_test.cpp) rather than the strategy; fp32 and bf16
// comparisons use the global form.
inline double relative_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, bool per_tensor) {
  double worst = 0, diff = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>();
    const double s = b[i].to(at::kDouble).abs().max().item<double>();
    worst = std::max(worst, d / std::max(s, 1e-12));
    diff = std::max(diff, d);
    scale = std::max(scale, s);
  }
  return per_tensor ? worst : diff / scale;
}

}  // namespace scaletrain::test

#pragma once
// Shared pieces of the parity tests: the global batches every rank draws the
// same way, the relative difference between two parameter lists, the
// element-wise statistics the bf16 tests compare, and the check that a run's
// weights really moved.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/zero/zero.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
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

// All elements of `a` minus `b`, as one fp64 vector.
inline at::Tensor flat_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    parts.push_back((a[i].to(at::kDouble) - b[i].to(at::kDouble)).reshape({-1}));
  return at::cat(parts);
}

// The median over all elements of |a - b|: the typical element, blind to the
// few whose Adam update a rounding can flip (Note [bf16 parity bounds] in
// mixed_precision_test.cpp).
inline double median_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  return flat_diff(a, b).abs().median().item<double>();
}

// Note [Weights moved]
// A parity test that compares two runs passes vacuously when neither moved
// (a step never applied, a learning rate lost on the way). A relative test
// against the initial weights does not guard that: a zero-initialised bias
// divides by ~0, so a motion of 1e-15 passes it. So the check is absolute and
// on the tensors that start non-zero and random (the weight matrices, dim >=
// 2), against what AdamW must do with learning rate lr:
//  - its first step moves every element with a non-zero gradient by
//    lr * |g| / (|g| + eps) ~= lr (m-hat / sqrt(v-hat) = g / |g|), and later
//    steps by at most ~lr each, plus decoupled decay lr * wd * |w| (tiny here);
//  - so every matrix moved by at least lr somewhere (max |got - init|;
//    measured 4.7-4.9 lr after 5 steps in the parity tests),
//  - and the mean |got - init| over all matrix elements lies between
//    0.25 and 1.0 x lr x steps (gradients that change sign between steps
//    cancel part of the motion: measured 0.46-0.48 in the parity tests).
// A run that skipped its updates, or ran with a learning rate 3x off, fails.
struct Moved {
  double least_max_abs = 0;  // the smallest, over matrices, of max |got - init|
  double mean_abs = 0;       // mean |got - init| over all matrix elements
};

inline Moved weights_moved(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& init,
                           const std::vector<bool>& skip = {}) {
  Moved m;
  m.least_max_abs = std::numeric_limits<double>::infinity();
  double sum = 0;
  int64_t n = 0;
  for (size_t i = 0; i < got.size() && i < init.size(); ++i) {
    if (got[i].dim() < 2 || (i < skip.size() && skip[i])) continue;
    const auto d = (got[i].to(at::kDouble) - init[i].to(at::kDouble)).abs();
    m.least_max_abs = std::min(m.least_max_abs, d.max().item<double>());
    sum += d.sum().item<double>();
    n += d.numel();
  }
  m.mean_abs = n > 0 ? sum / static_cast<double>(n) : 0;
  if (n == 0) m.least_max_abs = 0;
  return m;
}

// Note [Weights moved], as a test: `skip[i]` marks tensors that must not
// move (frozen).
inline void expect_weights_moved(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& init, double lr,
                                 int steps, const std::string& what, const std::vector<bool>& skip = {}) {
  ASSERT_EQ(got.size(), init.size()) << what;
  const Moved m = weights_moved(got, init, skip);
  EXPECT_GE(m.least_max_abs, lr) << what << ": a weight matrix did not move";
  EXPECT_GE(m.mean_abs, 0.25 * lr * steps) << what << ": the weights moved less than " << steps << " steps of lr " << lr
                                           << " make plausible";
  EXPECT_LE(m.mean_abs, 1.0 * lr * steps) << what << ": the weights moved more than " << steps << " steps of lr " << lr
                                          << " can";
}

// The single-process reference after `steps` AdamW steps on `batches` (one
// whole batch each, clipped to `clip`): parameters and AdamW states by name.
struct Reference {
  std::map<std::string, at::Tensor> param, exp_avg, exp_avg_sq;
};

inline Reference train_reference(models::GPT model, const std::vector<Batch>& batches, int steps, double clip,
                                 double lr) {
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  for (int s = 0; s < steps; ++s) {
    model->loss(batches[s].x, batches[s].y).backward();
    optim::clip_grad_norm(params, clip);
    opt.step(lr);
    opt.zero_grad();
  }
  Reference r;
  int i = 0;
  for (auto& item : model->named_parameters()) {
    r.param[item.key()] = item.value().detach().clone();
    r.exp_avg[item.key()] = opt.exp_avg()[i].clone();
    r.exp_avg_sq[item.key()] = opt.exp_avg_sq()[i].clone();
    ++i;
  }
  return r;
}

// Engine options for a strategy named as the tests name them: zero1..zero3
// (DeepSpeed stages; reduce_bucket_numel > 0 overrides the bucket) or an
// FSDP sharding strategy (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD).
inline parallel::fsdp::ShardedOptions sharded_options_for(const std::string& s, int64_t reduce_bucket_numel = 0) {
  parallel::fsdp::ShardedOptions o;
  if (s.rfind("zero", 0) == 0) {
    parallel::zero::ZeroOptions z;
    z.stage = s.back() - '0';
    if (reduce_bucket_numel > 0) z.reduce_bucket_numel = reduce_bucket_numel;
    o = parallel::zero::sharded_options(z);
  } else {
    o.sharding = parallel::fsdp::parse_sharding(s);
  }
  return o;
}

}  // namespace scaletrain::test

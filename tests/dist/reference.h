#pragma once
// Shared pieces of the parity tests: the global batches every rank draws the
// same way, and the relative difference between two parameter lists.
#include <torch/torch.h>

#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/zero/zero.h"

#include <algorithm>
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

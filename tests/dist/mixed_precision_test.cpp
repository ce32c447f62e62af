// Mixed precision under every data-parallel strategy against the
// single-process run in the same mode:
//  - bf16 autocast with fp32 weights (Accelerate's convention);
//  - bf16 weights with fp32 master weights and fp32 Adam states in the
//    optimizer's shards (DeepSpeed's layout), gradients reduced in fp32 or bf16;
// and the reason master weights exist: updates below bf16's resolution.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/precision/policy.h"

namespace scaletrain::test {
namespace {

using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::ShardedOptions;
using parallel::fsdp::Sharding;

constexpr int64_t kGlobalBatch = 24;
constexpr int kSteps = 5;
constexpr double kLr = 1e-4;

models::GPTConfig small_gpt() { return models::GPTConfig{61, 16, 2, 2, 26}; }
std::vector<Batch> data() { return make_batches(kSteps, kGlobalBatch, 16, 61, 99); }

precision::PrecisionPolicy bf16_autocast() {
  precision::PrecisionOptions o;
  o.mode = "bf16";
  return precision::PrecisionPolicy::from_options(o, /*cuda=*/false);
}

models::GPT make_model(at::ScalarType dtype) {
  torch::manual_seed(42);
  auto m = models::GPT(small_gpt());
  m->to(dtype);
  return m;
}

// One process, whole batch. `param` is the storage dtype; 16-bit storage
// gets fp32 master copies that AdamW updates, then rounds back.
std::vector<at::Tensor> reference(at::ScalarType param, bool autocast) {
  auto model = make_model(param);
  auto params = model->parameters();
  std::vector<at::Tensor> master;
  for (auto& p : params) {
    master.push_back(p.detach().to(at::kFloat).clone());
    master.back().mutable_grad() = at::zeros_like(master.back());
  }
  optim::AdamW opt(master, optim::decay_matrices(master), {});
  const auto policy = bf16_autocast();
  for (auto& b : data()) {
    {
      at::Tensor loss;
      if (autocast) {
        precision::AutocastGuard guard(policy, at::kCPU);
        loss = model->loss(b.x, b.y);
      } else {
        loss = model->loss(b.x, b.y);
      }
      loss.backward();
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      master[i].mutable_grad().copy_(params[i].grad());
      params[i].mutable_grad().zero_();
    }
    optim::clip_grad_norm(master, 1.0);
    opt.step(kLr);
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(master[i]);
  }
  return master;
}

struct Mode {
  at::ScalarType param = at::kFloat;
  at::ScalarType reduce = at::ScalarType::Undefined;
  bool autocast = false;
};

std::vector<at::Tensor> sharded(Sharding s, const Mode& mode) {
  auto model = make_model(mode.param);
  ShardedOptions o;
  o.sharding = s;
  o.master_dtype = at::kFloat;
  o.reduce_dtype = mode.reduce;
  ShardedDataParallel engine(model.ptr(), *model, world(), *world().group(), nullptr, o);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  const int64_t local = kGlobalBatch / world().size();
  const auto policy = bf16_autocast();
  for (auto& b : data()) {
    auto x = b.x.narrow(0, world().rank() * local, local), y = b.y.narrow(0, world().rank() * local, local);
    at::Tensor loss = engine.forward([&] {
      if (!mode.autocast) return model->loss(x, y);
      precision::AutocastGuard guard(policy, at::kCPU);
      return model->loss(x, y);
    });
    loss.backward();
    engine.clip_grad_norm(1.0);
    opt.step(kLr);
    engine.after_step();
    engine.zero_grad();
  }
  // The fp32 masters, whole: every rank fills its pieces, the sum assembles them.
  std::map<std::string, at::Tensor> full;
  for (auto& item : model->named_parameters()) full[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
  for (auto& view : engine.shard_views())
    for (auto& piece : view.pieces)
      full[piece.name]
          .narrow(0, piece.param_offset, piece.numel)
          .copy_(view.shard.narrow(0, piece.shard_offset, piece.numel));
  std::vector<at::Tensor> out;
  for (auto& item : model->named_parameters()) {
    world().group()->all_reduce(full[item.key()]).wait();
    out.push_back(full[item.key()].view(item.value().sizes()));
  }
  return out;
}

std::vector<at::Tensor> ddp_autocast() {
  auto model = make_model(at::kFloat);
  parallel::DistributedDataParallel ddp(model.ptr(), *world().group());
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  const int64_t local = kGlobalBatch / world().size();
  for (auto& b : data()) {
    at::Tensor loss;
    {
      precision::AutocastGuard guard(bf16_autocast(), at::kCPU);
      loss = model->loss(b.x.narrow(0, world().rank() * local, local), b.y.narrow(0, world().rank() * local, local));
    }
    loss.backward();
    optim::clip_grad_norm(params, 1.0);
    opt.step(kLr);
    opt.zero_grad();
  }
  return params;
}

// Note [bf16 parity tolerance]: bf16 matmuls round their outputs to 8 bits of
// mantissa. A weight gradient is a sum over the batch, rounded once in one
// process but per rank (then summed in fp32) in parallel, so gradients differ
// by up to ~2^-8 relative. Adam turns that into update differences of at most
// ~0.4% of lr for large gradients and up to ~2 lr near zero; after 5 steps of
// lr 1e-4 that bounds the change at 1e-3 absolute, 1e-2 of the weights' scale.
// bf16 storage adds one bf16 rounding of each weight per step on both sides.
constexpr double kBf16Tolerance = 1e-2;

void expect_close(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& ref, const std::string& what) {
  const double diff = relative_diff(got, ref, /*per_tensor=*/false);
  EXPECT_LE(diff, kBf16Tolerance) << what << " on " << world().size() << " ranks";
  if (world().rank() == 0)
    std::printf("[mixed] %-44s world %d: max relative diff %.3g\n", what.c_str(), world().size(), diff);
}

const std::vector<Sharding> kSharded{Sharding::Zero1, Sharding::Zero2, Sharding::Zero3, Sharding::FullShard,
                                     Sharding::ShardGradOp};

TEST(MixedPrecision, Bf16AutocastMatchesSingleProcessUnderEveryStrategy) {
  const auto ref = reference(at::kFloat, /*autocast=*/true);
  // Sanity: autocast really changed the numerics (else the test proves nothing).
  EXPECT_GT(relative_diff(ref, reference(at::kFloat, false), false), 1e-7);
  expect_close(ddp_autocast(), ref, "ddp bf16 autocast");
  for (Sharding s : kSharded)
    expect_close(sharded(s, {at::kFloat, at::ScalarType::Undefined, true}), ref,
                 parallel::fsdp::to_string(s) + " bf16 autocast");
}

TEST(MixedPrecision, Bf16WeightsWithFp32MastersMatchSingleProcess) {
  const auto ref = reference(at::kBFloat16, /*autocast=*/false);
  for (Sharding s : kSharded) {
    expect_close(sharded(s, {at::kBFloat16, at::kFloat, false}), ref,
                 parallel::fsdp::to_string(s) + " bf16 weights, fp32 reduce");
    expect_close(sharded(s, {at::kBFloat16, at::kBFloat16, false}), ref,
                 parallel::fsdp::to_string(s) + " bf16 weights, bf16 reduce");
  }
}

// bf16 has 8 bits of mantissa: next to 1.0 its step is 2^-7 = 0.0078. Adam
// moves a weight by ~lr per step, so with lr 1e-3 a bf16 weight rounds back to
// where it was every step and never learns; an fp32 master accumulates the
// steps and the bf16 copy follows once they add up.
TEST(MixedPrecision, MasterWeightsKeepLearningWherePureBf16Stalls) {
  auto make = [] {
    auto m = torch::nn::Linear(torch::nn::LinearOptions(4, 1).bias(false));
    torch::NoGradGuard g;
    m->weight.fill_(1.0);
    m->to(at::kBFloat16);
    return m;
  };
  const auto x = torch::ones({8, 4}, at::kBFloat16);
  // Pure bf16: AdamW on the bf16 weights themselves.
  auto pure = make();
  {
    std::vector<at::Tensor> p{pure->weight};
    optim::AdamW opt(p, std::vector<bool>{false}, {});
    for (int i = 0; i < 50; ++i) {
      pure->forward(x).sum().backward();
      opt.step(1e-3);
      opt.zero_grad();
    }
  }
  EXPECT_EQ(pure->weight.to(at::kFloat).max().item<float>(), 1.0f) << "pure bf16 was expected to stall";
  // fp32 masters through the sharded engine (a Linear is a model of zero blocks).
  struct OneLayer : models::Blockwise {
    int64_t num_blocks() const override { return 0; }
    std::string block_prefix(int64_t) const override { return ""; }
    std::string block_class() const override { return "Block"; }
    void set_block_runner(models::BlockRunner) override {}
  } blocks;
  auto mixed = make();
  ShardedOptions o;
  o.sharding = Sharding::FullShard;
  o.master_dtype = at::kFloat;
  ShardedDataParallel engine(mixed.ptr(), blocks, world(), *world().group(), nullptr, o);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  for (int i = 0; i < 50; ++i) {
    engine.forward([&] { return mixed->forward(x).sum(); }).backward();
    opt.step(1e-3);
    engine.after_step();
    engine.zero_grad();
  }
  auto w = engine.full_parameters()[0].to(at::kFloat);
  EXPECT_LT(w.max().item<float>(), 0.97f) << "fp32 masters should have moved the weight by ~50 x 1e-3";
}

}  // namespace
}  // namespace scaletrain::test

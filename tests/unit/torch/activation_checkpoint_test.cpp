// Activation checkpointing (models/checkpoint.h) in one process: the same
// gradients as the plain model, bit for bit in fp64 (with dropout, under bf16
// autocast, through a block runner), less memory kept between forward and
// backward, and the config key's errors.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "scaletrain/models/checkpoint.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/observe/memory.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/util/error.h"

namespace scaletrain {
namespace activation_checkpoint_test {

using models::ActivationCheckpointing;

models::GPTConfig small(double dropout = 0.0) {
  models::GPTConfig c;
  c.vocab_size = 64;
  c.block_size = 16;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 24;
  c.dropout = dropout;
  if (dropout > 0) c.attention = "naive";  // the path that drops attention probabilities
  return c;
}

struct Batch {
  torch::Tensor idx, targets;
};

Batch batch(const models::GPTConfig& c) {
  torch::manual_seed(7);
  return {torch::randint(c.vocab_size, {3, c.block_size}, torch::kLong),
          torch::randint(c.vocab_size, {3, c.block_size}, torch::kLong)};
}

// Loss and the gradient of every parameter after one forward/backward of a
// freshly built model (same seed, so the same weights), in `dtype`.
struct Result {
  double loss;
  std::vector<torch::Tensor> grads;
  double next_random;  // the generator's next draw after backward
};

Result run(const models::GPTConfig& c, ActivationCheckpointing ckpt, torch::Dtype dtype,
           const interfaces::BlockRunner& runner = nullptr, bool bf16_autocast = false) {
  const Batch b = batch(c);
  torch::manual_seed(1234);
  models::GPT model(c);
  model->to(dtype);
  model->train();
  model->set_activation_checkpointing(ckpt);
  if (runner) model->set_block_runner(runner);
  torch::manual_seed(99);  // dropout draws
  torch::Tensor loss;
  {
    precision::PrecisionPolicy policy;
    if (bf16_autocast) policy.compute = torch::kBFloat16;
    precision::AutocastGuard autocast(policy, torch::kCPU);
    loss = model->loss(b.idx, b.targets);
  }
  loss.backward();  // outside autocast, as the trainer does
  Result r{loss.item<double>(), {}, torch::rand({1}, torch::kDouble).item<double>()};
  for (auto& p : model->parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

void expect_same(const Result& got, const Result& ref, double rtol, const std::string& what) {
  EXPECT_DOUBLE_EQ(got.loss, ref.loss) << what;
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    const double scale = ref.grads[i].abs().max().item<double>() + 1e-300;
    const double diff = (got.grads[i] - ref.grads[i]).abs().max().item<double>();
    EXPECT_LE(diff, rtol * scale) << what << ": parameter " << i;
  }
}

TEST(ActivationCheckpointing, SameGradientsInFp64) {
  const auto c = small();
  const Result ref = run(c, ActivationCheckpointing::None, torch::kDouble);
  const Result got = run(c, ActivationCheckpointing::Full, torch::kDouble);
  expect_same(got, ref, 1e-12, "fp64");
  EXPECT_GT(ref.grads.front().abs().sum().item<double>(), 0) << "no gradient reached the embedding";
}

// The recomputation replays the forward's random numbers: the dropout masks
// are the same, and afterwards the generator is where the plain run left it.
TEST(ActivationCheckpointing, DropoutMasksAreReplayed) {
  const auto c = small(0.2);
  const Result ref = run(c, ActivationCheckpointing::None, torch::kDouble);
  const Result got = run(c, ActivationCheckpointing::Full, torch::kDouble);
  expect_same(got, ref, 1e-12, "dropout 0.2");
  EXPECT_EQ(got.next_random, ref.next_random);
}

// Backward runs outside the autocast region; the recomputation must still
// compute in bf16 as the forward did, or the gradients would move by ~1e-2.
TEST(ActivationCheckpointing, RecomputesUnderTheForwardsAutocast) {
  const auto c = small();
  const Result ref = run(c, ActivationCheckpointing::None, torch::kFloat, nullptr, /*bf16_autocast=*/true);
  const Result got = run(c, ActivationCheckpointing::Full, torch::kFloat, nullptr, /*bf16_autocast=*/true);
  expect_same(got, ref, 1e-6, "bf16 autocast");
  EXPECT_FALSE(at::autocast::is_cpu_enabled()) << "autocast left on after backward";
}

// A strategy's runner wraps the checkpointed body: it is called once per
// block in forward (the recomputation calls the block, not the runner) and
// the gradients are unchanged.
TEST(ActivationCheckpointing, ComposesWithABlockRunner) {
  const auto c = small();
  int calls = 0;
  interfaces::BlockRunner runner = [&calls](int64_t, const interfaces::BlockBody& body, const torch::Tensor& x) {
    ++calls;
    return body(x);
  };
  const Result ref = run(c, ActivationCheckpointing::None, torch::kDouble);
  const Result got = run(c, ActivationCheckpointing::Full, torch::kDouble, runner);
  expect_same(got, ref, 1e-12, "through a runner");
  EXPECT_EQ(calls, c.n_layer);
}

// What one forward leaves alive for backward, counted by the trainer's
// tensor-byte counter: with checkpointing only the block inputs (and the
// head's part) stay, a fraction of the plain model's activations.
TEST(ActivationCheckpointing, KeepsLessForBackward) {
  ASSERT_TRUE(observe::TensorBytes::install());
  models::GPTConfig c = small();
  c.n_layer = 4;
  c.n_embd = 64;
  c.block_size = 64;
  c.n_head = 4;
  const Batch b = batch(c);
  auto saved = [&](ActivationCheckpointing ckpt) {
    models::GPT model(c);
    model->set_activation_checkpointing(ckpt);
    const int64_t before = observe::TensorBytes::current();
    torch::Tensor loss = model->loss(b.idx, b.targets);
    const int64_t kept = observe::TensorBytes::current() - before;
    loss.backward();
    return kept;
  };
  const int64_t plain = saved(ActivationCheckpointing::None), ckpt = saved(ActivationCheckpointing::Full);
  std::printf("[ckpt] kept for backward: %lld bytes plain, %lld checkpointed\n", static_cast<long long>(plain),
              static_cast<long long>(ckpt));
  EXPECT_GT(ckpt, 0);
  EXPECT_LT(ckpt * 4, plain);
}

TEST(ActivationCheckpointing, ConfigKey) {
  config::Config cfg;
  EXPECT_EQ(cfg.model.activation_checkpointing, "none");
  config::apply_override(cfg, "--model.activation_checkpointing=full");
  EXPECT_EQ(cfg.model.activation_checkpointing, "full");
  try {
    config::apply_override(cfg, "--model.activation_checkpointing=selective");
    FAIL() << "accepted an unknown value";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.activation_checkpointing must be one of none | full"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_EQ(models::parse_activation_checkpointing("full"), ActivationCheckpointing::Full);
  EXPECT_THROW(models::parse_activation_checkpointing("yes"), UsageError);
}

}  // namespace activation_checkpoint_test
}  // namespace scaletrain

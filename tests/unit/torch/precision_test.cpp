// Precision building blocks: the policy's validation, the autocast guard and
// the loss scaler's state machine (DeepSpeed's dynamic-scaling semantics).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include <cmath>

#include <ATen/autocast_mode.h>

#include <limits>

#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/util/error.h"

namespace scaletrain::precision {
namespace precision_test {

PrecisionOptions opts(const std::string& mode, const std::string& param = "fp32") {
  PrecisionOptions o;
  o.mode = mode;
  o.param_dtype = param;
  return o;
}

std::string error_of(const PrecisionOptions& o, bool cuda) {
  try {
    PrecisionPolicy::from_options(o, cuda);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(PrecisionPolicy, BuildsAndDescribes) {
  auto p = PrecisionPolicy::from_options(opts("bf16"), /*cuda=*/false);
  EXPECT_EQ(p.compute, at::kBFloat16);
  EXPECT_EQ(p.param, at::kFloat);
  EXPECT_EQ(p.reduce, at::kFloat);  // "" = param dtype
  EXPECT_EQ(p.buffer, at::kFloat);
  EXPECT_FALSE(p.loss_scaling);
  EXPECT_EQ(p.describe(), "compute bf16 (autocast), params fp32, reduce fp32, buffers fp32, loss scaling off");

  auto pure = PrecisionPolicy::from_options(opts("bf16", "bf16"), false);
  EXPECT_EQ(pure.reduce, at::kBFloat16);  // visible in the start-up line, never silent
  EXPECT_EQ(pure.describe(), "compute bf16 (autocast), params bf16, reduce bf16, buffers bf16, loss scaling off");
  auto o = opts("bf16", "bf16");
  o.reduce_dtype = "fp32";
  EXPECT_EQ(PrecisionPolicy::from_options(o, false).reduce, at::kFloat);
  o.scale_bf16 = true;
  EXPECT_TRUE(PrecisionPolicy::from_options(o, false).loss_scaling);

  auto fp16 = PrecisionPolicy::from_options(opts("fp16"), /*cuda=*/true);
  EXPECT_EQ(fp16.compute, at::kHalf);
  EXPECT_TRUE(fp16.loss_scaling);
  EXPECT_TRUE(PrecisionPolicy::from_options(opts("fp16", "fp16"), true).loss_scaling);
  auto fp32 = PrecisionPolicy::from_options(opts("fp32"), false);
  EXPECT_FALSE(fp32.autocast());
  EXPECT_FALSE(fp32.loss_scaling);
}

TEST(PrecisionPolicy, RejectsUnusableCombinations) {
  auto m = error_of(opts("fp16"), /*cuda=*/false);
  EXPECT_NE(m.find("fp16 needs CUDA: CPU has no fp16 matmul in libtorch 1.13; use bf16"), std::string::npos) << m;
  EXPECT_NE(error_of(opts("fp16", "fp16"), false).find("fp16 needs CUDA"), std::string::npos);
  EXPECT_NE(error_of(opts("fp32", "bf16"), false).find("precision.param_dtype=bf16 needs precision.mode=bf16"),
            std::string::npos);
  auto mixed = opts("bf16");
  mixed.reduce_dtype = "fp16";
  EXPECT_NE(error_of(mixed, true).find("mixes bf16 and fp16"), std::string::npos);
  EXPECT_NE(error_of(opts("fp8"), true).find("precision.mode must be one of"), std::string::npos);
  for (const auto& msg : {error_of(opts("fp16"), false), error_of(mixed, true)})
    EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(PrecisionAutocast, MatmulDtypeInsideAndOutside) {
  auto a = torch::randn({8, 8}), b = torch::randn({8, 8});
  const auto bf16 = PrecisionPolicy::from_options(opts("bf16"), false);
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  {
    AutocastGuard guard(bf16, at::kCPU);
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    {
      // An fp32 policy inside switches autocast off for its region.
      AutocastGuard off(PrecisionPolicy::from_options(opts("fp32"), false), at::kCPU);
      EXPECT_FALSE(at::autocast::is_cpu_enabled());
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
      {
        AutocastGuard again(bf16, at::kCPU);
        EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
      }
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
    }
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    EXPECT_EQ(at::autocast::get_autocast_cpu_dtype(), at::kBFloat16);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  // CPU autocast is bf16 only.
  EXPECT_THROW(AutocastGuard(PrecisionPolicy{at::kHalf}, at::kCPU), UsageError);
}

TEST(PrecisionAutocast, BackwardThroughAutocastGivesFp32Grads) {
  auto w = torch::randn({4, 4}, torch::requires_grad());
  auto x = torch::randn({2, 4});
  at::Tensor y;
  {
    AutocastGuard guard(PrecisionPolicy::from_options(opts("bf16"), false), at::kCPU);
    y = torch::mm(x, w);
  }
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  y.to(at::kFloat).sum().backward();
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
}

// ---- LossScaler ---------------------------------------------------------------

LossScalerOptions small(int64_t interval = 3, int hysteresis = 2) {
  LossScalerOptions o;
  o.initial_scale = 8;
  o.growth_interval = interval;
  o.hysteresis = hysteresis;
  o.min_scale = 1;
  return o;
}

// Typed options reach the scaler directly (ModuleTrainerOptions::loss_scaling): NaN, infinities
// and negatives are refused by name, never turned into a scale.
TEST(LossScaler, NonFiniteOrNegativeSettingsAreRefused) {
  const double nan = std::nan(""), inf = std::numeric_limits<double>::infinity();
  const std::vector<std::function<void(LossScalerOptions&)>> edits = {
      [&](auto& o) { o.static_scale = nan; },   [&](auto& o) { o.static_scale = inf; },
      [&](auto& o) { o.static_scale = -1; },    [&](auto& o) { o.initial_scale = nan; },
      [&](auto& o) { o.initial_scale = inf; },  [&](auto& o) { o.min_scale = nan; },
      [&](auto& o) { o.growth_factor = nan; },  [&](auto& o) { o.backoff_factor = nan; },
      [&](auto& o) { o.growth_factor = inf; }};
  for (size_t i = 0; i < edits.size(); ++i) {
    LossScalerOptions o;
    edits[i](o);
    EXPECT_THROW(LossScaler{o}, UsageError) << "edit " << i;
  }
  EXPECT_NO_THROW(LossScaler{LossScalerOptions{}});
}

TEST(LossScaler, GrowsAfterTheInterval) {
  LossScaler s(small(3));
  EXPECT_EQ(s.scale(), 8);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 8);
  s.update(false);
  EXPECT_EQ(s.scale(), 16);
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 32);
  EXPECT_EQ(s.skipped_steps(), 0);
}

TEST(LossScaler, HysteresisThenBackoff) {
  LossScaler s(small(3, 2));
  s.update(true);  // one credit spent, scale kept
  EXPECT_EQ(s.scale(), 8);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  s.update(true);  // credits exhausted: back off
  EXPECT_EQ(s.scale(), 4);
  s.update(true);  // not refilled by the backoff (DeepSpeed): backs off again
  EXPECT_EQ(s.scale(), 2);
  EXPECT_EQ(s.skipped_steps(), 3);
  // Good steps since the last overflow count towards growth, which refills the credits.
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 2);
  EXPECT_EQ(s.state().hysteresis_left, 1);  // good steps alone do not refill
  s.update(false);
  EXPECT_EQ(s.scale(), 4);
  EXPECT_EQ(s.state().hysteresis_left, 2);
  // An overflow resets the good-step count.
  s.update(false);
  s.update(false);
  s.update(true);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 4);
  s.update(false);
  EXPECT_EQ(s.scale(), 8);
}

TEST(LossScaler, MinScaleIsAFloorThenAnError) {
  auto o = small(100, 1);
  o.min_scale = 3;
  LossScaler s(o);
  s.update(true);
  EXPECT_EQ(s.scale(), 4);
  s.update(true);
  EXPECT_EQ(s.scale(), 3);  // max(2, min_scale)
  try {
    s.update(true);
    FAIL() << "no error at min_scale";
  } catch (const LossScaleError& e) {
    EXPECT_NE(std::string(e.what()).find("loss scale reached min_loss_scale=3 and gradients still overflow"),
              std::string::npos)
        << e.what();
  }
  // With hysteresis, the credits are spent first even at the floor.
  auto h = small(100, 2);
  h.initial_scale = 1;
  LossScaler t(h);
  t.update(true);
  EXPECT_EQ(t.scale(), 1);
  EXPECT_THROW(t.update(true), LossScaleError);
}

TEST(LossScaler, StaticScaleNeverChangesButSkips) {
  LossScalerOptions o;
  o.static_scale = 128;
  LossScaler s(o);
  EXPECT_FALSE(s.dynamic());
  for (int i = 0; i < 5000; ++i) s.update(i % 7 == 0);
  EXPECT_EQ(s.scale(), 128);
  EXPECT_EQ(s.skipped_steps(), 715);  // i = 0, 7, ..., 4998
}

TEST(LossScaler, UnscaleAndCheckLocally) {
  LossScaler s(small());
  auto g1 = torch::full({4}, 8.0), g2 = torch::full({2, 2}, 16.0);
  at::Tensor none;
  EXPECT_FALSE(s.unscale_and_check({g1, none, g2}, {}));
  EXPECT_TRUE(torch::allclose(g1, torch::ones({4})));
  EXPECT_TRUE(torch::allclose(g2, torch::full({2, 2}, 2.0)));
  auto bad = torch::full({3}, 8.0);
  bad[1] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(s.unscale_and_check({g1, bad}, {}));
  EXPECT_TRUE(torch::allclose(g1, torch::ones({4})));  // left as it was
  auto nan = torch::full({3}, 8.0, torch::kBFloat16);
  nan[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(s.unscale_and_check({nan}, {}));
  EXPECT_FALSE(s.unscale_and_check({}, {}));
}

TEST(LossScaler, StateRoundTrip) {
  LossScaler s(small(3, 3));
  s.update(true);
  s.update(false);
  auto m = s.state().to_map();
  EXPECT_EQ(m.at("scale"), 8);
  EXPECT_EQ(m.at("good_steps"), 1);
  EXPECT_EQ(m.at("hysteresis_left"), 2);
  EXPECT_EQ(m.at("skipped"), 1);
  LossScaler t(small(3, 3));
  t.load_state(LossScalerState::from_map(m));
  for (auto* x : {&s, &t}) x->update(false), x->update(false);
  EXPECT_EQ(t.scale(), 16);
  EXPECT_EQ(t.state().to_map(), s.state().to_map());
  m.erase("skipped");
  EXPECT_THROW(LossScalerState::from_map(m), UsageError);
}

TEST(LossScaler, OptionsFromConfig) {
  PrecisionOptions p;
  p.initial_scale_power = 12;
  p.loss_scale_window = 500;
  p.hysteresis = 4;
  p.min_loss_scale = 2;
  auto o = loss_scaler_options(p);
  EXPECT_EQ(o.initial_scale, 4096);
  EXPECT_EQ(o.growth_interval, 500);
  EXPECT_EQ(o.hysteresis, 4);
  EXPECT_EQ(o.min_scale, 2);
  EXPECT_EQ(o.static_scale, 0);
  LossScalerOptions bad;
  bad.backoff_factor = 1.5;
  EXPECT_THROW(LossScaler{bad}, UsageError);
}

}  // namespace precision_test
}  // namespace scaletrain::precision

// FP8 tensors (precision/fp8.h): the tensor cast equals the scalar codec
// (itself checked against tests/reference/fp8.py in tests/unit/core), and the
// scaling recipes follow Note [FP8 scaling].
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "scaletrain/precision/fp8.h"

namespace scaletrain::precision {
namespace {

// Magnitudes from far below the smallest subnormal to beyond the largest value,
// the specials, and every code's value and the midpoints between neighbours.
at::Tensor hard_values() {
  torch::manual_seed(3);
  std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 448.0f, 464.0f, 470.0f, 57344.0f, 61440.0f, 1e30f};
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (int c = 0; c < 127; ++c) {
      const float a = fp8_decode(static_cast<uint8_t>(c), f), b = fp8_decode(static_cast<uint8_t>(c + 1), f);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      for (float x : {a, (a + b) / 2, std::nextafter((a + b) / 2, 0.0f)}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  at::Tensor wide = at::exp2(torch::rand({4000}) * 60 - 30) * (torch::rand({4000}) - 0.5).sign();
  return at::cat({torch::tensor(v), wide.to(at::kFloat)});
}

TEST(Fp8Tensor, QuantizeIsTheScalarCodecElementwise) {
  const at::Tensor x = hard_values();
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (bool saturate : {true, false})
      for (double scale : {1.0, 0.37, 1024.0}) {
        const at::Tensor codes = fp8_quantize(x, f, scale, saturate);
        ASSERT_EQ(codes.scalar_type(), at::kByte);
        const auto xs = x.accessor<float, 1>();
        const auto cs = codes.accessor<uint8_t, 1>();
        int wrong = 0;
        for (int64_t i = 0; i < x.numel(); ++i) {
          const uint8_t want = fp8_encode(xs[i] * static_cast<float>(scale), f, saturate);
          if (cs[i] != want && ++wrong <= 5)
            ADD_FAILURE() << "x " << xs[i] << " scale " << scale << ": " << int(cs[i]) << ", scalar " << int(want);
        }
        EXPECT_EQ(wrong, 0);
      }
}

TEST(Fp8Tensor, DequantizeDividesTheDecodedValuesByTheScale) {
  const at::Tensor codes = torch::arange(256, torch::kLong).to(at::kByte).view({16, 16});
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    const at::Tensor v = fp8_dequantize(codes, f, 4.0);
    EXPECT_EQ(v.sizes(), codes.sizes());
    for (int c = 0; c < 256; ++c) {
      const float want = fp8_decode(static_cast<uint8_t>(c), f) / 4.0f;
      const float got = v.view(-1)[c].item<float>();
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(got));
      else
        EXPECT_EQ(got, want) << c;
    }
    // A round trip through FP8 is within half a step of the value (E4M3: 2^-4 relative).
    const at::Tensor x = torch::randn({1000});
    const double amax = x.abs().max().item<double>();
    const double scale = fp8_scale(amax, f, 0, 1.0);
    const at::Tensor back = fp8_dequantize(fp8_quantize(x, f, scale), f, scale);
    const double step = f == Fp8Format::E4M3 ? 1.0 / 16 : 1.0 / 8;
    EXPECT_TRUE(((back - x).abs() <= x.abs() * step + 1e-6 * amax).all().item<bool>());
  }
}

TEST(Fp8Scaling, ScaleFormulaAndWhatKeepsThePreviousScale) {
  EXPECT_DOUBLE_EQ(fp8_scale(2.0, Fp8Format::E4M3, 0, 1.0), 224.0);
  EXPECT_DOUBLE_EQ(fp8_scale(2.0, Fp8Format::E4M3, 1, 1.0), 112.0);
  EXPECT_DOUBLE_EQ(fp8_scale(57344.0, Fp8Format::E5M2, 0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(fp8_scale(0.0, Fp8Format::E4M3, 0, 3.0), 3.0);
  EXPECT_DOUBLE_EQ(fp8_scale(INFINITY, Fp8Format::E4M3, 0, 3.0), 3.0);
  EXPECT_DOUBLE_EQ(fp8_scale(NAN, Fp8Format::E4M3, 0, 3.0), 3.0);
  EXPECT_EQ(fp8_format(Fp8Mix::Hybrid, false), Fp8Format::E4M3);
  EXPECT_EQ(fp8_format(Fp8Mix::Hybrid, true), Fp8Format::E5M2);
  EXPECT_EQ(fp8_format(Fp8Mix::E4M3, true), Fp8Format::E4M3);
}

TEST(Fp8Scaling, DelayedScalingUsesTheLargestAmaxOfTheHistory) {
  DelayedScaling d(Fp8Format::E4M3, /*history=*/3);
  EXPECT_DOUBLE_EQ(d.scale(), 1.0);  // nothing recorded yet
  d.record(0.0);
  EXPECT_DOUBLE_EQ(d.scale(), 1.0);  // an amax of 0 keeps the scale
  d.record(4.0);
  EXPECT_DOUBLE_EQ(d.scale(), 112.0);
  d.record(1.0);
  d.record(2.0);  // the history is {4, 1, 2}... now full, 0 has left it
  EXPECT_DOUBLE_EQ(d.scale(), 112.0);
  d.record(NAN);  // not recorded, the scale stays
  EXPECT_DOUBLE_EQ(d.scale(), 112.0);
  d.record(1.0);  // {1, 2, 1}: 4 has left the history
  EXPECT_DOUBLE_EQ(d.scale(), 224.0);
  EXPECT_EQ(d.history().size(), 3u);
  EXPECT_THROW(DelayedScaling(Fp8Format::E4M3, 0), std::invalid_argument);
  // Current scaling is a history of one.
  DelayedScaling current(Fp8Format::E5M2, 1);
  current.record(8.0);
  current.record(1.0);
  EXPECT_DOUBLE_EQ(current.scale(), 57344.0);
}

TEST(Fp8Scaling, AmaxOfATensorWithoutGroups) {
  EXPECT_DOUBLE_EQ(reduce_amax(torch::tensor({1.0f, -7.5f, 3.0f})), 7.5);
  EXPECT_DOUBLE_EQ(reduce_amax(torch::zeros({0})), 0.0);
}

}  // namespace
}  // namespace scaletrain::precision

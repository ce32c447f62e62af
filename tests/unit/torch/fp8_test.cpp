// FP8 tensors (precision/fp8.h): the tensor cast equals the scalar codec
// (itself checked against tests/reference/fp8.py in tests/unit/core), and the
// scaling recipes follow Note [FP8 scaling], and an FP8 linear computes what
// its dequantized operands give (Note [FP8 linears]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <random>

#include "scaletrain/models/linear.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/policy.h"

namespace scaletrain::precision {
namespace fp8_test {

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
  // The hard values, and every kind of fp32 bit pattern (subnormals, huge, NaN payloads).
  const at::Tensor bits = torch::randint(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                                         {50000}, torch::kInt);
  const at::Tensor x = at::cat({hard_values(), bits.view(at::kFloat)});
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (bool saturate : {true, false})
      for (double scale : {1.0, 0.37, 1024.0})
        for (bool tensor_ops : {false, true}) {
        SCOPED_TRACE(tensor_ops ? "tensor operations (the device path)" : "the host loop");
        const at::Tensor codes = tensor_ops ? fp8_quantize_by_tensor_ops(x, f, scale, saturate)
                                            : fp8_quantize(x, f, scale, saturate);
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
    // A round trip through FP8 is within half a step of the value: 2^-4 relative for E4M3's
    // normal numbers, 2^-3 for E5M2's; below the smallest normal the step is fixed, so the
    // error there is at most half the smallest subnormal (E4M3 2^-9, E5M2 2^-16), unscaled.
    // Seeded: every draw must pass, and a failure must reproduce.
    torch::manual_seed(1234 + static_cast<int>(f));
    const at::Tensor x = torch::randn({100000});
    const double amax = x.abs().max().item<double>();
    const double scale = fp8_scale(amax, f, 0, 1.0);
    const at::Tensor back = fp8_dequantize(fp8_quantize(x, f, scale), f, scale);
    const double step = f == Fp8Format::E4M3 ? 1.0 / 16 : 1.0 / 8;
    const double tiny = (f == Fp8Format::E4M3 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -17)) / scale;
    const at::Tensor err = (back - x).abs();
    EXPECT_TRUE((err <= x.abs() * step + tiny * (1 + 1e-6)).all().item<bool>());
    if (f == Fp8Format::E4M3)  // the draw reaches E4M3's subnormals (below 2^-6 scaled)
      EXPECT_TRUE((x.abs() * scale < std::ldexp(1.0, -6)).any().item<bool>());
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

// The reference of an FP8 operand: every element cast by the scalar codec
// (not the tensor cast under test) at the scale fp8_max / amax, decoded to
// double. Returns the values and the scale.
std::pair<at::Tensor, double> reference_cast(const at::Tensor& x, Fp8Format f) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const double scale = fp8_max(f) / xf.abs().max().item<double>();
  at::Tensor out = torch::empty(xf.sizes(), torch::kDouble);
  const float* src = xf.data_ptr<float>();
  double* dst = out.data_ptr<double>();
  for (int64_t i = 0; i < xf.numel(); ++i)
    dst[i] = fp8_decode(fp8_encode(src[i] * static_cast<float>(scale), f), f);
  return {out, scale};
}

Fp8LinearOptions current(Fp8Mix mix = Fp8Mix::Hybrid) {
  Fp8LinearOptions o;
  o.delayed = false;
  o.mix = mix;
  return o;
}

TEST(Fp8Linear, ForwardAndBackwardEqualTheDequantizedOperands) {
  torch::manual_seed(11);
  const at::Tensor x = (torch::randn({2, 5, 16}) * 3).requires_grad_(true);
  const at::Tensor w = (torch::randn({8, 16}) * 0.2).requires_grad_(true);
  const at::Tensor r = torch::randn({2, 5, 8}) * 1e-3;  // the output's gradient
  Fp8Linear layer(current());
  const at::Tensor y = layer.matmul(x, w);
  (y * r).sum().backward();

  const auto [xr, sx] = reference_cast(x.detach(), Fp8Format::E4M3);
  const auto [wr, sw] = reference_cast(w.detach(), Fp8Format::E4M3);
  const auto [gr, sg] = reference_cast(r, Fp8Format::E5M2);
  const at::Tensor y_ref = at::matmul(xr, wr.t()) / (sx * sw);
  const at::Tensor dx_ref = at::matmul(gr, wr) / (sg * sw);
  const at::Tensor dw_ref = gr.reshape({-1, 8}).t().mm(xr.reshape({-1, 16})) / (sg * sx);
  EXPECT_DOUBLE_EQ(layer.scale(Fp8Linear::Input), sx);
  EXPECT_DOUBLE_EQ(layer.scale(Fp8Linear::Grad), sg);
  // fp32 sums of 16 exact products, then one fp32 scaling: a few ulps.
  EXPECT_TRUE(torch::allclose(y.to(at::kDouble), y_ref, 1e-6, 1e-9));
  EXPECT_TRUE(torch::allclose(x.grad().to(at::kDouble), dx_ref, 1e-6, 1e-12));
  EXPECT_TRUE(torch::allclose(w.grad().to(at::kDouble), dw_ref, 1e-6, 1e-12));
  // And it is not the fp32 product: the casts lose precision.
  const at::Tensor exact = at::matmul(x.detach(), w.detach().t());
  EXPECT_GT((y.detach() - exact).abs().max().item<double>(), 1e-3 * exact.abs().max().item<double>());
}

TEST(Fp8Linear, E4m3EverywhereCastsGradientsToE4m3) {
  torch::manual_seed(12);
  const at::Tensor x = torch::randn({4, 16}).requires_grad_(true), w = torch::randn({8, 16});
  const at::Tensor r = torch::randn({4, 8});
  Fp8Linear layer(current(Fp8Mix::E4M3));
  (layer.matmul(x, w) * r).sum().backward();
  const auto [gr, sg] = reference_cast(r, Fp8Format::E4M3);
  const auto [wr, sw] = reference_cast(w, Fp8Format::E4M3);
  EXPECT_TRUE(torch::allclose(x.grad().to(at::kDouble), at::matmul(gr, wr) / (sg * sw), 1e-6, 1e-12));
}

TEST(Fp8Linear, DelayedScalesChangeOnlyAtTheEndOfAStep) {
  torch::manual_seed(13);
  Fp8LinearOptions o;
  o.history = 2;
  auto layer = std::make_shared<Fp8Linear>(o);
  const at::Tensor w = torch::randn({8, 16});
  for (double mag : {4.0, 2.0, 1.0}) {
    const double before = layer->scale(Fp8Linear::Input);
    at::Tensor x = torch::randn({3, 16});
    x = x / x.abs().max() * mag;  // amax exactly mag
    layer->matmul(x, w);
    layer->matmul(x / 2, w);  // a second micro-batch: the step's amax stays mag
    EXPECT_EQ(layer->scale(Fp8Linear::Input), before) << "a scale changed within a step";
    EXPECT_DOUBLE_EQ(layer->step_amax()[Fp8Linear::Input], mag);
    fp8_end_step({layer}, {});
    EXPECT_DOUBLE_EQ(layer->step_amax()[Fp8Linear::Input], 0.0);
  }
  // History 2 holds the last two steps' amaxes (2, 1): the scale follows the larger.
  EXPECT_DOUBLE_EQ(layer->scale(Fp8Linear::Input), 448.0 / 2.0);
}

TEST(Fp8Linear, OutputIsInTheAutocastDtype) {
  const at::Tensor x = torch::randn({4, 16}), w = torch::randn({8, 16});
  Fp8Linear layer(current());
  EXPECT_EQ(layer.matmul(x, w).scalar_type(), at::kFloat);
  PrecisionOptions po;
  po.mode = "bf16";
  const PrecisionPolicy policy = PrecisionPolicy::from_options(po, false);
  AutocastGuard autocast(policy, at::kCPU);  // host: CPU autocast is what this build runs
  const at::Tensor y = layer.matmul(x, w);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  // The product itself was formed in fp32 and rounded once to bf16.
  Fp8Linear again(current());
  at::Tensor y32;
  {
    PrecisionOptions fp32;
    AutocastGuard off(PrecisionPolicy::from_options(fp32, false), at::kCPU);  // host: as above
    y32 = again.matmul(x, w);
  }
  EXPECT_TRUE(torch::equal(y, y32.to(at::kBFloat16)));
}

TEST(Fp8Linear, UseFp8ReachesEveryModelsLinear) {
  torch::manual_seed(14);
  auto root = std::make_shared<torch::nn::Module>();
  models::Linear a(16, 8, true), b(8, 4, false);
  root->register_module("a", a);
  root->register_module("b", b);
  root->register_module("other", torch::nn::Linear(4, 4));  // not a models::Linear: left alone
  const at::Tensor x = torch::randn({3, 16});
  const at::Tensor plain = b(a(x));
  const auto layers = models::use_fp8(*root, current());
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(a->fp8, layers[0]);
  const at::Tensor fp8 = b(a(x));
  EXPECT_FALSE(torch::allclose(fp8, plain, 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(fp8, plain, 0.2, 0.05)) << "FP8 is an approximation, not noise";
  // The bias is added in full precision after the FP8 product.
  EXPECT_TRUE(torch::allclose(a(x) - a->bias, layers[0]->matmul(x, a->weight), 0, 1e-6));
}

// Note [FP8 scaling state]: a restored history (only the entries larger than
// every younger one, the rest 0) gives the same scale as the original after
// every further record, and the state of layers round-trips; a state for
// another model or with a bad number is refused.
TEST(Fp8Scaling, RestoredStateGivesTheSameScales) {
  std::mt19937 gen(9);
  std::uniform_real_distribution<double> amax(0.0, 10.0);
  for (int64_t length : {1, 5, 16}) {
    Fp8LinearOptions o;
    o.history = length;
    auto a = std::make_shared<Fp8Linear>(o), b = std::make_shared<Fp8Linear>(o);
    for (int s = 0; s < 11; ++s) a->end_step({amax(gen), amax(gen), s % 4 == 0 ? 0.0 : amax(gen)});
    const std::vector<double> state = fp8_scaling_state({a}, {});
    // Compressed: never more than the history, usually far less.
    EXPECT_LE(state.size(), 3 * (3 + 2 * static_cast<size_t>(length)));
    fp8_restore_scaling({b}, state);
    for (int s = 0; s < 25; ++s) {
      for (auto op : {Fp8Linear::Input, Fp8Linear::Weight, Fp8Linear::Grad})
        ASSERT_EQ(a->scale(op), b->scale(op)) << "history " << length << ", step " << s << ", operand " << op;
      const std::array<double, 3> next{amax(gen), amax(gen), amax(gen) * (s % 3)};
      a->end_step(next);
      b->end_step(next);
    }
  }
  Fp8LinearOptions o;
  auto one = std::make_shared<Fp8Linear>(o), other = std::make_shared<Fp8Linear>(o);
  one->end_step({1, 2, 3});
  std::vector<double> state = fp8_scaling_state({one}, {});
  EXPECT_THROW(fp8_restore_scaling({one, other}, state), std::invalid_argument);  // another model
  EXPECT_THROW(fp8_restore_scaling({}, state), std::invalid_argument);
  state[0] = std::nan("");
  EXPECT_THROW(fp8_restore_scaling({one}, state), std::invalid_argument);
}

}  // namespace fp8_test
}  // namespace scaletrain::precision

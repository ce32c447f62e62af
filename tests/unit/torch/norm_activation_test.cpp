// Parity tests of the fused RMSNorm, residual-add + RMSNorm and SwiGLU
// kernels against their unfused ATen references: outputs and every input
// gradient under random upstream gradients, for odd widths and row counts,
// 3-D and non-contiguous inputs, mixed weight dtypes, bit-identical results
// for one and two threads, and the messages of bad input.
//
// Error measure: err(a, ref) = max|a - ref| / max(1, max|ref|), i.e. absolute
// for values of magnitude up to 1 and relative to the largest value above.
// Bounds: 1e-10 (fp64), 1e-5 (fp32), 2e-2 (bf16).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "scaletrain/kernels/norm_activation.h"
#include "scaletrain/util/error.h"

namespace norm_activation_test {

using torch::Tensor;
namespace k = scaletrain::kernels;

constexpr double kEps = 1e-5;

double err(const Tensor& a, const Tensor& ref) {
  const auto r = ref.to(torch::kDouble);
  const double scale = std::max(1.0, r.abs().max().item<double>());
  return (a.to(torch::kDouble) - r).abs().max().item<double>() / scale;
}

double bound(at::ScalarType t) {
  if (t == at::kDouble) return 1e-10;
  if (t == at::kFloat) return 1e-5;
  return 2e-2;
}

Tensor leaf(const Tensor& t) { return t.detach().clone().requires_grad_(true); }

// Results of one call: its outputs, then the gradients of its inputs.
struct Outcome {
  std::vector<Tensor> outputs, grads;
};

// Calls fn on fresh leaf copies of `inputs` and back-propagates the fixed
// upstream gradients `upstream` (one per output).
Outcome run(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs,
        const std::vector<Tensor>& upstream) {
  std::vector<Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(leaf(t));
  Outcome r;
  r.outputs = fn(leaves);
  r.grads = torch::autograd::grad(r.outputs, leaves, upstream);
  return r;
}

using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

Fn rms(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{fused ? k::rms_norm(in[0], in[1], kEps) : k::rms_norm_unfused(in[0], in[1], kEps)};
  };
}

Fn add_rms(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    auto out = fused ? k::add_rms_norm(in[0], in[1], in[2], kEps) : k::add_rms_norm_unfused(in[0], in[1], in[2], kEps);
    return std::vector<Tensor>{std::get<0>(out), std::get<1>(out)};
  };
}

Fn glu(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{fused ? k::swiglu(in[0], in[1]) : k::swiglu_unfused(in[0], in[1])};
  };
}

// Random upstream gradients shaped like the reference's outputs.
std::vector<Tensor> upstream_for(const Fn& reference, const std::vector<Tensor>& inputs) {
  torch::NoGradGuard no_grad;
  std::vector<Tensor> ups;
  for (const auto& o : reference(inputs)) ups.push_back(torch::randn(o.sizes(), torch::kDouble).to(o.scalar_type()));
  return ups;
}

// Fused vs unfused: same dtypes and shapes, values within the bound of `tol_type`.
void expect_parity(const Fn& fused, const Fn& reference, const std::vector<Tensor>& inputs, at::ScalarType tol_type,
                   const std::string& what) {
  const auto ups = upstream_for(reference, inputs);
  const Outcome got = run(fused, inputs, ups);
  const Outcome want = run(reference, inputs, ups);
  ASSERT_EQ(got.outputs.size(), want.outputs.size()) << what;
  auto compare = [&](const Tensor& a, const Tensor& b, const std::string& name) {
    ASSERT_TRUE(a.defined() && b.defined()) << what << " " << name;
    EXPECT_EQ(a.scalar_type(), b.scalar_type()) << what << " " << name;
    EXPECT_EQ(a.sizes(), b.sizes()) << what << " " << name;
    EXPECT_LE(err(a, b), bound(tol_type)) << what << " " << name;
  };
  for (size_t i = 0; i < got.outputs.size(); ++i) compare(got.outputs[i], want.outputs[i], "output " + std::to_string(i));
  for (size_t i = 0; i < got.grads.size(); ++i) compare(got.grads[i], want.grads[i], "grad " + std::to_string(i));
}

Tensor rnd(at::IntArrayRef sizes, at::ScalarType t, double scale = 1, double shift = 0) {
  return (torch::randn(sizes, torch::kDouble) * scale + shift).to(t);
}

std::string label(at::ScalarType t, int64_t rows, int64_t c) {
  return std::string(c10::toString(t)) + " rows=" + std::to_string(rows) + " C=" + std::to_string(c);
}

const at::ScalarType kTypes[] = {at::kDouble, at::kFloat, at::kBFloat16};
const int64_t kRows[] = {1, 5, 130};
const int64_t kWidths[] = {1, 3, 7, 33, 257};

TEST(NormActivation, RmsNormMatchesReferenceOnOddShapes) {
  torch::manual_seed(1);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths) {
        const std::vector<Tensor> in{rnd({rows, c}, t, 2), rnd({c}, t, 0.1, 1)};
        expect_parity(rms(true), rms(false), in, t, "rms_norm " + label(t, rows, c));
      }
}

TEST(NormActivation, AddRmsNormMatchesReferenceOnOddShapes) {
  torch::manual_seed(2);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths) {
        const std::vector<Tensor> in{rnd({rows, c}, t), rnd({rows, c}, t, 2), rnd({c}, t, 0.1, 1)};
        expect_parity(add_rms(true), add_rms(false), in, t, "add_rms_norm " + label(t, rows, c));
      }
}

TEST(NormActivation, SwigluMatchesReferenceOnOddShapes) {
  torch::manual_seed(3);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths) {
        const std::vector<Tensor> in{rnd({rows, c}, t, 3), rnd({rows, c}, t)};
        expect_parity(glu(true), glu(false), in, t, "swiglu " + label(t, rows, c));
      }
}

TEST(NormActivation, SwigluHandlesLargeGateValues) {
  // Far outside the range where exp would overflow or underflow.
  const auto gate = torch::tensor({-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0, 200.0}, torch::kFloat);
  const std::vector<Tensor> in{gate, torch::ones_like(gate)};
  expect_parity(glu(true), glu(false), in, at::kFloat, "swiglu extremes");
}

TEST(NormActivation, ThreeDimensionalInputs) {
  torch::manual_seed(4);
  for (auto t : kTypes) {
    const auto x = rnd({2, 5, 33}, t, 2), r = rnd({2, 5, 33}, t), w = rnd({33}, t, 0.1, 1);
    expect_parity(rms(true), rms(false), {x, w}, t, "rms_norm 3-D");
    expect_parity(add_rms(true), add_rms(false), {x, r, w}, t, "add_rms_norm 3-D");
    expect_parity(glu(true), glu(false), {x, r}, t, "swiglu 3-D");
  }
}

TEST(NormActivation, NonContiguousInputs) {
  torch::manual_seed(5);
  for (auto t : kTypes) {
    // [rows, C] views of transposed [C, rows] storage, and a strided weight.
    const auto x = rnd({33, 7}, t, 2).t(), r = rnd({33, 7}, t).t(), w = rnd({66}, t, 0.1, 1).slice(0, 0, 66, 2);
    ASSERT_FALSE(x.is_contiguous());
    ASSERT_FALSE(w.is_contiguous());
    expect_parity(rms(true), rms(false), {x, w}, t, "rms_norm transposed");
    expect_parity(add_rms(true), add_rms(false), {x, r, w}, t, "add_rms_norm transposed");
    expect_parity(glu(true), glu(false), {x, r}, t, "swiglu transposed");
  }
}

TEST(NormActivation, MixedWeightDtypeFollowsReference) {
  torch::manual_seed(6);
  // bf16 activations with an fp32 weight: the result and its product are fp32.
  expect_parity(rms(true), rms(false), {rnd({5, 33}, at::kBFloat16, 2), rnd({33}, at::kFloat, 0.1, 1)},
                at::kBFloat16, "rms_norm bf16 x, fp32 weight");
  // fp32 activations with an fp64 weight: normalised in fp32, multiplied in fp64.
  expect_parity(rms(true), rms(false), {rnd({5, 33}, at::kFloat, 2), rnd({33}, at::kDouble, 0.1, 1)}, at::kFloat,
                "rms_norm fp32 x, fp64 weight");
  expect_parity(add_rms(true), add_rms(false),
                {rnd({5, 33}, at::kBFloat16), rnd({5, 33}, at::kBFloat16), rnd({33}, at::kFloat, 0.1, 1)},
                at::kBFloat16, "add_rms_norm bf16 x, fp32 weight");
}

TEST(NormActivation, PartialGradientsAndNoGrad) {
  torch::manual_seed(7);
  const auto x = rnd({5, 33}, at::kFloat, 2), w = rnd({33}, at::kFloat, 0.1, 1);
  // Only the weight asks for a gradient.
  auto wf = leaf(w), wr = leaf(w);
  const auto gy = torch::randn({5, 33});
  const auto dwf = torch::autograd::grad({k::rms_norm(x, wf, kEps)}, {wf}, {gy})[0];
  const auto dwr = torch::autograd::grad({k::rms_norm_unfused(x, wr, kEps)}, {wr}, {gy})[0];
  EXPECT_LE(err(dwf, dwr), 1e-5);
  // Only up asks for a gradient.
  auto uf = leaf(w.expand({5, 33})), ur = leaf(w.expand({5, 33}));
  const auto duf = torch::autograd::grad({k::swiglu(x, uf)}, {uf}, {gy})[0];
  const auto dur = torch::autograd::grad({k::swiglu_unfused(x, ur)}, {ur}, {gy})[0];
  EXPECT_LE(err(duf, dur), 1e-5);
  // Without autograd the outputs are the same.
  torch::NoGradGuard no_grad;
  EXPECT_LE(err(k::rms_norm(x, w, kEps), k::rms_norm_unfused(x, w, kEps)), 1e-5);
  EXPECT_FALSE(k::swiglu(x, x).requires_grad());
}

TEST(NormActivation, TwoThreadsGiveTheSameBitsAsOne) {
  torch::manual_seed(8);
  const int before = at::get_num_threads();
  // Enough rows that both the row loops and the weight-gradient blocks split.
  const auto x = rnd({1000, 96}, at::kFloat, 2), r = rnd({1000, 96}, at::kFloat), w = rnd({96}, at::kFloat, 0.1, 1);
  const auto ups_norm = upstream_for(add_rms(false), {x, r, w});
  const auto ups_glu = upstream_for(glu(false), {x, r});
  std::vector<Outcome> runs;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    runs.push_back(run(rms(true), {x, w}, {ups_norm[0]}));
    runs.push_back(run(add_rms(true), {x, r, w}, ups_norm));
    runs.push_back(run(glu(true), {x, r}, ups_glu));
  }
  at::set_num_threads(before);
  for (size_t i = 0; i < 3; ++i) {
    const Outcome& one = runs[i];
    const Outcome& two = runs[i + 3];
    for (size_t j = 0; j < one.outputs.size(); ++j) EXPECT_TRUE(torch::equal(one.outputs[j], two.outputs[j])) << i;
    for (size_t j = 0; j < one.grads.size(); ++j) EXPECT_TRUE(torch::equal(one.grads[j], two.grads[j])) << i << j;
  }
}

// The message of the UsageError that fn throws ("" if none); one line.
std::string usage_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const scaletrain::UsageError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    return what;
  }
  return "";
}

TEST(NormActivation, BadInputIsAUsageErrorNamingTheValues) {
  const auto x = torch::randn({4, 8}), w = torch::ones({8});
  auto msg = usage_error([&] { k::rms_norm(x, torch::ones({7}), kEps); });
  EXPECT_NE(msg.find("weight must be [8] to match x [4, 8], got [7]"), std::string::npos) << msg;
  msg = usage_error([&] { k::rms_norm_unfused(x, torch::ones({2, 4}), kEps); });
  EXPECT_NE(msg.find("got [2, 4]"), std::string::npos) << msg;
  msg = usage_error([&] { k::rms_norm(x, w, 0.0); });
  EXPECT_NE(msg.find("eps must be a finite number > 0, got 0"), std::string::npos) << msg;
  msg = usage_error([&] { k::add_rms_norm(x, x, w, -1e-6); });
  EXPECT_NE(msg.find("add_rms_norm: eps must be a finite number > 0, got -1e-06"), std::string::npos) << msg;
  msg = usage_error([&] { k::add_rms_norm(x, torch::randn({4, 7}), w, kEps); });
  EXPECT_NE(msg.find("residual [4, 7] Float must match x [4, 8] Float"), std::string::npos) << msg;
  msg = usage_error([&] { k::swiglu(x, torch::randn({4, 9})); });
  EXPECT_NE(msg.find("swiglu: gate [4, 8] and up [4, 9] must have the same shape"), std::string::npos) << msg;
  msg = usage_error([&] { k::swiglu_unfused(x, torch::randn({8, 4})); });
  EXPECT_NE(msg.find("gate [4, 8] and up [8, 4]"), std::string::npos) << msg;
  msg = usage_error([&] { k::swiglu(x, x.to(torch::kDouble)); });
  EXPECT_NE(msg.find("gate (Float) and up (Double) must have the same dtype"), std::string::npos) << msg;
  // Not taken by the fused path, rejected by the unfused one.
  msg = usage_error([&] { k::rms_norm(torch::ones({4, 8}, torch::kLong), w, kEps); });
  EXPECT_NE(msg.find("x must be a floating tensor, got Long"), std::string::npos) << msg;
}

TEST(NormActivation, FusedPathAppliesToStridedFloatingCpuTensors) {
  EXPECT_TRUE(k::fused_norm_activation_applies(torch::randn({2, 3})));
  EXPECT_TRUE(k::fused_norm_activation_applies(torch::randn({3, 2}).t()));
  EXPECT_TRUE(k::fused_norm_activation_applies(torch::randn({2, 3}).to(torch::kBFloat16)));
  EXPECT_FALSE(k::fused_norm_activation_applies(torch::ones({2, 3}, torch::kLong)));
  EXPECT_FALSE(k::fused_norm_activation_applies(torch::randn({2, 3}).to_sparse()));
  EXPECT_FALSE(k::fused_norm_activation_applies(Tensor()));
}

}  // namespace norm_activation_test

// Parity tests of the fused LayerNorm, residual-add + LayerNorm and tanh GELU
// kernels against their unfused ATen references: outputs and every input
// gradient under random upstream gradients, for odd widths and row counts,
// 3-D and non-contiguous inputs, frozen weight or bias and inputs without
// gradients, large GELU arguments, bit-identical results for one and two
// threads, and the messages of bad input.
//
// The reference is the unfused path evaluated in fp64 on the same inputs, its
// outputs and gradients rounded once to the inputs' dtype: ATen's own fp32
// and bf16 LayerNorm are the less accurate side at small widths (at C = 1 the
// variance is 0, rstd = 1/sqrt(eps), and ATen's x rstd - mean rstd leaves
// errors of 6e-5 in fp32 and of order 1 in bf16, where the fused kernel gives
// the exact b), and the fused kernels round once from float as this reference
// does.
//
// Error measure: err(a, ref) = max|a - ref| / max(1, max|ref|), i.e. absolute
// for values of magnitude up to 1 and relative to the largest value above.
// Bounds: 1e-10 (fp64), 1e-5 (fp32), 2e-2 (bf16, half).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "scaletrain/kernels/layer_norm_gelu.h"
#include "scaletrain/util/error.h"

namespace layer_norm_gelu_test {

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

using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

Fn ln(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{fused ? k::layer_norm(in[0], in[1], in[2], kEps)
                                     : k::layer_norm_unfused(in[0], in[1], in[2], kEps)};
  };
}

Fn add_ln(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    auto out = fused ? k::add_layer_norm(in[0], in[1], in[2], in[3], kEps)
                     : k::add_layer_norm_unfused(in[0], in[1], in[2], in[3], kEps);
    return std::vector<Tensor>{std::get<0>(out), std::get<1>(out)};
  };
}

Fn gelu(bool fused) {
  return [fused](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{fused ? k::gelu_tanh(in[0]) : k::gelu_tanh_unfused(in[0])};
  };
}

// fn evaluated in double on the same inputs, its outputs rounded back to the
// inputs' dtype (autograd rounds the gradients back the same way).
Fn in_double(const Fn& fn) {
  return [fn](const std::vector<Tensor>& in) {
    std::vector<Tensor> wide;
    for (const auto& t : in) wide.push_back(t.to(torch::kDouble));
    std::vector<Tensor> out;
    for (const auto& o : fn(wide)) out.push_back(o.to(in[0].scalar_type()));
    return out;
  };
}

// Results of one call: its outputs, then the gradients of the inputs that
// require one.
struct Outcome {
  std::vector<Tensor> outputs, grads;
};

// Calls fn on fresh copies of `inputs`, those marked in `wants` (all when
// empty) as leaves that require grad, and back-propagates the fixed upstream
// gradients `upstream` (one per output) to those leaves from the outputs that
// require grad (the reference's s = x + residual does not when neither does).
Outcome run(const Fn& fn, const std::vector<Tensor>& inputs, const std::vector<Tensor>& upstream,
            const std::vector<bool>& wants = {}) {
  std::vector<Tensor> args, leaves;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool want = wants.empty() || wants[i];
    args.push_back(inputs[i].detach().clone().requires_grad_(want));
    if (want) leaves.push_back(args.back());
  }
  Outcome r;
  r.outputs = fn(args);
  std::vector<Tensor> roots, ups;
  for (size_t i = 0; i < r.outputs.size(); ++i) {
    if (!r.outputs[i].requires_grad()) continue;
    roots.push_back(r.outputs[i]);
    ups.push_back(upstream[i]);
  }
  r.grads = torch::autograd::grad(roots, leaves, ups);
  return r;
}

// Random upstream gradients shaped like the reference's outputs.
std::vector<Tensor> upstream_for(const Fn& reference, const std::vector<Tensor>& inputs) {
  torch::NoGradGuard no_grad;
  std::vector<Tensor> ups;
  for (const auto& o : reference(inputs)) ups.push_back(torch::randn(o.sizes(), torch::kDouble).to(o.scalar_type()));
  return ups;
}

// Fused vs unfused (in fp64): same dtypes and shapes, values within the bound
// of `tol_type`, for the gradients of the inputs marked in `wants`.
void expect_parity(const Fn& fused, const Fn& unfused, const std::vector<Tensor>& inputs, at::ScalarType tol_type,
                   const std::string& what, const std::vector<bool>& wants = {}) {
  const Fn reference = in_double(unfused);
  const auto ups = upstream_for(reference, inputs);
  const Outcome got = run(fused, inputs, ups, wants);
  const Outcome want = run(reference, inputs, ups, wants);
  ASSERT_EQ(got.outputs.size(), want.outputs.size()) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  auto compare = [&](const Tensor& a, const Tensor& b, const std::string& name) {
    ASSERT_TRUE(a.defined() && b.defined()) << what << " " << name;
    EXPECT_EQ(a.scalar_type(), b.scalar_type()) << what << " " << name;
    EXPECT_EQ(a.sizes(), b.sizes()) << what << " " << name;
    EXPECT_FALSE(a.isnan().any().item<bool>()) << what << " " << name;
    EXPECT_LE(err(a, b), bound(tol_type)) << what << " " << name;
  };
  for (size_t i = 0; i < got.outputs.size(); ++i)
    compare(got.outputs[i], want.outputs[i], "output " + std::to_string(i));
  for (size_t i = 0; i < got.grads.size(); ++i) compare(got.grads[i], want.grads[i], "grad " + std::to_string(i));
}

Tensor rnd(at::IntArrayRef sizes, at::ScalarType t, double scale = 1, double shift = 0) {
  return (torch::randn(sizes, torch::kDouble) * scale + shift).to(t);
}

std::string label(at::ScalarType t, int64_t rows, int64_t c) {
  return std::string(c10::toString(t)) + " rows=" + std::to_string(rows) + " C=" + std::to_string(c);
}

const at::ScalarType kTypes[] = {at::kDouble, at::kFloat, at::kBFloat16};
const int64_t kRows[] = {1, 33};
const int64_t kWidths[] = {1, 3, 7, 64, 129, 257};

TEST(LayerNormGelu, LayerNormMatchesReferenceOnOddShapes) {
  torch::manual_seed(1);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths) {
        // Rows centred away from 0, so that the mean matters.
        const std::vector<Tensor> in{rnd({rows, c}, t, 2, 3), rnd({c}, t, 0.1, 1), rnd({c}, t, 0.5)};
        expect_parity(ln(true), ln(false), in, t, "layer_norm " + label(t, rows, c));
      }
}

TEST(LayerNormGelu, AddLayerNormMatchesReferenceOnOddShapes) {
  torch::manual_seed(2);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths) {
        const std::vector<Tensor> in{rnd({rows, c}, t), rnd({rows, c}, t, 2, -1), rnd({c}, t, 0.1, 1),
                                     rnd({c}, t, 0.5)};
        expect_parity(add_ln(true), add_ln(false), in, t, "add_layer_norm " + label(t, rows, c));
      }
}

TEST(LayerNormGelu, GeluTanhMatchesReferenceOnOddShapes) {
  torch::manual_seed(3);
  for (auto t : kTypes)
    for (int64_t rows : kRows)
      for (int64_t c : kWidths)
        expect_parity(gelu(true), gelu(false), {rnd({rows, c}, t, 3)}, t, "gelu " + label(t, rows, c));
}

TEST(LayerNormGelu, GeluTanhHandlesLargeArguments) {
  for (auto t : {at::kDouble, at::kFloat}) {
    // Far outside the range where exp or x^3 would be a problem for a naive sigmoid.
    const auto x = torch::tensor({-1e4, -100.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 100.0, 1e4}, t);
    expect_parity(gelu(true), gelu(false), {x}, t, "gelu extremes " + std::string(c10::toString(t)));
  }
}

TEST(LayerNormGelu, HalfInputs) {
  torch::manual_seed(4);
  const auto h = at::kHalf;
  expect_parity(ln(true), ln(false), {rnd({33, 64}, h, 2, 1), rnd({64}, h, 0.1, 1), rnd({64}, h, 0.5)}, h, "half ln");
  expect_parity(add_ln(true), add_ln(false),
                {rnd({33, 64}, h), rnd({33, 64}, h), rnd({64}, h, 0.1, 1), rnd({64}, h, 0.5)}, h, "half add_ln");
  expect_parity(gelu(true), gelu(false), {rnd({33, 64}, h, 3)}, h, "half gelu");
}

TEST(LayerNormGelu, ThreeDimensionalAndNonContiguousInputs) {
  torch::manual_seed(5);
  for (auto t : kTypes) {
    // [rows, C] views of transposed [C, rows] storage, and strided parameters.
    const auto x = rnd({33, 7}, t, 2, 1).t(), r = rnd({33, 7}, t).t();
    const auto w = rnd({66}, t, 0.1, 1).slice(0, 0, 66, 2), b = rnd({66}, t).slice(0, 0, 66, 2);
    ASSERT_FALSE(x.is_contiguous());
    ASSERT_FALSE(w.is_contiguous());
    expect_parity(ln(true), ln(false), {x, w, b}, t, "layer_norm transposed");
    expect_parity(add_ln(true), add_ln(false), {x, r, w, b}, t, "add_layer_norm transposed");
    expect_parity(gelu(true), gelu(false), {x}, t, "gelu transposed");
    const auto x3 = rnd({2, 5, 33}, t, 2), r3 = rnd({2, 5, 33}, t), w3 = rnd({33}, t, 0.1, 1), b3 = rnd({33}, t);
    expect_parity(ln(true), ln(false), {x3, w3, b3}, t, "layer_norm 3-D");
    expect_parity(add_ln(true), add_ln(false), {x3, r3, w3, b3}, t, "add_layer_norm 3-D");
    expect_parity(gelu(true), gelu(false), {x3}, t, "gelu 3-D");
  }
}

TEST(LayerNormGelu, FrozenParametersAndInputsWithoutGradients) {
  torch::manual_seed(6);
  const auto t = at::kFloat;
  const auto x = rnd({33, 64}, t, 2, 1), r = rnd({33, 64}, t), w = rnd({64}, t, 0.1, 1), b = rnd({64}, t);
  // {x, weight, bias}: frozen weight (LoRA), frozen bias, x without a gradient, only x.
  for (const std::vector<bool>& wants : std::vector<std::vector<bool>>{
           {true, false, true}, {true, true, false}, {false, true, true}, {false, false, true}, {true, false, false}})
    expect_parity(ln(true), ln(false), {x, w, b}, t, "layer_norm partial", wants);
  // {x, residual, weight, bias}.
  for (const std::vector<bool>& wants : std::vector<std::vector<bool>>{{true, false, false, false},
                                                                       {false, true, true, false},
                                                                       {false, false, false, true},
                                                                       {true, true, false, true}})
    expect_parity(add_ln(true), add_ln(false), {x, r, w, b}, t, "add_layer_norm partial", wants);
  // Without autograd the outputs are the same, and nothing requires grad.
  torch::NoGradGuard no_grad;
  EXPECT_LE(err(k::layer_norm(x, w, b, kEps), k::layer_norm_unfused(x, w, b, kEps)), 1e-5);
  EXPECT_LE(err(std::get<1>(k::add_layer_norm(x, r, w, b, kEps)), x + r), 0);
  EXPECT_FALSE(k::gelu_tanh(x).requires_grad());
}

TEST(LayerNormGelu, TwoThreadsGiveTheSameBitsAsOne) {
  torch::manual_seed(7);
  const int before = at::get_num_threads();
  // Enough rows that both the row loops and the parameter-gradient blocks split.
  const auto x = rnd({1000, 96}, at::kFloat, 2), r = rnd({1000, 96}, at::kFloat);
  const auto w = rnd({96}, at::kFloat, 0.1, 1), b = rnd({96}, at::kFloat);
  const auto ups_norm = upstream_for(add_ln(false), {x, r, w, b});
  const auto ups_gelu = upstream_for(gelu(false), {x});
  std::vector<Outcome> runs;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    runs.push_back(run(ln(true), {x, w, b}, {ups_norm[0]}));
    runs.push_back(run(add_ln(true), {x, r, w, b}, ups_norm));
    runs.push_back(run(gelu(true), {x}, ups_gelu));
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

TEST(LayerNormGelu, BadInputIsAUsageErrorNamingTheValues) {
  const auto x = torch::randn({4, 8}), w = torch::ones({8}), b = torch::zeros({8});
  auto msg = usage_error([&] { k::layer_norm(x, torch::ones({7}), b, kEps); });
  EXPECT_NE(msg.find("layer_norm: weight must be [8] to match x [4, 8], got [7]"), std::string::npos) << msg;
  msg = usage_error([&] { k::layer_norm_unfused(x, w, torch::zeros({2, 4}), kEps); });
  EXPECT_NE(msg.find("bias must be [8] to match x [4, 8], got [2, 4]"), std::string::npos) << msg;
  msg = usage_error([&] { k::layer_norm(x, w, Tensor(), kEps); });
  EXPECT_NE(msg.find("x, weight and bias must be defined"), std::string::npos) << msg;
  msg = usage_error([&] { k::layer_norm(x, w.to(torch::kDouble), b, kEps); });
  EXPECT_NE(msg.find("weight (Double) must have x's dtype (Float)"), std::string::npos) << msg;
  msg = usage_error([&] { k::layer_norm(x, w, b, 0.0); });
  EXPECT_NE(msg.find("eps must be a finite number > 0, got 0"), std::string::npos) << msg;
  msg = usage_error([&] { k::add_layer_norm(x, torch::randn({4, 7}), w, b, kEps); });
  EXPECT_NE(msg.find("add_layer_norm: residual [4, 7] Float must match x [4, 8] Float"), std::string::npos) << msg;
  msg = usage_error([&] { k::add_layer_norm_unfused(x, x, w, torch::zeros({9}), kEps); });
  EXPECT_NE(msg.find("add_layer_norm: bias must be [8]"), std::string::npos) << msg;
  // Not taken by the fused path, rejected by the unfused one.
  msg = usage_error([&] { k::gelu_tanh(torch::ones({4, 8}, torch::kLong)); });
  EXPECT_NE(msg.find("gelu_tanh: x must be a floating tensor, got Long"), std::string::npos) << msg;
  msg = usage_error([&] { k::layer_norm(torch::ones({4, 8}, torch::kLong), w, b, kEps); });
  EXPECT_NE(msg.find("x must be a floating tensor, got Long"), std::string::npos) << msg;
}

}  // namespace layer_norm_gelu_test

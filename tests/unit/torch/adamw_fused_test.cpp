// The fused AdamW step (kernels/adamw.h) against the ATen ops it replaces:
// the same bits, step after step, for fp32 and fp64, odd sizes (none a
// multiple of a vector width), a flat shard with a partial weight decay,
// both forms of lerp, one and two threads; and the tensors it leaves to the
// ATen ops. Note [Fused AdamW arithmetic] says why equality is exact.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/kernels/adamw.h"
#include "scaletrain/optim/adamw.h"

namespace adamw_fused_test {

using torch::Tensor;
namespace k = scaletrain::kernels;
namespace optim = scaletrain::optim;

// The same-width integer view of a float or double tensor.
Tensor bits(const Tensor& t) { return t.view(t.scalar_type() == at::kDouble ? at::kLong : at::kInt); }

// Largest distance in units in the last place (same-sign values; the
// optimizer's states and these parameters never pass through zero apart).
int64_t max_ulps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0) return 0;
  return (bits(a).to(at::kLong) - bits(b).to(at::kLong)).abs().max().item<int64_t>();
}

::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b, const std::string& what) {
  if (a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(bits(a), bits(b)))
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << " differs by up to " << max_ulps(a, b) << " ulp";
}

// Sizes 1, 7, 33, a [9, 11] matrix, and a flat 100003-element shard whose
// first 40001 elements are decayed (the shard of a matrix and a bias).
std::vector<Tensor> make_params(at::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> shapes{{1}, {7}, {33}, {9, 11}, {100003}};
  std::vector<Tensor> out;
  for (const auto& s : shapes) out.push_back(torch::randn(s, torch::dtype(dtype)).requires_grad_(true));
  return out;
}

const std::vector<int64_t> kDecayNumel{1, 0, 33, 99, 40001};

std::vector<Tensor> copies(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Gradients of many magnitudes, with some exact zeros.
Tensor random_grad(const Tensor& p) {
  auto g = torch::randn(p.sizes(), p.options()) * torch::exp(2 * torch::randn(p.sizes(), p.options()));
  return g * (torch::rand(p.sizes(), p.options()) > 0.05);
}

// Runs `steps` steps of a fused and an unfused optimizer on copies of the
// same parameters and gradients; expects the same bits after every step.
void expect_fused_matches_unfused(at::ScalarType dtype, double weight_decay, double beta1, int steps) {
  torch::manual_seed(11);
  const auto start = make_params(dtype);
  auto pf = copies(start), pu = copies(start);
  optim::AdamWOptions o;
  o.weight_decay = weight_decay;
  o.beta1 = beta1;
  optim::AdamWOptions of = o, ou = o;
  of.fused = true;
  ou.fused = false;
  optim::AdamW fused(pf, kDecayNumel, of), unfused(pu, kDecayNumel, ou);
  for (int step = 1; step <= steps; ++step) {
    for (size_t i = 0; i < start.size(); ++i) {
      const auto g = random_grad(start[i]);
      pf[i].mutable_grad() = g.clone();
      pu[i].mutable_grad() = g.clone();
    }
    const double lr = 1e-3 * (1.0 + 0.5 * std::sin(step));  // a schedule: new scalars each step
    fused.step(lr);
    unfused.step(lr);
    for (size_t i = 0; i < start.size(); ++i) {
      const std::string what = std::string(c10::toString(dtype)) + " wd " + std::to_string(weight_decay) + " beta1 " +
                               std::to_string(beta1) + " step " + std::to_string(step) + " tensor " +
                               std::to_string(i) + " (" + std::to_string(start[i].numel()) + " elements) ";
      ASSERT_TRUE(same_bits(pf[i].detach(), pu[i].detach(), what + "p"));
      ASSERT_TRUE(same_bits(fused.exp_avg()[i], unfused.exp_avg()[i], what + "m"));
      ASSERT_TRUE(same_bits(fused.exp_avg_sq()[i], unfused.exp_avg_sq()[i], what + "v"));
    }
  }
  for (size_t i = 0; i < start.size(); ++i)
    EXPECT_FALSE(torch::equal(pf[i], start[i])) << "tensor " << i << " never moved";
}

TEST(AdamWFused, MatchesUnfusedBitwiseFp32) {
  expect_fused_matches_unfused(at::kFloat, 0.0, 0.9, 20);
  expect_fused_matches_unfused(at::kFloat, 0.1, 0.9, 20);
  expect_fused_matches_unfused(at::kFloat, 0.1, 0.3, 5);  // lerp weight 0.7: lerp's other form
}

TEST(AdamWFused, MatchesUnfusedBitwiseFp64) {
  expect_fused_matches_unfused(at::kDouble, 0.0, 0.9, 20);
  expect_fused_matches_unfused(at::kDouble, 0.1, 0.9, 20);
  expect_fused_matches_unfused(at::kDouble, 0.1, 0.3, 5);
}

// Each element depends on its own values only, so the chunking of two
// threads changes nothing.
TEST(AdamWFused, OneAndTwoThreadsGiveTheSameBits) {
  const int threads = at::get_num_threads();
  for (auto dtype : {at::kFloat, at::kDouble}) {
    torch::manual_seed(12);
    const int64_t n = 300007;
    auto p0 = torch::randn({n}, torch::dtype(dtype)), m0 = 0.1 * torch::randn({n}, torch::dtype(dtype));
    auto v0 = torch::rand({n}, torch::dtype(dtype)), g = torch::randn({n}, torch::dtype(dtype));
    k::AdamWStep s;
    s.lr = 1e-2;
    s.weight_decay = 0.1;
    s.bias_correction1 = 1 - std::pow(s.beta1, 3);
    s.bias_correction2_sqrt = std::sqrt(1 - std::pow(s.beta2, 3));
    std::vector<Tensor> out;
    for (int t : {1, 2}) {
      at::set_num_threads(t);
      auto p = p0.clone(), m = m0.clone(), v = v0.clone();
      ASSERT_TRUE(k::fused_adamw_applies(p, g, m, v));
      k::fused_adamw_step(p, g, m, v, 123457, s);
      out.insert(out.end(), {p, m, v});
    }
    at::set_num_threads(threads);
    EXPECT_TRUE(same_bits(out[0], out[3], "p, 1 vs 2 threads"));
    EXPECT_TRUE(same_bits(out[1], out[4], "m, 1 vs 2 threads"));
    EXPECT_TRUE(same_bits(out[2], out[5], "v, 1 vs 2 threads"));
    EXPECT_FALSE(torch::equal(out[0], p0));
  }
}

TEST(AdamWFused, SkipsTensorsWithoutGrad) {
  for (bool fused : {true, false}) {
    auto a = torch::randn({33}).requires_grad_(true), b = torch::randn({7}).requires_grad_(true);
    const auto a0 = a.detach().clone(), b0 = b.detach().clone();
    optim::AdamWOptions o;
    o.fused = fused;
    optim::AdamW opt({a, b}, std::vector<bool>{true, true}, o);
    a.mutable_grad() = torch::randn({33});
    opt.step(1e-2);
    EXPECT_FALSE(torch::equal(a, a0)) << "fused " << fused;
    EXPECT_TRUE(torch::equal(b, b0)) << "fused " << fused;
    EXPECT_EQ(opt.exp_avg()[1].count_nonzero().item<int64_t>(), 0) << "fused " << fused;
    EXPECT_EQ(opt.exp_avg_sq()[1].count_nonzero().item<int64_t>(), 0) << "fused " << fused;
  }
}

// What the kernel leaves to the ATen ops, which fused_adamw_step then runs.
TEST(AdamWFused, OtherTensorsTakeTheAtenOps) {
  const auto f = torch::zeros({4, 6});
  auto z = [&] { return torch::zeros({4, 6}); };
  EXPECT_TRUE(k::fused_adamw_applies(z(), z(), z(), z()));
  EXPECT_TRUE(
      k::fused_adamw_applies(z().to(at::kDouble), z().to(at::kDouble), z().to(at::kDouble), z().to(at::kDouble)));
  EXPECT_FALSE(k::fused_adamw_applies(z().t(), z().t(), z().t(), z().t())) << "non-contiguous";
  EXPECT_FALSE(k::fused_adamw_applies(z(), z().to(at::kDouble), z(), z())) << "gradient of another dtype";
  EXPECT_FALSE(k::fused_adamw_applies(z().to(at::kHalf), z().to(at::kHalf), z().to(at::kHalf), z().to(at::kHalf)));
  EXPECT_FALSE(k::fused_adamw_applies(z(), torch::zeros({25}), z(), z())) << "sizes differ";
  EXPECT_FALSE(k::fused_adamw_applies(z(), z(), f, f)) << "m and v are one tensor";
  EXPECT_FALSE(k::fused_adamw_applies(z(), Tensor(), z(), z()));

  // A transposed parameter (with its gradient and states) still gets the step.
  torch::manual_seed(13);
  const auto p0 = torch::randn({6, 4}).t(), g = torch::randn({6, 4}).t();
  k::AdamWStep s;
  s.lr = 1e-2;
  s.weight_decay = 0.1;
  auto p1 = p0.clone(), p2 = p0.clone();
  auto m1 = torch::zeros({6, 4}).t(), v1 = torch::zeros({6, 4}).t(), m2 = m1.clone(), v2 = v1.clone();
  k::fused_adamw_step(p1, g, m1, v1, p0.numel(), s);
  k::adamw_step_unfused(p2, g, m2, v2, p0.numel(), s);
  EXPECT_TRUE(same_bits(p1, p2, "transposed p"));
  EXPECT_FALSE(torch::equal(p1, p0));

  auto p = z(), m = z(), v = z();
  EXPECT_THROW(k::fused_adamw_step(p, z(), m, v, 5, s), std::invalid_argument) << "partial decay of a matrix";
  EXPECT_THROW(k::fused_adamw_step(p, z(), m, v, 25, s), std::invalid_argument);
}

}  // namespace adamw_fused_test

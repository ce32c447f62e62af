// The tiled attention kernel (kernels/attention.h) against the naive one, and
// the naive one against explicit loops: outputs, log-sum-exp and the
// gradients of q, k, v under random upstream gradients for both out and lse,
// across odd shapes, grouped-query heads, causal / windowed / offset /
// segmented masks, fp64, fp32 and bf16, one and two threads, strided inputs,
// and the errors for inconsistent input.
//
// Tolerances, as max |flash - reference| / max(1, max |reference|) per tensor,
// the reference computed in fp64 from the same input values: fp64 1e-10,
// fp32 1e-5, bf16 2e-2.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "scaletrain/kernels/attention.h"
#include "scaletrain/kernels/attention_detail.h"
#include "scaletrain/util/error.h"

namespace scaletrain::kernels {
namespace flash_attention_test {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  int64_t B = 1, H = 2, Hkv = 2, Tq = 7, Tk = 7, D = 3;
  AttentionMask mask;
  detail::TileSizes tiles;  // 0: the kernel's defaults
};

struct Grads {
  torch::Tensor out, lse, dq, dk, dv;
};

// Runs `fn` on leaf copies of q, k, v and back-propagates gout, glse
// (glse may be undefined: only out's gradient flows).
template <typename Fn>
Grads run(Fn fn, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& gout,
          const torch::Tensor& glse) {
  auto ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(), vl = v.detach().requires_grad_();
  auto [out, lse] = fn(ql, kl, vl);
  std::vector<torch::Tensor> outputs{out}, grads{gout.to(out.scalar_type())};
  if (glse.defined()) outputs.push_back(lse), grads.push_back(glse.to(lse.scalar_type()));
  auto g = torch::autograd::grad(outputs, {ql, kl, vl}, grads);
  return {out.detach(), lse.detach(), g[0], g[1], g[2]};
}

// max |a - b| / max(1, max |b|); -inf == -inf counts as equal; NaN fails.
double rel_err(const torch::Tensor& a_in, const torch::Tensor& b_in) {
  const auto a = a_in.to(torch::kDouble), b = b_in.to(torch::kDouble);
  EXPECT_FALSE(a.isnan().any().item<bool>());
  if (a.numel() == 0) return 0;
  const auto same_inf = a.isinf().logical_and(a.eq(b));
  const double diff = (a - b).abs().masked_fill(same_inf, 0).max().item<double>();
  const double mag = b.masked_fill(b.isinf(), 0).abs().max().item<double>();
  return diff / std::max(1.0, mag);
}

// Flash in `dtype` against naive in fp64 on the same values, with random
// upstream gradients for out and lse.
void expect_matches(const Case& c, torch::ScalarType dtype, double tol, const std::string& what) {
  SCOPED_TRACE(what + " B=" + std::to_string(c.B) + " H=" + std::to_string(c.H) + " Hkv=" + std::to_string(c.Hkv) +
               " Tq=" + std::to_string(c.Tq) + " Tk=" + std::to_string(c.Tk) + " D=" + std::to_string(c.D));
  auto q = torch::randn({c.B, c.H, c.Tq, c.D}).to(dtype), k = torch::randn({c.B, c.Hkv, c.Tk, c.D}).to(dtype),
       v = torch::randn({c.B, c.Hkv, c.Tk, c.D}).to(dtype);
  auto gout = torch::randn({c.B, c.H, c.Tq, c.D}, torch::kDouble), glse = torch::randn({c.B, c.H, c.Tq}, torch::kDouble);
  const auto flash = run([&](auto& a, auto& b, auto& d) { return detail::flash_attention_tiled(a, b, d, c.mask, c.tiles); },
                         q, k, v, gout, glse);
  auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble), v64 = v.to(torch::kDouble);
  const auto ref = run([&](auto& a, auto& b, auto& d) { return naive_attention(a, b, d, c.mask); }, q64, k64, v64,
                       gout, glse);
  EXPECT_EQ(flash.out.scalar_type(), dtype);
  EXPECT_EQ(flash.lse.scalar_type(), dtype == torch::kDouble ? torch::kDouble : torch::kFloat);
  EXPECT_EQ(flash.dq.scalar_type(), dtype);
  EXPECT_LE(rel_err(flash.out, ref.out), tol) << "out";
  EXPECT_LE(rel_err(flash.lse, ref.lse), tol) << "lse";
  EXPECT_LE(rel_err(flash.dq, ref.dq), tol) << "dq";
  EXPECT_LE(rel_err(flash.dk, ref.dk), tol) << "dk";
  EXPECT_LE(rel_err(flash.dv, ref.dv), tol) << "dv";
}

// Document ids for packed documents of the given lengths, in order.
torch::Tensor packed(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], static_cast<int64_t>(d));
  return torch::tensor(ids, torch::kLong);
}

TEST(FlashAttention, NaiveMatchesExplicitLoops) {
  torch::manual_seed(1);
  const int64_t B = 2, H = 4, Hkv = 2, Tq = 5, Tk = 7, D = 3;
  std::vector<AttentionMask> masks(5);
  masks[0].causal = false;
  masks[1].k_offset = -2;  // queries at 0..4, keys at -2..4
  masks[2].window = 3, masks[2].q_offset = 2;
  masks[3].q_segments = torch::tensor({0, 0, 1, 1, 1, 0, 1, 1, 2, 2}, torch::kLong).view({B, Tq});
  masks[3].k_segments = torch::tensor({0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 2, 2, 2}, torch::kLong).view({B, Tk});
  masks[3].k_offset = -2, masks[3].scale = 0.7;
  masks[4].k_offset = 3;  // rows 0..2 see no key
  for (const auto& m : masks) {
    auto q = torch::randn({B, H, Tq, D}, torch::kDouble), k = torch::randn({B, Hkv, Tk, D}, torch::kDouble),
         v = torch::randn({B, Hkv, Tk, D}, torch::kDouble);
    auto [out, lse] = naive_attention(q, k, v, m);
    const double scale = m.scale > 0 ? m.scale : 1 / std::sqrt(double(D));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Tq; ++i) {
          std::vector<double> w(Tk, 0.0);
          double total = 0;
          for (int64_t j = 0; j < Tk; ++j) {
            const int64_t qp = m.q_offset + i, kp = m.k_offset + j;
            bool seen = (!m.causal || kp <= qp) && (m.window == 0 || qp - kp < m.window);
            if (m.q_segments.defined())
              seen = seen && m.q_segments[b][i].item<int64_t>() == m.k_segments[b][j].item<int64_t>();
            if (!seen) continue;
            const double s = scale * (q[b][h][i] * k[b][h / 2][j]).sum().item<double>();
            w[j] = std::exp(s);
            total += w[j];
          }
          if (total > 0)
            EXPECT_NEAR(lse[b][h][i].item<double>(), std::log(total), 1e-12) << b << h << i;
          else
            EXPECT_EQ(lse[b][h][i].item<double>(), -kInf) << b << h << i;
          for (int64_t d = 0; d < D; ++d) {
            double o = 0;
            for (int64_t j = 0; j < Tk; ++j) o += w[j] / (total > 0 ? total : 1) * v[b][h / 2][j][d].item<double>();
            EXPECT_NEAR(out[b][h][i][d].item<double>(), o, 1e-12);
          }
        }
  }
}

TEST(FlashAttention, GradientsMatchFiniteDifferences) {
  torch::manual_seed(2);
  Case c;
  c.B = 1, c.H = 2, c.Hkv = 1, c.Tq = 5, c.Tk = 6, c.D = 2, c.tiles = {2, 4};
  c.mask.k_offset = 1;  // row 0 sees nothing
  auto q = torch::randn({1, 2, 5, 2}, torch::kDouble), k = torch::randn({1, 1, 6, 2}, torch::kDouble),
       v = torch::randn({1, 1, 6, 2}, torch::kDouble);
  auto gout = torch::randn({1, 2, 5, 2}, torch::kDouble), glse = torch::randn({1, 2, 5}, torch::kDouble);
  auto fn = [&](auto& a, auto& b, auto& d) { return detail::flash_attention_tiled(a, b, d, c.mask, c.tiles); };
  const auto got = run(fn, q, k, v, gout, glse);
  auto objective = [&](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& d) {
    auto [out, lse] = detail::flash_attention_tiled(a, b, d, c.mask, c.tiles);
    return (out * gout).sum().item<double>() + (lse.masked_fill(lse.isinf(), 0) * glse).sum().item<double>();
  };
  const double h = 1e-6;
  for (int which = 0; which < 3; ++which) {
    torch::Tensor x = which == 0 ? q : which == 1 ? k : v;
    const torch::Tensor& g = which == 0 ? got.dq : which == 1 ? got.dk : got.dv;
    auto flat = x.view({-1});
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double x0 = flat[i].item<double>();
      flat[i] = x0 + h;
      const double up = objective(q, k, v);
      flat[i] = x0 - h;
      const double down = objective(q, k, v);
      flat[i] = x0;
      EXPECT_NEAR(g.view({-1})[i].item<double>(), (up - down) / (2 * h), 1e-6) << which << " " << i;
    }
  }
}

TEST(FlashAttention, OddShapesFp64) {
  torch::manual_seed(3);
  for (int64_t T : {1, 7, 33, 130})
    for (int64_t D : {1, 3, 64, 80})
      for (bool causal : {true, false}) {
        if (T == 130 && D >= 64 && !causal) continue;  // time; the causal one covers the tiling
        Case c;
        c.Tq = c.Tk = T, c.D = D, c.mask.causal = causal;
        expect_matches(c, torch::kDouble, 1e-10, causal ? "causal" : "full");
      }
  Case rect;  // Tq != Tk, both ways, with small tiles so many tiles are partial
  rect.tiles = {16, 16};
  for (auto [tq, tk] : {std::pair<int64_t, int64_t>{7, 33}, {33, 7}, {130, 33}, {33, 130}}) {
    rect.Tq = tq, rect.Tk = tk, rect.D = 5;
    rect.mask.k_offset = tq - tk;  // bottom-right aligned causal
    expect_matches(rect, torch::kDouble, 1e-10, "rect");
  }
}

TEST(FlashAttention, GroupedQueryHeads) {
  torch::manual_seed(4);
  for (int64_t hkv : {2, 1})
    for (bool causal : {true, false}) {
      Case c;
      c.B = 2, c.H = 6, c.Hkv = hkv, c.Tq = 33, c.Tk = 70, c.D = 8, c.tiles = {16, 16}, c.mask.causal = causal;
      c.mask.k_offset = -37;
      expect_matches(c, torch::kDouble, 1e-10, "gqa");
    }
}

TEST(FlashAttention, SlidingWindowAndOffsets) {
  torch::manual_seed(5);
  Case c;
  c.Tq = c.Tk = 130, c.D = 4, c.tiles = {16, 32};
  for (int64_t window : {1, 5, 40}) {
    c.mask.window = window;
    expect_matches(c, torch::kDouble, 1e-10, "window " + std::to_string(window));
  }
  c.mask.window = 20, c.mask.q_offset = 500, c.mask.k_offset = 470;  // a later chunk against an earlier one
  c.Tq = 33, c.Tk = 64;
  expect_matches(c, torch::kDouble, 1e-10, "window across chunks");
  c.mask.window = 0, c.mask.k_offset = 510;  // keys partly in the future: first rows empty
  expect_matches(c, torch::kDouble, 1e-10, "partly future");
}

TEST(FlashAttention, AllKeysInTheFuture) {
  torch::manual_seed(6);
  AttentionMask m;
  m.q_offset = 0, m.k_offset = 64;  // chunk pair of a ring: every key after every query
  auto q = torch::randn({1, 2, 33, 8}), k = torch::randn({1, 2, 40, 8}), v = torch::randn({1, 2, 40, 8});
  const auto g = run([&](auto& a, auto& b, auto& d) { return flash_attention(a, b, d, m); }, q, k, v,
                     torch::randn({1, 2, 33, 8}), torch::randn({1, 2, 33}));
  EXPECT_TRUE(g.out.eq(0).all().item<bool>());
  EXPECT_TRUE(g.lse.isneginf().all().item<bool>());
  for (const auto* t : {&g.dq, &g.dk, &g.dv}) {
    EXPECT_TRUE(t->isfinite().all().item<bool>());
    EXPECT_TRUE(t->eq(0).all().item<bool>());
  }
  Case c;  // and the naive path agrees
  c.Tq = 33, c.Tk = 40, c.D = 8, c.mask = m;
  expect_matches(c, torch::kDouble, 1e-10, "future");
}

TEST(FlashAttention, PackedDocuments) {
  torch::manual_seed(7);
  Case c;
  c.B = 2, c.H = 4, c.Hkv = 2, c.Tq = c.Tk = 130, c.D = 6, c.tiles = {32, 16};
  c.mask.q_segments = torch::stack({packed({1, 5, 17, 40, 67}), packed({64, 1, 1, 64})});
  c.mask.k_segments = c.mask.q_segments;
  expect_matches(c, torch::kDouble, 1e-10, "packed causal");
  c.mask.causal = false;
  expect_matches(c, torch::kDouble, 1e-10, "packed full");
  c.mask.q_segments = torch::randint(0, 3, {2, 130}, torch::kLong);  // unsorted ids: no skipping, still right
  c.mask.k_segments = torch::randint(0, 3, {2, 130}, torch::kLong);
  expect_matches(c, torch::kDouble, 1e-10, "unsorted ids");
}

TEST(FlashAttention, Fp32AndBf16) {
  torch::manual_seed(8);
  Case c;
  c.B = 2, c.H = 6, c.Hkv = 2, c.Tq = c.Tk = 130, c.D = 64;
  expect_matches(c, torch::kFloat, 1e-5, "fp32 causal");
  c.mask.causal = false, c.Tk = 200;
  expect_matches(c, torch::kFloat, 1e-5, "fp32 full");
  c.mask.causal = true, c.Tk = 130, c.mask.window = 50, c.D = 80;
  expect_matches(c, torch::kFloat, 1e-5, "fp32 window");
  c.mask.window = 0, c.D = 64;
  expect_matches(c, torch::kBFloat16, 2e-2, "bf16");
  expect_matches(c, torch::kHalf, 2e-2, "half");
}

TEST(FlashAttention, LseGradientAloneAndOutGradientAlone) {
  torch::manual_seed(9);
  auto q = torch::randn({1, 2, 33, 8}, torch::kDouble), k = torch::randn({1, 2, 33, 8}, torch::kDouble),
       v = torch::randn({1, 2, 33, 8}, torch::kDouble);
  auto glse = torch::randn({1, 2, 33}, torch::kDouble);
  auto grad_of_lse = [&](auto fn) {
    auto ql = q.detach().requires_grad_(), kl = k.detach().requires_grad_(), vl = v.detach().requires_grad_();
    auto [out, lse] = fn(ql, kl, vl);
    return torch::autograd::grad({lse}, {ql, kl, vl}, {glse}, c10::nullopt, false, true);
  };
  const auto f = grad_of_lse([](auto& a, auto& b, auto& d) { return flash_attention(a, b, d); });
  const auto n = grad_of_lse([](auto& a, auto& b, auto& d) { return naive_attention(a, b, d); });
  EXPECT_LE(rel_err(f[0], n[0]), 1e-10);
  EXPECT_LE(rel_err(f[1], n[1]), 1e-10);
  EXPECT_TRUE(!f[2].defined() || f[2].eq(0).all().item<bool>());  // v does not enter lse
  auto gout = torch::randn({1, 2, 33, 8}, torch::kDouble);
  const auto fo = run([](auto& a, auto& b, auto& d) { return flash_attention(a, b, d); }, q, k, v, gout, {});
  const auto no = run([](auto& a, auto& b, auto& d) { return naive_attention(a, b, d); }, q, k, v, gout, {});
  EXPECT_LE(rel_err(fo.dq, no.dq), 1e-10);
  EXPECT_LE(rel_err(fo.dk, no.dk), 1e-10);
  EXPECT_LE(rel_err(fo.dv, no.dv), 1e-10);
}

TEST(FlashAttention, TwoThreadsGiveTheSameBits) {
  torch::manual_seed(10);
  auto q = torch::randn({1, 4, 300, 32}), k = torch::randn({1, 1, 300, 32}), v = torch::randn({1, 1, 300, 32});
  auto gout = torch::randn({1, 4, 300, 32}), glse = torch::randn({1, 4, 300});
  AttentionMask m;
  m.window = 100;
  auto fn = [&](auto& a, auto& b, auto& d) { return flash_attention(a, b, d, m); };
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = run(fn, q, k, v, gout, glse);
  at::set_num_threads(2);
  const auto two = run(fn, q, k, v, gout, glse);
  at::set_num_threads(before);
  EXPECT_TRUE(torch::equal(one.out, two.out));
  EXPECT_TRUE(torch::equal(one.lse, two.lse));
  EXPECT_TRUE(torch::equal(one.dq, two.dq));
  EXPECT_TRUE(torch::equal(one.dk, two.dk));
  EXPECT_TRUE(torch::equal(one.dv, two.dv));
}

TEST(FlashAttention, StridedInputs) {
  torch::manual_seed(11);
  // [B, T, H, D] storage viewed as [B, H, T, D], as a projection produces it.
  auto q = torch::randn({2, 33, 4, 8}, torch::kDouble).transpose(1, 2);
  auto k = torch::randn({2, 33, 2, 8}, torch::kDouble).transpose(1, 2);
  auto v = torch::randn({2, 33, 2, 8}, torch::kDouble).transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  auto gout = torch::randn({2, 4, 33, 8}, torch::kDouble), glse = torch::randn({2, 4, 33}, torch::kDouble);
  const auto f = run([](auto& a, auto& b, auto& d) { return flash_attention(a, b, d); }, q, k, v, gout, glse);
  const auto n = run([](auto& a, auto& b, auto& d) { return naive_attention(a, b, d); }, q.contiguous(),
                     k.contiguous(), v.contiguous(), gout, glse);
  EXPECT_LE(rel_err(f.out, n.out), 1e-10);
  EXPECT_LE(rel_err(f.dq, n.dq), 1e-10);
  EXPECT_LE(rel_err(f.dk, n.dk), 1e-10);
  EXPECT_LE(rel_err(f.dv, n.dv), 1e-10);
}

// The message of the UsageError `fn` throws.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(FlashAttention, BadInputsNameTheValues) {
  auto q = torch::randn({2, 6, 7, 8}), k = torch::randn({2, 2, 7, 8}), v = torch::randn({2, 2, 7, 8});
  std::string e = error_of([&] { flash_attention(q, torch::randn({2, 2, 7, 4}), torch::randn({2, 2, 7, 4})); });
  EXPECT_NE(e.find("head dims differ: q has 8, k and v have 4"), std::string::npos) << e;
  e = error_of([&] { flash_attention(q, torch::randn({2, 4, 7, 8}), torch::randn({2, 4, 7, 8})); });
  EXPECT_NE(e.find("H=6"), std::string::npos) << e;
  EXPECT_NE(e.find("Hkv=4"), std::string::npos) << e;
  AttentionMask m;
  m.q_segments = torch::zeros({2, 7}, torch::kLong);
  m.k_segments = torch::zeros({2, 6}, torch::kLong);
  e = error_of([&] { flash_attention(q, k, v, m); });
  EXPECT_NE(e.find("k_segments must be [B, Tk] = [2, 7], got [2, 6]"), std::string::npos) << e;
  m.k_segments = torch::Tensor();
  e = error_of([&] { naive_attention(q, k, v, m); });
  EXPECT_NE(e.find("k_segments missing"), std::string::npos) << e;
  e = error_of([&] { flash_attention(q, k.to(torch::kDouble), v); });
  EXPECT_NE(e.find("dtypes differ: Float, Double, Float"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;  // one line
}

}  // namespace flash_attention_test
}  // namespace scaletrain::kernels

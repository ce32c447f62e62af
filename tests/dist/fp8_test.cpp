// FP8 across ranks (precision/fp8.h): the amax reduction gives every rank
// the same amax, hence the same scale, whichever rank holds the largest
// value (Note [FP8 scaling]); the FP8 collectives give exactly what a
// reference built from the scalar codec gives (Note [FP8 on the wire]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "dist_env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/fsdp/flat_param.h"
#include "scaletrain/precision/fp8.h"

namespace scaletrain::test {
namespace fp8_test {

TEST(Fp8Dist, AmaxIsReducedToTheLargestOverTheGroups) {
  const int r = world().rank(), n = world().size();
  // Rank r holds values up to r + 1, with the sign alternating: the largest
  // magnitude, n, is on the last rank.
  at::Tensor x = torch::linspace(0, r + 1, 5) * (r % 2 ? -1.0 : 1.0);
  EXPECT_DOUBLE_EQ(precision::reduce_amax(x), r + 1.0);  // no groups: this rank's
  const double amax = precision::reduce_amax(x, {world().group().get(), nullptr});
  EXPECT_DOUBLE_EQ(amax, static_cast<double>(n));
  precision::DelayedScaling d(precision::Fp8Format::E4M3, 4);
  d.record(amax);
  EXPECT_DOUBLE_EQ(d.scale(), 448.0 / n);
}

// Rank r's gradient: magnitudes over many binades, a zero run, and values
// too small for E5M2 at the rank's scale.
at::Tensor local_gradient(int r, int64_t n) {
  torch::manual_seed(100 + r);
  at::Tensor g = torch::randn({n}) * at::exp2(torch::randint(-12, 4, {n}).to(at::kFloat));
  g.narrow(0, n / 3, 5).zero_();
  return g;
}

// Values of `x` cast with its own wire scale by the scalar codec, decoded and
// divided by that scale in fp32, as Note [FP8 on the wire] says.
std::vector<float> reference_cast(const std::vector<float>& x, precision::Fp8Format f) {
  double amax = 0;
  for (float v : x) amax = std::max(amax, static_cast<double>(std::abs(v)));
  const double scale = amax > 0 ? precision::fp8_max(f) / amax : 1.0;
  std::vector<float> out;
  for (float v : x)
    out.push_back(precision::fp8_decode(precision::fp8_encode(v * static_cast<float>(scale), f, false), f) /
                  static_cast<float>(scale));
  return out;
}

// The average over ranks of every rank's local_gradient(n), reduce-scattered
// (chunk j on rank j) and, with `gather`, cast again and all-gathered.
std::vector<float> reference_average(int world, int64_t n, precision::Fp8Format f, bool gather) {
  const int64_t c = (n + world - 1) / world;
  std::vector<std::vector<float>> sent;  // each rank's padded tensor after its cast
  for (int r = 0; r < world; ++r) {
    at::Tensor g = local_gradient(r, n).contiguous();
    std::vector<float> v(g.data_ptr<float>(), g.data_ptr<float>() + n);
    v.resize(c * world, 0.0f);
    sent.push_back(reference_cast(v, f));
  }
  std::vector<float> out;
  for (int j = 0; j < world; ++j) {
    std::vector<float> chunk(c);
    for (int64_t i = 0; i < c; ++i) {
      float s = 0;
      for (int r = 0; r < world; ++r) s += sent[r][j * c + i];
      chunk[i] = s / static_cast<float>(world);
    }
    if (gather) chunk = reference_cast(chunk, f);
    out.insert(out.end(), chunk.begin(), chunk.end());
  }
  out.resize(gather ? n : c * world);
  return out;
}

TEST(Fp8Dist, AllReduceEqualsTheCodecReference) {
  const int r = world().rank(), w = world().size();
  auto& group = *world().group();
  for (auto f : {precision::Fp8Format::E5M2, precision::Fp8Format::E4M3}) {
    const int64_t n = 1001;  // not a multiple of 2 or 3: the last chunk is padded
    at::Tensor flat = local_gradient(r, n);
    const at::Tensor before = flat.clone();
    precision::fp8_all_reduce_avg(group, flat, f).wait();
    const std::vector<float> ref = reference_average(w, n, f, /*gather=*/true);
    const at::Tensor expected = torch::tensor(ref);
    EXPECT_TRUE(torch::equal(flat, expected)) << "max difference " << (flat - expected).abs().max().item<float>();
    // Close to the exact fp32 average (two casts of 2-3 significand bits), not equal to it.
    at::Tensor exact = torch::zeros({n});
    for (int k = 0; k < w; ++k) exact += local_gradient(k, n);
    exact /= w;
    EXPECT_FALSE(torch::equal(flat, exact));
    EXPECT_LT((flat - exact).norm().item<double>(), 0.3 * exact.norm().item<double>());
  }
}

TEST(Fp8Dist, ReduceScatterEqualsTheCodecReference) {
  const int r = world().rank(), w = world().size();
  auto& group = *world().group();
  const int64_t n = 1001, c = group.shard_numel(n);
  const auto f = precision::Fp8Format::E5M2;
  at::Tensor shard = torch::empty({c});
  precision::fp8_reduce_scatter_avg(group, local_gradient(r, n), shard, f).wait();
  const std::vector<float> ref = reference_average(w, n, f, /*gather=*/false);
  const at::Tensor expected = torch::tensor(std::vector<float>(ref.begin() + r * c, ref.begin() + (r + 1) * c));
  EXPECT_TRUE(torch::equal(shard, expected)) << "max difference " << (shard - expected).abs().max().item<float>();
}

TEST(Fp8Dist, ANonFiniteGradientReachesEveryRank) {
  const int r = world().rank();
  at::Tensor flat = torch::ones({64});
  if (r == 1) flat[7] = std::numeric_limits<float>::infinity();  // an overflowed backward on rank 1
  precision::fp8_all_reduce_avg(*world().group(), flat, precision::Fp8Format::E5M2).wait();
  EXPECT_FALSE(torch::isfinite(flat).all().item<bool>()) << "an overflow was hidden by the cast";
  EXPECT_EQ(precision::fp8_all_reduce_bytes(1 << 20, 2), 2 * 2 * ((1 << 19) + 8));
}

// Note [FP8 weight gathers]: a flat buffer gathered as FP8 gives, on every
// rank and at any world size, each parameter cast by the scalar codec at
// 448 / amax of the whole parameter (agreed from the pieces the ranks hold),
// decoded and divided by that scale; an exact gather gives the values.
TEST(Fp8Dist, WeightGatherEqualsTheCodecReference) {
  torch::manual_seed(5);  // the same values on every rank
  // 35 + 11 + 12 elements: shard boundaries fall inside parameters at w = 2 and 3.
  std::vector<at::Tensor> values{torch::randn({7, 5}) * 0.02, torch::randn({11}) * 3, torch::randn({3, 4}) * 1e-3};
  values[1][9] = -9.5;  // the largest magnitude sits in the last rank's shard
  std::vector<at::Tensor> params;
  for (auto& v : values) params.push_back(v.clone().requires_grad_(true));
  parallel::fsdp::FlatParamOptions o;
  o.fp8_gather = precision::Fp8Format::E4M3;
  parallel::fsdp::FlatParam flat("unit", {"a", "b", "c"}, params, 1, *world().group(), o);
  at::Tensor amax = torch::tensor(flat.fp8_local_amax(), at::kDouble);
  world().group()->all_reduce(amax, comm::ReduceOp::Max).wait();
  flat.set_fp8_amax(std::vector<double>(amax.data_ptr<double>(), amax.data_ptr<double>() + amax.numel()));
  flat.start_unshard().wait();
  for (size_t i = 0; i < values.size(); ++i) {
    const double scale = 448.0 / values[i].abs().max().item<double>();
    EXPECT_DOUBLE_EQ(flat.fp8_scales()[i], scale) << "parameter " << i;
    const at::Tensor v = values[i].reshape({-1}).contiguous(), got = params[i].detach().reshape({-1}).contiguous();
    int wrong = 0;
    for (int64_t j = 0; j < v.numel(); ++j) {
      const float x = v.data_ptr<float>()[j];
      const float want = precision::fp8_decode(precision::fp8_encode(x * static_cast<float>(scale),
                                                                     precision::Fp8Format::E4M3, true),
                                               precision::Fp8Format::E4M3) /
                         static_cast<float>(scale);
      wrong += got.data_ptr<float>()[j] != want ? 1 : 0;
    }
    EXPECT_EQ(wrong, 0) << "parameter " << i << ": elements that differ from the codec's cast";
    EXPECT_FALSE(at::equal(params[i].detach(), values[i])) << "parameter " << i << " was not cast";
  }
  flat.reshard();
  flat.start_unshard(/*exact=*/true).wait();
  for (size_t i = 0; i < values.size(); ++i) EXPECT_TRUE(at::equal(params[i].detach(), values[i])) << i;
}

}  // namespace fp8_test
}  // namespace scaletrain::test

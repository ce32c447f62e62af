// FP8 amax reduction across ranks (precision/fp8.h, Note [FP8 scaling]):
// every rank ends with the same amax, hence the same scale, whichever rank
// holds the largest value.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/precision/fp8.h"

namespace scaletrain::test {
namespace {

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

}  // namespace
}  // namespace scaletrain::test

// Overflow agreement: an inf in one rank's gradients must make every rank
// report overflow, back off the same way and skip the same step.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "dist_env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/precision/loss_scaler.h"

namespace scaletrain::test {
namespace loss_scaler_test {

precision::LossScalerOptions one_credit() {
  precision::LossScalerOptions o;
  o.initial_scale = 1024;
  o.hysteresis = 1;  // back off on the first overflow
  o.growth_interval = 1000;
  return o;
}

TEST(LossScalerDist, InfOnOneRankMakesEveryRankSkip) {
  auto& group = *world().group();
  ASSERT_GE(group.size(), 2);
  precision::LossScaler scaler(one_credit());

  // A clean step first: no overflow anywhere, gradients unscaled.
  auto g = torch::full({16}, 1024.0);
  EXPECT_FALSE(scaler.unscale_and_check({g}, {&group}));
  scaler.update(false);
  EXPECT_TRUE(torch::allclose(g, torch::ones({16})));

  // Rank 1 alone sees an inf.
  auto g1 = torch::full({16}, 1024.0), g2 = torch::full({4, 4}, 1024.0);
  if (group.rank() == 1) g2[2][3] = std::numeric_limits<float>::infinity();
  const bool overflow = scaler.unscale_and_check({g1, g2}, {&group});
  EXPECT_TRUE(overflow) << "rank " << group.rank();
  scaler.update(overflow);
  EXPECT_EQ(scaler.scale(), 512) << "rank " << group.rank();
  EXPECT_EQ(scaler.skipped_steps(), 1) << "rank " << group.rank();

  // Every rank ends with the same scaler state.
  auto state = torch::tensor({scaler.scale(), static_cast<double>(scaler.skipped_steps())}, torch::kDouble);
  auto max = state.clone(), min = state.clone();
  group.all_reduce(max, comm::ReduceOp::Max).wait();
  group.all_reduce(min, comm::ReduceOp::Min).wait();
  EXPECT_TRUE(torch::equal(max, min));
}

TEST(LossScalerDist, NaNAgreedAcrossTwoGroupsInTurn) {
  // The world group twice stands in for two groups (dp, then tp): the flag
  // is reduced over each in turn; a NaN on the last rank reaches everyone.
  auto& group = *world().group();
  precision::LossScaler scaler(one_credit());
  auto g = torch::full({8}, 2.0, torch::kBFloat16);
  if (group.rank() == group.size() - 1) g[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(scaler.unscale_and_check({g}, {&group, &group}));
}

}  // namespace loss_scaler_test
}  // namespace scaletrain::test

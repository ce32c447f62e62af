// Pipeline schedules as data (parallel/pipeline/schedule.h): every schedule
// runs each (micro-batch, chunk) forward and backward exactly once on its
// stage, completes, holds the activations the table says, and idles the
// textbook bubble; orders that would hang are found before anything runs.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "scaletrain/parallel/pipeline/schedule.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::pipeline {
namespace pipeline_schedule_test {

using Kind = Action::Kind;

void expect_complete_orders(const ScheduleShape& sh) {
  const int chunks = sh.stages * sh.virtual_stages;
  for (int s = 0; s < sh.stages; ++s) {
    std::set<std::tuple<int, int, int>> seen;
    std::set<std::pair<int, int>> forwarded;
    for (const Action& a : stage_actions(sh, s)) {
      EXPECT_EQ(a.chunk % sh.stages, s) << to_string(a) << " is not on stage " << s;
      EXPECT_TRUE(seen.insert({static_cast<int>(a.kind), a.microbatch, a.chunk}).second) << to_string(a) << " twice";
      if (a.kind == Kind::Forward) forwarded.insert({a.microbatch, a.chunk});
      else EXPECT_TRUE(forwarded.count({a.microbatch, a.chunk})) << to_string(a) << " before its forward";
    }
    EXPECT_EQ(static_cast<int>(seen.size()), 2 * sh.microbatches * chunks / sh.stages);
  }
}

TEST(PipelineSchedule, EveryActionOnceAndNoDeadlock) {
  for (Schedule kind : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved})
    for (int p : {1, 2, 3, 4})
      for (int m : {1, 2, 4, 8}) {
        for (int v : {1, 2, 3}) {
          ScheduleShape sh{kind, p, m, v};
          if ((kind != Schedule::Interleaved && v != 1) || (kind == Schedule::Interleaved && m % p != 0)) {
            EXPECT_THROW(check_schedule(sh), UsageError);
            continue;
          }
          SCOPED_TRACE(to_string(kind) + " p=" + std::to_string(p) + " m=" + std::to_string(m) + " v=" +
                       std::to_string(v));
          EXPECT_NO_THROW(check_schedule(sh));
          expect_complete_orders(sh);
          const Replay r = simulate(sh);
          ASSERT_TRUE(r.completes) << r.stuck;
          // Equal stages and free communication: exactly the textbook bubble.
          EXPECT_NEAR(r.bubble, expected_bubble(sh), 1e-9);
        }
      }
}

TEST(PipelineSchedule, ActivationsInFlight) {
  for (int m : {1, 2, 4, 8}) {
    EXPECT_EQ(simulate({Schedule::GPipe, 4, m, 1}).max_in_flight, m);
    EXPECT_EQ(simulate({Schedule::OneFOneB, 4, m, 1}).max_in_flight, std::min(4, m));
  }
  // Stage s of 1f1b holds p - s micro-batches at most.
  int most = 0, live = 0;
  for (const Action& a : stage_actions({Schedule::OneFOneB, 4, 8, 1}, 2)) {
    live += a.kind == Kind::Forward ? 1 : -1;
    most = std::max(most, live);
  }
  EXPECT_EQ(most, 2);
}

TEST(PipelineSchedule, OneFOneBOrderOnTheFirstStage) {
  std::string order;
  for (const Action& a : stage_actions({Schedule::OneFOneB, 3, 4, 1}, 0)) order += to_string(a) + " ";
  EXPECT_EQ(order, "F0@c0 F1@c0 F2@c0 B0@c0 F3@c0 B1@c0 B2@c0 B3@c0 ");
  order.clear();
  for (const Action& a : stage_actions({Schedule::Interleaved, 2, 2, 2}, 1)) order += to_string(a) + " ";
  // Stage 1 holds chunks 1 and 3; p=m: every forward first.
  EXPECT_EQ(order, "F0@c1 F1@c1 F0@c3 F1@c3 B0@c3 B1@c3 B0@c1 B1@c1 ");
}

TEST(PipelineSchedule, ReplayFindsAHang) {
  ScheduleShape sh{Schedule::OneFOneB, 2, 2, 1};
  std::vector<std::vector<Action>> orders{stage_actions(sh, 0), stage_actions(sh, 1)};
  // The last stage asks for micro-batch 1's backward before running its forward
  // of micro-batch 0... and the first stage waits for that backward.
  orders[1] = {{Kind::Forward, 1, 1}, {Kind::Backward, 1, 1}, {Kind::Forward, 0, 1}, {Kind::Backward, 0, 1}};
  orders[0] = {{Kind::Forward, 0, 0}, {Kind::Backward, 0, 0}, {Kind::Forward, 1, 0}, {Kind::Backward, 1, 0}};
  const Replay r = simulate(sh, orders);
  EXPECT_FALSE(r.completes);
  EXPECT_NE(r.stuck.find("waits in"), std::string::npos) << r.stuck;
}

TEST(PipelineSchedule, ImpossibleShapesAreOneLineErrors) {
  auto message = [](const ScheduleShape& sh) {
    try {
      check_schedule(sh);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({Schedule::Interleaved, 4, 2, 2}).find("multiple of pp micro-batches"), std::string::npos);
  EXPECT_NE(message({Schedule::OneFOneB, 2, 4, 2}).find("interleaved"), std::string::npos);
  EXPECT_NE(message({Schedule::GPipe, 2, 0, 1}).find("at least one micro-batch"), std::string::npos);
  EXPECT_EQ(message({Schedule::GPipe, 2, 0, 1}).find('\n'), std::string::npos);
  EXPECT_THROW(parse_schedule("zigzag"), UsageError);
  EXPECT_EQ(parse_schedule("1f1b"), Schedule::OneFOneB);
}

}  // namespace pipeline_schedule_test
}  // namespace scaletrain::parallel::pipeline

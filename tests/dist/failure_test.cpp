// A collective whose peer never comes, and one whose peer has exited, must
// raise CommError naming the operation, the group and the sequence number
// instead of hanging. Run alone (dist.failures.w2) with a 2 s timeout
// (SCALETRAIN_TEST_TIMEOUT_S), since it leaves the world group unusable.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "dist_env.h"

namespace scaletrain::test {
namespace failure_test {

void expect_named_error(const std::string& what, const char* op) {
  EXPECT_NE(what.find(op), std::string::npos) << what;
  EXPECT_NE(what.find("group 'world'"), std::string::npos) << what;
  EXPECT_NE(what.find("seq "), std::string::npos) << what;
}

// Debug mode (on in these tests): ranks that call different collectives are
// told so before any data moves, naming the rank that differs; the group
// stays usable.
TEST(Failure, MismatchedCallsAreNamedBeforeDataMoves) {
  ASSERT_EQ(world().size(), 2);
  ASSERT_TRUE(world().debug_collectives()) << "the dist tests run in debug mode";
  auto t = torch::ones({world().rank() == 0 ? 8 : 9});
  try {
    world().group()->all_reduce(t).wait();
    FAIL() << "mismatched all_reduce ran";
  } catch (const comm::CommError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("collective mismatch on group 'world' at seq "), std::string::npos) << w;
    EXPECT_NE(w.find("rank 1 (group rank 1) called all_reduce(Float[9], sum)"), std::string::npos) << w;
    EXPECT_NE(w.find("rank 0 called all_reduce(Float[8], sum)"), std::string::npos) << w;
  }
  try {
    if (world().rank() == 0)
      world().group()->broadcast(t, 0).wait();
    else
      world().group()->all_gather(t.narrow(0, 0, 4), t.narrow(0, 0, 8)).wait();
    FAIL() << "mismatched collective ran";
  } catch (const comm::CommError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("rank 1 (group rank 1) called all_gather(Float[4], Float[8])"), std::string::npos) << w;
    EXPECT_NE(w.find("rank 0 called broadcast(Float[8], root 0)"), std::string::npos) << w;
  }
  auto u = torch::ones({4});
  world().group()->all_reduce(u).wait();
  EXPECT_EQ(u[0].item<float>(), 2.0f);
}

TEST(Failure, TimeoutNamesTheOperation) {
  ASSERT_EQ(world().size(), 2);
  ASSERT_LE(world().timeout().count(), 5000) << "run with SCALETRAIN_TEST_TIMEOUT_S=2";
  if (world().rank() == 1) {
    // Never joins the all_reduce; outlives rank 0's deadline, then leaves.
    std::this_thread::sleep_for(std::chrono::seconds(4));
    std::_Exit(0);
  }
  auto t = torch::ones({1000});
  auto t0 = std::chrono::steady_clock::now();
  try {
    world().group()->all_reduce(t).wait();
    FAIL() << "all_reduce without its peer returned";
  } catch (const comm::CommError& e) {
    expect_named_error(e.what(), "all_reduce");
    // Rank 1 is sleeping, not in a collective: it answers, and is behind.
    const std::string w = e.what();
    EXPECT_NE(w.find("\nculprit: rank 1 is behind: it has not started seq "), std::string::npos) << w;
    EXPECT_NE(w.find("not in a collective for"), std::string::npos) << w;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST(Failure, VanishedPeerNamesTheOperation) {
  // Rank 1 has exited by now (or exits while we wait).
  std::this_thread::sleep_for(std::chrono::seconds(3));
  auto t = torch::ones({1000});
  try {
    world().group()->broadcast(t, 0).wait();
    world().group()->all_reduce(t).wait();
    FAIL() << "collective with a vanished peer returned";
  } catch (const comm::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("seq "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("group 'world'"), std::string::npos) << e.what();
  }
}

// Outside debug mode (dist.failures_nodebug.w2, SCALETRAIN_DEBUG_COLLECTIVES=0):
// ranks that disagree on a shape must not reach Gloo, which can abort the
// process from its own thread (gloo::EnforceNotMet). The first collective
// of each kind is compared (Note [First-of-kind check]); after that the
// group is still usable. Then a kind one rank has seen and the other has
// not: both end in a diagnosed CommError within the timeout.
TEST(NoDebugFailure, MismatchedShapesAreNamedNotAborted) {
  ASSERT_EQ(world().size(), 2);
  ASSERT_FALSE(world().debug_collectives()) << "run with SCALETRAIN_DEBUG_COLLECTIVES=0";
  ASSERT_LE(world().timeout().count(), 5000) << "run with SCALETRAIN_TEST_TIMEOUT_S=3";
  auto t = torch::ones({world().rank() == 0 ? 8 : 9});
  try {
    world().group()->all_reduce(t).wait();
    FAIL() << "mismatched all_reduce ran";
  } catch (const comm::CommError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("collective mismatch on group 'world' at seq "), std::string::npos) << w;
    EXPECT_NE(w.find("rank 1 (group rank 1) called all_reduce(Float[9], sum)"), std::string::npos) << w;
  }
  auto u = torch::ones({4});
  world().group()->all_reduce(u).wait();
  EXPECT_EQ(u[0].item<float>(), 2.0f);
  // Both have run all_reduce(Float[4]); now rank 1 alone calls a new kind.
  auto v = torch::ones({world().rank() == 0 ? 4 : 5});
  const auto t0 = std::chrono::steady_clock::now();
  try {
    world().group()->all_reduce(v).wait();
    FAIL() << "mismatched all_reduce ran";
  } catch (const comm::CommError& e) {
    const std::string w = e.what();
    if (world().rank() == 1)
      EXPECT_NE(w.find("rank 0 did not compare its collective of this seq"), std::string::npos) << w;
    else
      EXPECT_NE(w.find("all_reduce"), std::string::npos) << w;
    EXPECT_NE(w.find("ranks of group 'world'"), std::string::npos) << "the diagnosis table: " << w;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
}

}  // namespace failure_test
}  // namespace scaletrain::test

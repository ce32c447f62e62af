// Entry point of the multi-process tests: every rank runs the same GoogleTest
// binary under `scaletrain launch`, sharing one World for all tests. Tests run
// in the same order on every rank, so their collectives line up.
#include <gtest/gtest.h>

#include <string>
#include <torch/torch.h>

#include <cstdlib>

#include "../unit/torch/seed_each_test.h"
#include "dist_env.h"

namespace scaletrain::test {

std::shared_ptr<comm::World>& world_ptr() {
  static std::shared_ptr<comm::World> w;
  return w;
}

comm::World& world() { return *world_ptr(); }

}  // namespace scaletrain::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(1);
  scaletrain::comm::WorldOptions o;
  o.timeout = std::chrono::seconds(60);
  // Every collective's fingerprint is compared across ranks before it runs
  // (SCALETRAIN_DEBUG_COLLECTIVES=0 turns it off, e.g. to time a test).
  o.debug_collectives = true;
  if (const char* t = std::getenv("SCALETRAIN_TEST_TIMEOUT_S")) o.timeout = std::chrono::seconds(std::atoi(t));
  scaletrain::test::world_ptr() = scaletrain::comm::World::init(o);
  // Each test starts from a seed of its name and the rank (seed_each_test.h).
  ::testing::UnitTest::GetInstance()->listeners().Append(
      new scaletrain::test::SeedEachTest(static_cast<uint64_t>(scaletrain::test::world().rank()) + 1));
  // Only rank 0 prints the test log (SCALETRAIN_TEST_ALL_RANKS=1: every
  // rank); failures on any rank still fail the exit code.
  const char* all = std::getenv("SCALETRAIN_TEST_ALL_RANKS");
  if (scaletrain::test::world().rank() != 0 && !(all && std::string(all) == "1")) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  try {
    scaletrain::test::world().group()->barrier().wait();
  } catch (const scaletrain::comm::CommError&) {
    // The failure tests leave the group broken on purpose.
  }
  return rc;
}

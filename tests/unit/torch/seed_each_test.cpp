// Registers SeedEachTest for the single-process unit tests (their main is
// GoogleTest's own, so the listener is appended before it runs).
#include "seed_each_test.h"

namespace seed_each_test {

const bool registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new scaletrain::test::SeedEachTest());
  return true;
}();

}  // namespace seed_each_test

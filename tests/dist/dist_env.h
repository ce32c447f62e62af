#pragma once
#include "scaletrain/comm/world.h"

namespace scaletrain::test {
// The job's world, initialised once in main() from the launcher's variables.
comm::World& world();
}  // namespace scaletrain::test

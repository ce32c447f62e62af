#!/usr/bin/env bash
# Installs what is needed, builds everything and runs every test (unit and
# multi-process) under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# One object per source (no unity batches): CTest source.call_cycles reads
# which file calls which from the objects (Note [Unity build] in CMakeLists.txt).
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSCALETRAIN_BUILD_TESTS=ON -DSCALETRAIN_BUILD_BENCH=ON \
  -DSCALETRAIN_UNITY_BUILD=OFF >/dev/null
cmake --build build -j"$(nproc)"
# CTest starts the longest tests first when it knows their durations: a clone
# has none yet, so it starts from the ones committed in tests/ctest-costs.txt
# (scripts/update-test-costs.sh refreshes them from a full run).
mkdir -p build/Testing/Temporary
[ -f build/Testing/Temporary/CTestCostData.txt ] || cp tests/ctest-costs.txt build/Testing/Temporary/CTestCostData.txt
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 600

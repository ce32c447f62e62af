#!/usr/bin/env bash
# Copies the test durations of the last full CTest run in build/ into
# tests/ctest-costs.txt, which scripts/run-tests.sh gives a fresh clone's
# CTest so that it starts the longest tests first (two cores: a long test
# started last would run alone at the end). Only the durations are kept, not
# the list of tests that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
src=build/Testing/Temporary/CTestCostData.txt
[ -f "$src" ] || { echo "update-test-costs.sh: no $src: run the tests first" >&2; exit 2; }
sed '/^---$/,$d' "$src" | sort > tests/ctest-costs.txt
echo "update-test-costs.sh: $(wc -l < tests/ctest-costs.txt) tests in tests/ctest-costs.txt"

#!/usr/bin/env bash
# Writes the test durations of the last CTest run in build/ (a full one:
# scripts/run-tests.sh) into tests/ctest-costs.txt, which scripts/run-tests.sh
# gives a fresh clone's CTest so that it starts the longest tests first (two
# cores: a long test started last would run alone at the end). The durations
# are each test's "Test time" in build/Testing/Temporary/LastTest.log, in
# CTestCostData.txt's form (name, runs, seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
log=build/Testing/Temporary/LastTest.log
[ -f "$log" ] || { echo "update-test-costs.sh: no $log: run the tests first" >&2; exit 2; }
python3 - "$log" <<'PY' | sort > tests/ctest-costs.txt
import re, sys
name = None
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    line = line.strip()
    m = re.match(r"^\d+/\d+ Test: (.+)$", line)
    if m:
        name = m.group(1)
    m = re.match(r"^Test time = +([\d.]+) sec$", line)
    if m and name:
        print(name, 1, m.group(1))
        name = None
PY
n=$(wc -l < tests/ctest-costs.txt)
[ "$n" -gt 0 ] || { echo "update-test-costs.sh: no test durations in $log" >&2; exit 2; }
echo "update-test-costs.sh: $n tests in tests/ctest-costs.txt"

#!/usr/bin/env bash
# Runs the multi-process and timeout tests while CPU-bound processes keep
# every core busy (issue 52: a suite that passes only on a quiet machine is
# not trusted). Run after scripts/run-tests.sh has built build/.
# usage: scripts/test-under-load.sh [BUILD_DIR] [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
shift || true
[[ -x $BUILD/scaletrain ]] || { echo "build it first: bash scripts/run-tests.sh" >&2; exit 2; }
burners=()
stop() { ((${#burners[@]})) && kill "${burners[@]}" 2>/dev/null || true; }
trap stop EXIT
# One busy loop per core, at the tests' own priority.
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  burners+=($!)
done
# Every test about timeouts, heartbeats, elastic rounds, restarts and busy
# ports, and the multi-process engine tests that start and join worlds
# (collectives, DDP, the sharded engine, failures). Pass -R to choose others.
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)" --timeout 600 \
  -R '^dist\.(collectives|ddp|failures|failures_nodebug|sharded)\.|CollectiveTimeout|Elastic|Launch|Cli\.|RendezvousStore|CheckpointResume' \
  "$@"

#!/usr/bin/env bash
# Collective bus bandwidth, scaletrain's comm::Group next to raw c10d Gloo in
# the same processes, for world sizes given (default 2 and 4), on loopback.
# usage: scripts/bench-collectives.sh [--build DIR] [--worlds 2,4] [-- extra bench_collectives args]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench WORLDS=2,4 EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "bench-collectives.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x $BUILD/bench/bench_collectives ]] || { echo "build it: cmake --build $BUILD --target scaletrain bench_collectives" >&2; exit 2; }
ST=$BUILD/scaletrain  # its own runs are not disturbances (bench-common.sh)
source "$ROOT/scripts/bench-common.sh"
IFS=, read -r -a worlds <<<"$WORLDS"
port=$((29600 + RANDOM % 100))
for n in "${worlds[@]}"; do
  # A run disturbed by a compiler or a test run is done again (up to 5 tries).
  for try in 1 2 3 4 5; do
    wait_quiet
    busy_watch_start
    port=$((port + 2))
    table=$("$BUILD/scaletrain" launch --nproc-per-node "$n" --threads 1 --master-port $port -- \
      "$BUILD/bench/bench_collectives" "${EXTRA[@]}" | sed -n 's/^\[rank 0\] //p')
    if busy_watch_stop && ((try < 5)); then echo "bench-collectives.sh: disturbed; again" >&2; continue; fi
    break
  done
  echo "## world size $n"
  echo
  echo "$table"
  echo
done

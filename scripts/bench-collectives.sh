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
IFS=, read -r -a worlds <<<"$WORLDS"
for n in "${worlds[@]}"; do
  echo "## world size $n"
  echo
  "$BUILD/scaletrain" launch --nproc-per-node "$n" --threads 1 --master-port $((29600 + n * 7)) -- \
    "$BUILD/bench/bench_collectives" "${EXTRA[@]}" | sed -n 's/^\[rank 0\] //p'
  echo
done

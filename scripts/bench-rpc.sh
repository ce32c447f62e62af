#!/usr/bin/env bash
# rpc_sync round-trip time and bandwidth (rpc/, over TensorPipe) next to raw
# c10d Gloo send/recv in the same processes, 2 ranks on loopback, 1 KiB to
# 64 MiB (bench/RESULTS.md section 14).
# usage: scripts/bench-rpc.sh [--build DIR] [-- extra bench_rpc args]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "bench-rpc.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x $BUILD/bench/bench_rpc ]] || { echo "build it: cmake --build $BUILD --target scaletrain bench_rpc" >&2; exit 2; }
ST=$BUILD/scaletrain
source "$ROOT/scripts/bench-common.sh"
wait_quiet
port=$((29500 + RANDOM % 100))
"$ST" launch --nproc-per-node 2 --threads 1 --master-port $port -- "$BUILD/bench/bench_rpc" "${EXTRA[@]}" |
  sed -n 's/^\[rank 0\] //p'

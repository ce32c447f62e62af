#!/usr/bin/env bash
# Pipeline schedules and tensor-parallel traffic, measured (bench/bench_pipeline.cpp):
#  1. bubble fraction of gpipe, 1f1b (m = 1, 2, 4, 8) and interleaved (v = 2)
#     on p stages, next to (p-1)/(m+p-1) and (p-1)/(v*m+p-1), and the peak
#     activation bytes per stage (1f1b against gpipe: expected ~ p/m);
#  2. bytes tensor parallelism puts on the wire per layer (2 ranks in two
#     network namespaces; tx_bytes of each veth), from runs with 2 and 4
#     layers, next to the formula 4 x B*T*C*4 bytes x 2(n-1)/n per rank and
#     step (two all-reduces forward, two backward; the same with sequence
#     parallelism as all-gathers and reduce-scatters).
# Waits for compilers to finish (bench-common.sh) before measuring.
#
# usage: scripts/bench-pipeline.sh [--build DIR] [--worlds 2,4] [--steps S] [--out FILE]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench WORLDS=2,4 STEPS=6 OUT=""
PP_MODEL="--layers 8 --embd 256 --heads 8 --seq 128 --micro 2"
TP_MODEL="--embd 256 --heads 8 --seq 128 --micro 2"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "bench-pipeline.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain BP=$BUILD/bench/bench_pipeline
for b in "$ST" "$BP"; do [[ -x $b ]] || { echo "bench-pipeline.sh: $b not built" >&2; exit 2; }; done
WORK=$(mktemp -d /tmp/bench-pipeline.XXXXXX)
source "$ROOT/scripts/bench-common.sh"
trap 'netns_cleanup; rm -rf "$WORK"; true' EXIT
trap 'exit 130' INT TERM
OUT=${OUT:-$WORK/results.jsonl}
: >"$OUT"
PORT=$((29650 + RANDOM % 40))

wait_quiet
for w in ${WORLDS//,/ }; do
  echo "== pipeline, $w stages" >&2
  "$ST" launch --nproc-per-node "$w" --threads 1 --master-port $((PORT++)) -- \
    "$BP" pp $PP_MODEL --steps "$STEPS" 2>&1 | sed -n 's/^\[rank 0\] //p' | grep '^{' | tee -a "$OUT"
done

# Tensor parallelism on a real link: ranks in two namespaces.
RATE=10000 DELAY=0
netns_setup
tp_run() {  # LAYERS SP_FLAG -> tx bytes per step of rank 0
  local common="WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=$IP0 MASTER_PORT=$((PORT++)) OMP_NUM_THREADS=1"
  ip netns exec $NS1 env $common RANK=1 GLOO_SOCKET_IFNAME=$IF1 BENCH_IFACE=$IF1 timeout 300 \
    "$BP" tp $TP_MODEL --layers "$1" $2 --steps "$STEPS" >/dev/null 2>"$WORK/tp1.err" &
  ip netns exec $NS0 env $common RANK=0 GLOO_SOCKET_IFNAME=$IF0 BENCH_IFACE=$IF0 timeout 300 \
    "$BP" tp $TP_MODEL --layers "$1" $2 --steps "$STEPS" 2>"$WORK/tp0.err" | grep -o '"tx_bytes_per_step": [0-9.]*' |
    awk '{print $2}'
  wait
}
for sp in "" "--sp"; do
  b2=$(tp_run 2 "$sp") b4=$(tp_run 4 "$sp")
  awk -v b2="$b2" -v b4="$b4" -v sp="${sp:-none}" 'BEGIN {
    S = 2 * 128 * 256 * 4; n = 2; f = 4 * S * 2 * (n - 1) / n; per = (b4 - b2) / 2;
    printf "{\"tp\": 2, \"sp\": \"%s\", \"tx_bytes_2_layers\": %d, \"tx_bytes_4_layers\": %d, \"bytes_per_layer\": %.0f, \"formula\": %.0f, \"ratio\": %.4f}\n", sp, b2, b4, per, f, per / f }' |
    tee -a "$OUT"
done
echo "bench-pipeline.sh: results in $OUT" >&2

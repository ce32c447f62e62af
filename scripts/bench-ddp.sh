#!/usr/bin/env bash
# DDP step time, scaletrain vs PyTorch's own DDP (gloo), 2 ranks, 1 thread per
# rank, same GPT, same global batch; plus compute-only and all-reduce-only
# times and the overlap efficiency. Two links:
#   loopback  both ranks on 127.0.0.1 (started by `scaletrain launch`)
#   netem     rank 0 and rank 1 in two network namespaces joined by a veth
#             pair shaped with `tc netem delay D rate R` on both ends, so that
#             communication is a sizeable part of the step (needs root)
# The two implementations alternate (ours, torch, torch, ours, ...) for
# --repeats runs per link and configuration; each run prints its medians as a
# JSON line; the table shows the median over runs.
#
# usage: scripts/bench-ddp.sh [--build DIR] [--repeats K] [--rounds R] [--steps S]
#                             [--delay MS] [--rate MBIT] [--links loopback,netem]
#                             [--configs default,small] [--global-batch B] [--model "ARGS"] [--out FILE]
#                             [--tail-growth G] [--impls scaletrain,pytorch]
# configs: default = buckets 25 MiB / first 1 MiB (both libraries' defaults;
#                    ours also tapers the last buckets down to 1 MiB)
#          medium  = buckets 4 MiB / first 1 MiB (ours: last 1 MiB)
#          small   = buckets 0.25 MiB / first 0.25 MiB (more, smaller buckets)
#          CONFIG-notail = CONFIG with ours' tail taper off (last_bucket_cap 0);
#                    runs ours only (PyTorch has no such option)
# --model: passed to both sides, e.g. "--n-layer 6 --n-embd 384 --n-head 6" (default: preset tiny)
# --tail-growth: ours only, DDPOptions::tail_growth (default 1.5)
# --impls: which implementations to run (default both)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench
REPEATS=3 ROUNDS=3 STEPS=10 DELAY=1 RATE=200 GB=16
LINKS=loopback,netem CONFIGS=default,small OUT="" GROWTH=1.5 IMPLS=scaletrain,pytorch
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --links) LINKS=$2; shift 2 ;;
    --configs) CONFIGS=$2; shift 2 ;;
    --global-batch) GB=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --tail-growth) GROWTH=$2; shift 2 ;;
    --impls) IMPLS=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "bench-ddp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

LAUNCH=$BUILD/scaletrain
OURS=$BUILD/bench/bench_ddp
TORCH=$ROOT/bench/ddp_vs_torch/torch_ddp.py
PY=/usr/bin/python3
for f in "$LAUNCH" "$OURS"; do
  [[ -x $f ]] || { echo "bench-ddp.sh: $f not built (cmake --build $BUILD --target scaletrain bench_ddp)" >&2; exit 2; }
done
RESULTS=${OUT:-$(mktemp /tmp/bench-ddp.XXXXXX.jsonl)}
: > "$RESULTS"
PORT=$((29700 + RANDOM % 200))

trap 'netns_cleanup; [[ -n ${BUSY_PID:-} ]] && kill "$BUSY_PID" 2>/dev/null; true' EXIT
trap 'exit 130' INT TERM

config_args() {
  case ${1%-notail} in
    default) echo "--bucket-mb 25 --first-bucket-mb 1" ;;
    medium) echo "--bucket-mb 4 --first-bucket-mb 1" ;;
    small) echo "--bucket-mb 0.25 --first-bucket-mb 0.25" ;;
    *) echo "bench-ddp.sh: unknown config $1" >&2; exit 2 ;;
  esac
}

# Ours only: the size of the last bucket (Note [Bucket tail] in parallel/ddp/ddp.h).
tail_args() {
  case $1 in
    *-notail) echo "--last-bucket-mb 0" ;;
    small) echo "--last-bucket-mb 0.25 --tail-growth $GROWTH" ;;
    *) echo "--last-bucket-mb 1 --tail-growth $GROWTH" ;;
  esac
}

# run_one LINK CONFIG IMPL PORT: one 2-rank run; prints its JSON line, tagged.
run_one() {
  local link=$1 cfg=$2 impl=$3 port=$4 line
  local args="--global-batch $GB --rounds $ROUNDS --steps $STEPS $(config_args "$cfg") ${MODEL:-}"
  local cmd
  if [[ $impl == scaletrain ]]; then cmd="$OURS $args $(tail_args "$cfg")"; else cmd="$PY $TORCH $args"; fi
  if [[ $link == loopback ]]; then
    line=$(timeout 900 "$LAUNCH" launch --nproc-per-node 2 --threads 1 --master-port $port -- $cmd | grep -o '{.*}' | head -1)
  else
    local common="WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=$IP0 MASTER_PORT=$port OMP_NUM_THREADS=1 SCALETRAIN_THREADS=1"
    local log1
    log1=$(mktemp)
    ip netns exec $NS1 env $common RANK=1 GLOO_SOCKET_IFNAME=$IF1 timeout 900 $cmd >"$log1" 2>&1 &
    local pid1=$!
    line=$(ip netns exec $NS0 env $common RANK=0 GLOO_SOCKET_IFNAME=$IF0 timeout 900 $cmd | grep -o '{.*}' | head -1) || true
    if ! wait $pid1; then echo "bench-ddp.sh: rank 1 failed:" >&2; cat "$log1" >&2; fi
    rm -f "$log1"
  fi
  [[ -n $line ]] || { echo "bench-ddp.sh: $impl on $link/$cfg produced no result" >&2; return 1; }
  echo "{\"link\": \"$link\", \"config\": \"$cfg\", ${line#\{}"
}

source "$ROOT/scripts/bench-common.sh"

IFS=, read -r -a links <<<"$LINKS"
IFS=, read -r -a configs <<<"$CONFIGS"
for link in "${links[@]}"; do
  [[ $link == netem ]] && netns_setup
  for cfg in "${configs[@]}"; do
    for ((k = 0; k < REPEATS; k++)); do
      if ((k % 2 == 0)); then order="scaletrain pytorch"; else order="pytorch scaletrain"; fi
      [[ $cfg == *-notail || $IMPLS != *pytorch* ]] && order=scaletrain
      [[ $IMPLS != *scaletrain* ]] && order=pytorch
      # Both implementations of a repeat run on a quiet machine, else the
      # pair is measured again (up to 5 tries).
      for try in 1 2 3 4 5; do
        wait_quiet
        busy_watch_start
        pair=""
        for impl in $order; do
          PORT=$((PORT + 2))
          pair+="$(run_one "$link" "$cfg" "$impl" $PORT)"$'\n' || exit 1
        done
        if busy_watch_stop && ((try < 5)); then
          echo "bench-ddp.sh: a compiler ran during this pair; measuring it again" >&2
          continue
        fi
        printf '%s' "$pair" | tee -a "$RESULTS"
        break
      done
    done
  done
  [[ $link == netem ]] && netns_cleanup
done

echo
echo "shaped link: ${SHAPER:-not used}, each way; global batch $GB; $REPEATS runs per cell; results in $RESULTS"
$PY "$ROOT/bench/ddp_vs_torch/summarize.py" "$RESULTS"

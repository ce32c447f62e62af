#!/usr/bin/env bash
# One rank on 1 and 2 intra-op threads, with each of Debian's OpenBLAS
# builds: the OpenMP one (its threads are libtorch's) and the pthreads one
# (a pool of its own beside libtorch's). The build is chosen per run with
# LD_LIBRARY_PATH, so every combination runs the same binary; the runs
# alternate for ROUNDS rounds and each figure is the median over rounds of
# a run's median step (steps after the 4th). Prints a Markdown table.
# usage: scripts/bench-blas-threads.sh [--build DIR] [--data TOKENS] [--steps N] [--rounds R]
#        [--model "OVERRIDES"]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench DATA="" STEPS=12 ROUNDS=3
MODEL="--model.n_layer=6 --model.n_embd=384 --model.n_head=6"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    *) echo "bench-blas-threads.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
LIBDIR=/usr/lib/x86_64-linux-gnu
for v in openmp pthread; do
  [[ -e $LIBDIR/openblas-$v/libblas.so.3 ]] || { echo "bench-blas-threads.sh: libopenblas0-$v is not installed" >&2; exit 2; }
done
WORK=$(mktemp -d /tmp/bench-blas-threads.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
source "$ROOT/scripts/bench-common.sh"
[[ -n $DATA ]] || DATA=$(kjv_tokens)
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }

combos=("openmp 1" "openmp 2" "pthread 1" "pthread 2")
for ((r = 1; r <= ROUNDS; r++)); do
  for c in "${combos[@]}"; do
    read -r v t <<<"$c"
    m="$WORK/m.jsonl"
    wait_quiet
    # shellcheck disable=SC2086  # MODEL is a list of overrides
    LD_LIBRARY_PATH=$LIBDIR/openblas-$v OMP_NUM_THREADS=$t SCALETRAIN_THREADS=$t "$ST" train \
      "$ROOT/bench/train-throughput.yaml" --data.path="$DATA" --train.steps="$STEPS" --metrics.path="$m" \
      --metrics.peak_flops=1e11 $MODEL >"$WORK/log" 2>&1 || { cat "$WORK/log" >&2; exit 1; }
    tail -n +5 "$m" | grep -o '"step_ms": *[0-9.e+-]*' | awk -F: '{print $2}' | median >>"$WORK/$v-$t"
  done
done
echo "| OpenBLAS build | threads | step ms (median of $ROUNDS rounds) | runs | 2 threads / 1 thread |"
echo "| --- | ---: | ---: | --- | ---: |"
for v in openmp pthread; do
  one=$(median <"$WORK/$v-1")
  for t in 1 2; do
    ms=$(median <"$WORK/$v-$t")
    runs=$(tr '\n' ' ' <"$WORK/$v-$t" | xargs printf "%.0f, " | sed 's/, $//')
    speed=$([[ $t == 2 ]] && awk -v a="$one" -v b="$ms" 'BEGIN {printf "**%.2fx**", a / b}' || echo "")
    printf "| %s | %s | %.1f | %s | %s |\n" "$v" "$t" "$ms" "$runs" "$speed"
  done
done

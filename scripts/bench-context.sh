#!/usr/bin/env bash
# Context parallelism (bench/RESULTS.md, section 20), on examples/long.yaml's
# model (llama-tiny: 2 layers, width 64, 4 heads, 2 key/value heads, byte
# tokens), one sequence of T tokens per step, fp32, one thread per rank:
#   1. memory per rank against cp at fixed T: the trainer's end-of-run memory
#      record (measured activations and tensor peak, and what the estimator
#      predicted for the run), cp = 1, 2, 4 (ring), 2 (all_to_all), and the
#      ring composed of autograd ops (model.attention=naive) at a shorter T;
#   2. step time at the same global tokens: one rank on 1 and 2 threads, cp = 2
#      in both modes (2 ranks x 1 thread); medians of the steps after the
#      first, the variants alternating, REPEATS rounds;
#   3. bytes sent per step and rank by the ring (the comm record) against
#      the estimator's formula (estimate-memory --cp ... "cp traffic / step");
#   4. the largest T (a multiple of 1024) that fits in 20 GiB per rank:
#      naive attention, flash, flash + cp = 2, extrapolated from the tensor
#      peaks measured at shorter T.
# usage: scripts/bench-context.sh [--build DIR] [--repeats N] [--t T]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=2 T=8192
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --t) T=$2; shift 2 ;;
    *) echo "bench-context.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "build it: cmake --build $BUILD" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-context.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
source "$ROOT/scripts/bench-common.sh"

bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
"$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null
printf 'model:\n  preset: llama-tiny\ndata:\n  path: %s\ntrain:\n  steps: 4\n  global_batch: 1\n  micro_batch: 1\n  sample_tokens: 0\nparallel:\n  strategy: zero2\n' \
  "$WORK/kjv.tok" >"$WORK/long.yaml"

# "median_step_ms activations_mib tensor_peak_mib predicted_activations_mib
# predicted_total_mib cp_send_bytes_per_step" of a metrics file.
summary() {
  /usr/bin/python3 - "$1" <<'EOF'
import json, statistics, sys
steps, mem, comm = [], None, None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "step_ms" in r and r.get("step", 0) > 1:
        steps.append(r["step_ms"])
    if r.get("record") == "memory":
        mem = r
    if r.get("record") == "comm":
        comm = r
sent = 0.0
if comm:
    for rank in comm["ranks"][:1]:
        for row in rank["rows"]:
            if row["op"] == "send":  # only the ring sends here (no pipeline); with cp = world it is "world"
                sent += row["bytes"]
    sent /= comm["steps"]
m, p = mem["measured_mib"], mem["predicted_mib"]
print("%.0f %.1f %.1f %.1f %.1f %.0f" % (statistics.median(steps), m["activations"], m["tensor_peak"],
                                         p["activations"], p["total"], sent))
EOF
}

run_one() {  # nproc threads T flags...
  local nproc=$1 threads=$2 t=$3
  shift 3
  for ((try = 1; ; try++)); do
    wait_quiet
    busy_watch_start
    # shellcheck disable=SC2086
    "$ST" launch --nproc-per-node "$nproc" --threads "$threads" --master-port 30960 -- "$ST" train "$WORK/long.yaml" \
      --model.block_size="$t" "$@" --metrics.path="$WORK/m.jsonl" --metrics.progress=false >"$WORK/log" 2>&1 ||
      { cat "$WORK/log" >&2; exit 1; }
    if busy_watch_stop && ((try < 4)); then continue; fi
    break
  done
  summary "$WORK/m.jsonl"
}

echo "== 1. memory per rank against cp, T=$T (MiB: activations measured / predicted; tensor peak / predicted total)"
for v in "1 1 " "2 1 --parallel.cp=2" "4 1 --parallel.cp=4" "2 1 --parallel.cp=2 --parallel.cp_mode=all_to_all"; do
  read -r n th flags <<<"$v"
  # shellcheck disable=SC2086
  read -r ms act peak pact ptot sent <<<"$(run_one "$n" "$th" "$T" $flags)"
  echo "ranks=$n ${flags:-cp=1}: activations $act / $pact, tensor peak $peak / $ptot, step $ms ms, cp sent $sent B/step"
done
TN=$((T / 4))
for v in "1 1 " "2 1 --parallel.cp=2"; do
  read -r n th flags <<<"$v"
  # shellcheck disable=SC2086
  read -r ms act peak pact ptot sent <<<"$(run_one "$n" "$th" "$TN" --model.attention=naive $flags)"
  echo "naive T=$TN ranks=$n ${flags:-cp=1}: activations $act / $pact, tensor peak $peak / $ptot"
done

echo "== 2. step time at T=$T, same global tokens (median ms over $REPEATS rounds of steps 2..)"
variants=("1 rank x 1 thread:1 1 " "1 rank x 2 threads:1 2 " "cp=2 ring:2 1 --parallel.cp=2"
          "cp=2 all_to_all:2 1 --parallel.cp=2 --parallel.cp_mode=all_to_all")
declare -A times
for ((r = 0; r < REPEATS; r++)); do
  for v in "${variants[@]}"; do
    read -r n th flags <<<"${v#*:}"
    # shellcheck disable=SC2086
    read -r ms _ <<<"$(run_one "$n" "$th" "$T" $flags)"
    times[${v%%:*}]+="$ms "
  done
done
for v in "${variants[@]}"; do
  echo "${v%%:*}: $(tr ' ' '\n' <<<"${times[${v%%:*}]}" | sort -n | awk 'NF{a[n++]=$0} END{print a[int((n-1)/2)]}') ms"
done

echo "== 3. cp bytes per step and rank: the formula (estimate-memory, fp32)"
cat >"$WORK/config.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
 "max_position_embeddings": 1048576, "tie_word_embeddings": false}
EOF
for cp in 2 4; do
  echo "cp=$cp: $("$ST" estimate-memory "$WORK/config.json" --seq-len "$T" --cp $cp --world-size $cp --precision fp32 \
    --attention flash --zero-stage 2 --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["per_rank"]["cp_comm_bytes"])') B/step"
done

echo "== 4. the largest T that fits in 20 GiB per rank, extrapolated from measured tensor peaks"
# (no machine here holds 20 GiB per rank for 2 ranks): flash is linear in T,
# a straight line through T/2 and T; naive is quadratic, a parabola through
# T/8, T/4 and T/2.
peak() {  # nproc T flags... -> the tensor peak in MiB
  local n=$1 t=$2
  shift 2
  read -r _ _ p _ <<<"$(run_one "$n" 1 "$t" "$@")"
  echo "$p"
}
fit() {  # "T:peak ..." -> the largest T (a multiple of 1024) whose fitted peak is <= 20 GiB
  /usr/bin/python3 - "$@" <<'EOF'
import sys
import numpy as np
pts = [tuple(map(float, a.split(":"))) for a in sys.argv[1:]]
coef = np.polyfit([t for t, _ in pts], [p for _, p in pts], len(pts) - 1)
t = 1024
while np.polyval(coef, t + 1024) <= 20 * 1024:
    t += 1024
print(t, "(fit:", " ".join("%.4g" % c for c in coef) + ")")
EOF
}
n8=$((T / 8)) n4=$((T / 4)) n2=$((T / 2))
echo "naive, 1 rank: T = $(fit "$n8:$(peak 1 $n8 --model.attention=naive)" "$n4:$(peak 1 $n4 --model.attention=naive)" \
  "$n2:$(peak 1 $n2 --model.attention=naive)")"
echo "flash, 1 rank: T = $(fit "$n2:$(peak 1 $n2)" "$T:$(peak 1 "$T")")"
echo "flash + cp=2: T = $(fit "$n2:$(peak 2 $n2 --parallel.cp=2)" "$T:$(peak 2 "$T" --parallel.cp=2)")"

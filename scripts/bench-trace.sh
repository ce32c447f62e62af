#!/usr/bin/env bash
# What observing a run costs (bench/RESULTS.md section 15), with the real
# trainer on loopback, 2 ranks, one thread each, the main job's model and
# batch (examples/main.yaml):
#  cost  under each of STRATEGIES, three settings side by side, alternating
#        order, REPEATS times: the communication profile off
#        (SCALETRAIN_COMM_PROFILE=0), the default (profile on, no trace), and
#        every step traced (metrics.trace_steps covering the run); median
#        step time of each run, its first 2 steps left out.
#  picture  one traced DDP step of the main job, drawn by
#        `scaletrain plot --timeline` into bench/timeline-main-ddp.svg (and
#        the trace next to the raw lines).
#  skew  the clock alignment (Note [Trace clocks]) against a real skew: rank 1
#        runs in a Linux time namespace whose monotonic clock is 1000 s ahead
#        (`unshare --time`, root); the trace's measured offset and error bound,
#        and how far apart the two ranks' ends of each collective land on the
#        trace's axis (a collective ends at about the same moment everywhere).
# usage: scripts/bench-trace.sh [--build DIR] [--repeats K] [--steps N] [--strategies "ddp zero3"] [--out DIR]
#                               [--parts "cost picture skew"]
#                               [--picture SVG (default bench/timeline-main-ddp.svg)]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=3 STEPS=30 OUT=$ROOT/bench/results STRATEGIES="ddp zero3"
PICTURE=$ROOT/bench/timeline-main-ddp.svg PARTS="cost picture skew"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --strategies) STRATEGIES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --picture) PICTURE=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "bench-trace.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "bench-trace.sh: $ST not built (cmake --build $BUILD --target scaletrain)" >&2; exit 2; }
source "$ROOT/scripts/bench-common.sh"
WORK=$(mktemp -d /tmp/bench-trace.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
RESULTS=$OUT/trace.jsonl
[[ $PARTS == *cost* ]] && : > "$RESULTS"

TOK=$(kjv_tokens)
COMMON="$ROOT/examples/main.yaml --data.path=$TOK --train.sample_tokens=0 --metrics.log_every=1000"


port=$((29300 + RANDOM % 100))
run_one() {  # strategy setting repeat
  local strategy=$1 setting=$2 k=$3 m=$WORK/$1-$2.jsonl env=() extra=()
  case $setting in
    off) env=(SCALETRAIN_COMM_PROFILE=0) ;;
    default) ;;
    traced) extra=(--metrics.trace_steps=1,$STEPS --metrics.trace_dir="$WORK/trace-$strategy") ;;
  esac
  wait_quiet
  port=$((port + 1))
  env "${env[@]}" "$ST" launch --nproc-per-node 2 --threads 1 --master-port $port --log-dir "$WORK/logs" -- \
    "$ST" train $COMMON --train.steps=$STEPS --parallel.strategy=$strategy --metrics.path="$m" "${extra[@]}" \
    >"$WORK/run.log" 2>&1 || { tail -5 "$WORK/run.log" >&2; exit 1; }
  echo "{\"part\": \"cost\", \"strategy\": \"$strategy\", \"setting\": \"$setting\", \"repeat\": $k, \"step_ms\": $(median_step "$m")}" | tee -a "$RESULTS"
}

[[ $PARTS == *cost* ]] && for ((k = 0; k < REPEATS; k++)); do
  settings=(off default traced)
  ((k % 2)) && settings=(traced default off)
  for strategy in $STRATEGIES; do
    for s in "${settings[@]}"; do run_one "$strategy" "$s" "$k"; done
  done
done

# The picture: the main job's DDP, step 20 (buckets rebuilt, warm).
[[ $PARTS == *picture* ]] && {
wait_quiet
port=$((port + 1))
"$ST" launch --nproc-per-node 2 --threads 1 --master-port $port --log-dir "$WORK/logs" -- \
  "$ST" train $COMMON --train.steps=21 --parallel.strategy=ddp --metrics.path="$WORK/picture.jsonl" \
  --metrics.trace_steps=20 --metrics.trace_dir="$OUT/trace-main-ddp" >"$WORK/run.log" 2>&1 ||
  { tail -5 "$WORK/run.log" >&2; exit 1; }
"$ST" plot --timeline "$OUT/trace-main-ddp/trace.json" -o "$PICTURE" \
  --title "main job, DDP on 2 ranks: step 20" >/dev/null
grep -A8 "communication over" "$WORK/logs/rank0.log" | sed 's/^/  /' | tee "$OUT/trace-main-ddp/summary.txt"
}

# The skew: two ranks started by hand, rank 1 in a time namespace 1000 s ahead.
if [[ $PARTS == *skew* ]]; then
  if ! unshare --time --monotonic 1000 --fork true 2>/dev/null; then
    echo "skew: not measured (unshare --time needs root and a kernel with time namespaces)"
  else
    wait_quiet
    port=$((port + 1))
    args=(train $COMMON --train.steps=4 --parallel.strategy=ddp --metrics.path="$WORK/skew.jsonl"
          --metrics.trace_steps=2,3 --metrics.trace_dir="$WORK/skew")
    export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port SCALETRAIN_THREADS=1 OMP_NUM_THREADS=1
    RANK=0 LOCAL_RANK=0 "$ST" "${args[@]}" >"$WORK/skew0.log" 2>&1 &
    RANK=1 LOCAL_RANK=1 unshare --time --monotonic 1000 --fork "$ST" "${args[@]}" >"$WORK/skew1.log" 2>&1 ||
      { tail -5 "$WORK/skew1.log" >&2; exit 1; }
    wait $! || { tail -5 "$WORK/skew0.log" >&2; exit 1; }
    python3 - "$WORK/skew/trace.json" <<'PY' | tee -a "$OUT/trace-skew.jsonl"
import json, statistics, sys
t = json.load(open(sys.argv[1]))
ends = {}
for e in t["traceEvents"]:
    if e["ph"] == "X" and e["cat"] == "comm":
        ends.setdefault(e["args"]["seq"], {})[e["pid"]] = e["ts"] + e["dur"]
gaps = [abs(v[0] - v[1]) for v in ends.values() if len(v) == 2]
c = t["otherData"]["clocks"][1]
print(json.dumps({"part": "skew", "skew_s": 1000, "offset_us": c["offset_us"], "error_us": c["error_us"],
                  "collectives": len(gaps), "end_gap_us_median": round(statistics.median(gaps), 1),
                  "end_gap_us_max": round(max(gaps), 1)}))
PY
  fi
fi

[[ $PARTS == *cost* ]] && python3 - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for strategy in dict.fromkeys(r["strategy"] for r in rows):
    med = {s: statistics.median(r["step_ms"] for r in rows if r["strategy"] == strategy and r["setting"] == s)
           for s in ("off", "default", "traced")}
    print(f"{strategy}: step ms (median of the runs' medians) off {med['off']:.2f}, default {med['default']:.2f} "
          f"({med['default'] / med['off']:.3f}x), every step traced {med['traced']:.2f} ({med['traced'] / med['off']:.3f}x)")
EOF

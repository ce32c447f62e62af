#!/usr/bin/env bash
# The generic path's cost (bench/RESULTS.md section 16), 2 ranks, 1 thread each:
#   net-ddp   the MNIST Net under our DDP and under PyTorch's DDP (gloo),
#             alternating ours/theirs for --repeats runs of --steps steps;
#   gpt-fsdp  a GPT under FULL_SHARD through the family's block runner (zoo)
#             and through fully_shard (generic, gathered on use), alternating.
# Each run prints its median step; the table shows the median over runs.
# usage: scripts/bench-own-model.sh [--build DIR] [--repeats K] [--steps S] [--gpt "ARGS"] [--out FILE]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=5 STEPS=20 GPT="--n-layer 4 --n-embd 256 --n-head 8" OUT=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --gpt) GPT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
LAUNCH="$BUILD/scaletrain launch --nproc-per-node 2 --threads 1"
BENCH=$BUILD/bench/bench_own_model
TMP=$(mktemp)
trap 'rm -f "$TMP"' EXIT
port=31400
run() {  # run CMD...: one JSON line into $TMP
  port=$((port + 1))
  timeout 900 $LAUNCH --master-port $port -- "$@" | grep -o '{.*}' | head -1 | tee -a "$TMP"
}
for ((r = 0; r < REPEATS; r++)); do
  # Alternate which goes first, so drift hits both alike.
  if ((r % 2 == 0)); then
    run "$BENCH" --mode net-ddp --steps "$STEPS"
    run /usr/bin/python3 "$ROOT/bench/own_model/torch_net_ddp.py" --steps "$STEPS"
    run "$BENCH" --mode gpt-fsdp --path zoo --steps "$STEPS" $GPT
    run "$BENCH" --mode gpt-fsdp --path generic --steps "$STEPS" $GPT
  else
    run /usr/bin/python3 "$ROOT/bench/own_model/torch_net_ddp.py" --steps "$STEPS"
    run "$BENCH" --mode net-ddp --steps "$STEPS"
    run "$BENCH" --mode gpt-fsdp --path generic --steps "$STEPS" $GPT
    run "$BENCH" --mode gpt-fsdp --path zoo --steps "$STEPS" $GPT
  fi
done
[ -n "$OUT" ] && cp "$TMP" "$OUT"
/usr/bin/python3 - "$TMP" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def med(sel, key):
    v = [r[key] for r in rows if sel(r)]
    return statistics.median(v) if v else float("nan")
ours = med(lambda r: r["mode"] == "net-ddp" and r["impl"] == "scaletrain", "median_ms")
theirs = med(lambda r: r["mode"] == "net-ddp" and r["impl"] == "pytorch", "median_ms")
print(f"MNIST Net, DDP, 2 ranks: scaletrain {ours:.2f} ms, PyTorch {theirs:.2f} ms, ratio {ours / theirs:.3f}")
for key, unit in (("median_ms", "ms"), ("peak_rss_mb", "MiB"), ("gathers_per_step", "gathers")):
    z = med(lambda r: r.get("path") == "zoo", key)
    g = med(lambda r: r.get("path") == "generic", key)
    print(f"GPT FULL_SHARD {key}: zoo {z:.2f} {unit}, generic {g:.2f} {unit}, ratio {g / z:.3f}")
PY

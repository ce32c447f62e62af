#!/usr/bin/env bash
# Step time and peak memory of the same runs from two or more builds, side by
# side: examples/main.yaml (tiny GPT on the King James Bible, 2 processes)
# under each layout, each build in turn for ROUNDS rounds. A figure is the
# median over rounds of a run's median step_ms (steps after the 5th), and the
# largest peak_rss_mb any rank reported.
# usage: scripts/bench-builds.sh --build NAME=DIR [--build NAME=DIR ...]
#          [--layout NAME="--key=value ..." ...] [--steps N] [--rounds R] [--data TOKENS]
# Without --layout: the main job as it is (DDP).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=40 ROUNDS=3 DATA=$ROOT/data/kjv.tok
BUILDS=() LAYOUTS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILDS+=("$2"); shift 2 ;;
    --layout) LAYOUTS+=("$2"); shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    *) echo "bench-builds.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
((${#BUILDS[@]} >= 1)) || { echo "bench-builds.sh: give at least one --build NAME=DIR" >&2; exit 2; }
((${#LAYOUTS[@]} >= 1)) || LAYOUTS=("main=")
for b in "${BUILDS[@]}"; do
  [[ $b == *=* && -x ${b#*=}/scaletrain ]] || { echo "bench-builds.sh: no scaletrain in '${b#*=}' ($b)" >&2; exit 2; }
done
for l in "${LAYOUTS[@]}"; do
  [[ $l == *=* ]] || { echo "bench-builds.sh: a layout is NAME=\"overrides\", got '$l'" >&2; exit 2; }
done
[[ -s $DATA ]] || { echo "bench-builds.sh: no token file $DATA (run scripts/run-main.sh once)" >&2; exit 2; }
source "$ROOT/scripts/bench-common.sh"
WORK=$(mktemp -d /tmp/bench-builds.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
run_once() {  # dir overrides file -> "median_step_ms peak_rss_mb"
  local st=$1/scaletrain m=$3
  ST=$st wait_quiet
  # shellcheck disable=SC2086 # the overrides are words
  "$st" launch --nproc-per-node 2 --threads 1 -- "$st" train "$ROOT/examples/main.yaml" --data.path="$DATA" \
    --train.steps="$STEPS" --train.sample_tokens=0 --metrics.log_every=1 --metrics.progress=false \
    --metrics.path="$m" $2 >"$m.log" 2>&1 || { echo "bench-builds.sh: run failed: $st $2" >&2; tail -3 "$m.log" >&2; exit 1; }
  python3 - "$m" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "record" not in r and "step_ms" in r]
print(statistics.median(r["step_ms"] for r in steps if r["step"] > 5), max(r.get("peak_rss_mb", 0) for r in steps))
EOF
}
declare -A ms rss
for r in $(seq "$ROUNDS"); do
  for l in "${LAYOUTS[@]}"; do
    for b in "${BUILDS[@]}"; do
      read -r t p < <(run_once "${b#*=}" "${l#*=}" "$WORK/${b%%=*}-${l%%=*}-$r.jsonl")
      ms[${l%%=*}/${b%%=*}]+="$t "
      rss[${l%%=*}/${b%%=*}]+="$p "
    done
  done
done
echo "| layout | build | median step (ms) | peak RSS (MB) | step of each round (ms) |"
echo "| --- | --- | ---: | ---: | --- |"
for l in "${LAYOUTS[@]}"; do
  for b in "${BUILDS[@]}"; do
    k=${l%%=*}/${b%%=*}
    printf '| %s | %s | %s | %s | %s|\n' "${l%%=*}" "${b%%=*}" "$(tr ' ' '\n' <<<"${ms[$k]}" | grep . | median)" \
      "$(tr ' ' '\n' <<<"${rss[$k]}" | grep . | sort -g | tail -1)" "${ms[$k]}"
  done
done

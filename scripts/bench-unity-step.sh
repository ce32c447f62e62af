#!/usr/bin/env bash
# The main job's step time with the engine built in unity batches against
# one object per source (Note [Unity build] in CMakeLists.txt): the same
# examples/main.yaml run (DDP on 2 processes, tiny GPT on the King James
# Bible) from each build, alternating for ROUNDS rounds. Each figure is the
# median over rounds of a run's median step_ms (steps after the 5th).
# usage: scripts/bench-unity-step.sh --unity DIR --per-source DIR [--steps N] [--rounds R] [--data TOKENS]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
UNITY="" PER_SOURCE="" STEPS=40 ROUNDS=3 DATA=$ROOT/data/kjv.tok
while [[ $# -gt 0 ]]; do
  case $1 in
    --unity) UNITY=$2; shift 2 ;;
    --per-source) PER_SOURCE=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    *) echo "bench-unity-step.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for b in "$UNITY" "$PER_SOURCE"; do
  [[ -x $b/scaletrain ]] || { echo "bench-unity-step.sh: no scaletrain in '$b'" >&2; exit 2; }
done
[[ -s $DATA ]] || { echo "bench-unity-step.sh: no token file $DATA (run scripts/run-main.sh once)" >&2; exit 2; }
source "$ROOT/scripts/bench-common.sh"
WORK=$(mktemp -d /tmp/bench-unity-step.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
run_once() {  # build tag round -> the run's median step_ms
  local st=$1/scaletrain m=$WORK/$2-$3.jsonl
  ST=$st wait_quiet
  "$st" launch --nproc-per-node 2 -- "$st" train "$ROOT/examples/main.yaml" --data.path="$DATA" \
    --train.steps="$STEPS" --train.sample_tokens=0 --metrics.log_every=1 --metrics.progress=false \
    --metrics.path="$m" >/dev/null 2>&1
  python3 -c 'import json,sys; print("\n".join(str(j["step_ms"]) for j in map(json.loads, open(sys.argv[1])) if "record" not in j and j["step"] > 5))' "$m" | median
}
declare -A all
for r in $(seq "$ROUNDS"); do
  for tag in unity per_source; do
    dir=$UNITY; [[ $tag == per_source ]] && dir=$PER_SOURCE
    all[$tag]+="$(run_once "$dir" "$tag" "$r") "
  done
done
echo "| build | median step (ms) | runs |"
echo "| --- | ---: | --- |"
for tag in unity per_source; do
  printf '| %s | %s | %s|\n' "$tag" "$(tr ' ' '\n' <<<"${all[$tag]}" | grep . | median)" "${all[$tag]}"
done

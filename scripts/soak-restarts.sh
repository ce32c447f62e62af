#!/usr/bin/env bash
# Soak test of restarts (not in CI). Trains the main job's model for about
# DURATION seconds on NPROC local ranks under `scaletrain launch
# --max-restarts`, killing a random worker with SIGKILL every KILL_MIN to
# KILL_MAX seconds; then trains the same steps once without interruption and
# checks that the two final checkpoints hold the same parameters bit for bit.
# Prints: failures injected, restarts, steps trained twice (lost beyond the
# last checkpoint) and, per failure, the time from the kill to the first step
# of the restarted group.
#
#   scripts/soak-restarts.sh [--build DIR]
#   DURATION=600 KILL_MIN=60 KILL_MAX=90 NPROC=2 EVERY=10 (defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build
[[ ${1:-} == --build ]] && BUILD=$2
ST=$PWD/$BUILD/scaletrain
DURATION=${DURATION:-600}
KILL_MIN=${KILL_MIN:-60}
KILL_MAX=${KILL_MAX:-90}
NPROC=${NPROC:-2}
EVERY=${EVERY:-10}   # checkpoint every EVERY steps
PORT=${PORT:-29890}
work=$(mktemp -d /tmp/st_soak.XXXXXX)
mkdir -p data
if [ ! -s data/kjv.tok ]; then
  bible "gen1:1-rev22:21" > data/kjv.txt
  "$ST" prepare data/kjv.txt -o data/kjv.tok
fi
common="examples/main.yaml --train.sample_tokens=0 --metrics.log_every=1 --metrics.progress=false"

# Steps that take about DURATION seconds uninterrupted, from a short calibration run.
"$ST" launch --nproc-per-node "$NPROC" --master-port "$PORT" -- "$ST" train $common --train.steps=30 \
  --metrics.path="$work/cal.jsonl" > "$work/cal.log" 2>&1
step_ms=$(python3 -c "
import json,statistics,sys
ms=[json.loads(l)['step_ms'] for l in open('$work/cal.jsonl') if 'record' not in l]
print(statistics.median(ms[5:]))")
STEPS=$(python3 -c "print(max(50, int($DURATION * 1000 / $step_ms)))")
echo "soak: $STEPS steps (median step $step_ms ms), checkpoint every $EVERY, kills every $KILL_MIN-$KILL_MAX s"

# The interrupted run: every attempt adds to one metrics file, each after a
# {"record": "restart"} line.
train="$ST train $common --train.steps=$STEPS --checkpoint.every=$EVERY --checkpoint.keep=2 --checkpoint.dir=$work/soak"
"$ST" launch --nproc-per-node "$NPROC" --master-port "$PORT" --max-restarts 1000 -- \
  $train --metrics.path="$work/soak.jsonl" > "$work/soak.log" 2>&1 &
launcher=$!
t_start=$(date +%s.%N)
kills=()      # wall time of each kill
attempt=0
while kill -0 "$launcher" 2>/dev/null; do
  wait_s=$((KILL_MIN + RANDOM % (KILL_MAX - KILL_MIN + 1)))
  for ((i = 0; i < wait_s * 10; i++)); do
    kill -0 "$launcher" 2>/dev/null || break 2
    sleep 0.1
  done
  mapfile -t workers < <(pgrep -P "$launcher" || true)
  ((${#workers[@]} == 0)) && continue
  victim=${workers[RANDOM % ${#workers[@]}]}
  kill -9 "$victim" 2>/dev/null || continue
  kills+=("$(date +%s.%N)")
  attempt=$((attempt + 1))
  echo "soak: killed pid $victim ($(printf '%.0f' "$(echo "$(date +%s.%N) - $t_start" | bc)") s in); waiting for attempt $attempt"
  # Recovery: until the next attempt has logged its first step (a step line after its restart record).
  until python3 -c "
import json, sys
seen = False
for l in open('$work/soak.jsonl'):
    j = json.loads(l)
    if j.get('record') == 'restart' and j.get('attempt') == $attempt: seen = True
    elif seen and 'record' not in j: sys.exit(0)
sys.exit(1)" 2>/dev/null || ! kill -0 "$launcher" 2>/dev/null; do sleep 0.1; done
  recovered=$(date +%s.%N)
  echo "soak: attempt $attempt stepped $(echo "$recovered - ${kills[-1]}" | bc) s after the kill"
  echo "$(echo "$recovered - ${kills[-1]}" | bc)" >> "$work/recovery.txt"
done
wait "$launcher" && code=0 || code=$?
t_soak=$(echo "$(date +%s.%N) - $t_start" | bc)
echo "soak: launcher exited $code after $t_soak s"

# The uninterrupted run of the same steps.
t0=$(date +%s.%N)
"$ST" launch --nproc-per-node "$NPROC" --master-port "$PORT" -- "$ST" train $common --train.steps="$STEPS" \
  --checkpoint.every="$STEPS" --checkpoint.dir="$work/whole" --metrics.path="$work/whole.jsonl" > "$work/whole.log" 2>&1
t_whole=$(echo "$(date +%s.%N) - $t0" | bc)
"$ST" checkpoint consolidate "$work/soak" -o "$work/soak.safetensors" > /dev/null
"$ST" checkpoint consolidate "$work/whole" -o "$work/whole.safetensors" > /dev/null
if cmp -s "$work/soak.safetensors" "$work/whole.safetensors"; then same="bit for bit equal"; else same="DIFFERENT"; fi

python3 - "$work" "$attempt" "$STEPS" "$t_soak" "$t_whole" "$same" <<'EOF'
import json, os, statistics, sys
work, attempts, steps, t_soak, t_whole, same = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
# One file: the steps of each attempt, split at its restart records.
runs, restarts = [[]], []
for l in open(f"{work}/soak.jsonl"):
    j = json.loads(l)
    if j.get("record") == "restart":
        runs.append([])
        restarts.append(j)
    elif "record" not in j:
        runs[-1].append(j["step"])
lost = 0
for a in range(len(runs) - 1):
    if runs[a] and runs[a + 1]:
        lost += runs[a][-1] - (runs[a + 1][0] - 1)
steps_logged = sorted(set(s for r in runs for s in r))
print(f"metrics file: {len(restarts)} restart records, steps 1-{steps} all logged: {steps_logged == list(range(1, steps + 1))}")
if restarts:
    print(f"first restart record: {json.dumps(restarts[0])}")
rec = [float(x) for x in open(f"{work}/recovery.txt")] if os.path.exists(f"{work}/recovery.txt") else []
print(f"failures injected: {attempts}; restarts: {attempts}; steps: {steps}; steps trained twice: {lost}")
if rec:
    print(f"kill to first new step: median {statistics.median(rec):.2f} s, max {max(rec):.2f} s (n={len(rec)})")
print(f"wall time: interrupted {t_soak:.0f} s, uninterrupted {t_whole:.0f} s "
      f"({(t_soak - t_whole) / max(attempts, 1):.1f} s lost per failure)")
print(f"final parameters: {same}")
EOF
echo "work directory: $work"
[[ $same == "bit for bit equal" ]]

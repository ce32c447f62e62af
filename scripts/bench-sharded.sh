#!/usr/bin/env bash
# Step time and per-rank memory of every data-parallel strategy, same GPT,
# same global batch, in one run: DDP, ZeRO-1/2/3, FSDP FULL_SHARD with
# prefetch on and off, SHARD_GRAD_OP, and HYBRID_SHARD (4 ranks as 2 x 2).
# Links: loopback (ranks started by `scaletrain launch`) and, for 2 ranks,
# two network namespaces joined by a shaped veth pair (needs root; see
# netns_setup in bench-common.sh). Every run is the real trainer; the table
# shows medians over the steps after the first two, model-state bytes per
# rank at the end of training next to the ZeRO formula (fp32: 4 bytes of
# parameter, 4 of gradient, 8 of Adam state per element), peak RSS of rank 0,
# and the RSS growth while the model was built and wrapped.
#
# usage: scripts/bench-sharded.sh [--build DIR] [--data TOKENS] [--steps S] [--worlds 2,4]
#                                 [--links loopback,netem] [--rate MBIT] [--delay MS] [--out FILE]
#                                 [--cases ddp,zero1,zero2]  (names before the first space; default all)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build-bench DATA="" STEPS=12 WORLDS=2,4 LINKS=loopback,netem RATE=1000 DELAY=1 OUT="" ONLY=""
MODEL="--model.n_layer=6 --model.n_embd=384 --model.n_head=6 --model.block_size=128"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --worlds) WORLDS=$2; shift 2 ;;
    --links) LINKS=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --cases) ONLY=,$2,; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "bench-sharded.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "bench-sharded.sh: $ST not built (cmake --build $BUILD --target scaletrain)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/bench-sharded.XXXXXX)
source "$ROOT/scripts/bench-common.sh"
trap 'netns_cleanup; rm -rf "$WORK"; [[ -n ${BUSY_PID:-} ]] && kill "$BUSY_PID" 2>/dev/null; true' EXIT
trap 'exit 130' INT TERM
if [[ -z $DATA ]]; then
  bible "gen1:1-rev22:21" >"$WORK/kjv.txt"
  "$ST" prepare "$WORK/kjv.txt" -o "$WORK/kjv.tok" >/dev/null
  DATA=$WORK/kjv.tok
fi
OUT=${OUT:-$WORK/results.md}
PORT=$((29600 + RANDOM % 50))
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
field() { tail -n +3 "$1" | grep -o "\"$2\": *[0-9.e+-]*" | awk -F: '{print $2}' | median; }

CASES=(
  "ddp|--parallel.strategy=ddp"
  "zero1|--parallel.strategy=zero1"
  "zero2|--parallel.strategy=zero2"
  "zero3|--parallel.strategy=zero3"
  "FULL_SHARD prefetch|--parallel.strategy=fsdp --parallel.fsdp.backward_prefetch=BACKWARD_PRE --parallel.fsdp.forward_prefetch=true"
  "FULL_SHARD no prefetch|--parallel.strategy=fsdp --parallel.fsdp.backward_prefetch=NONE --parallel.fsdp.forward_prefetch=false"
  "SHARD_GRAD_OP|--parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=SHARD_GRAD_OP"
  "HYBRID_SHARD 2x2|--parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=HYBRID_SHARD --parallel.dp_replicate=2"
)

# formula STRATEGY PSI N: model-state bytes per rank (fp32 analogues of the ZeRO paper's).
formula() {
  awk -v s="$1" -v p="$2" -v n="$3" 'BEGIN {
    if (s == "ddp") b = 16 * p; else if (s == "zero1") b = 8 * p + 8 * p / n;
    else if (s == "zero2") b = 4 * p + 12 * p / n; else if (s ~ /^HYBRID/) b = 16 * p / (n / 2);
    else b = 16 * p / n;
    printf "%.1f", b / 1048576 }'
}

# run LINK WORLD NAME FLAGS: one training run; prints a table row.
run() {
  local link=$1 world=$2 name=$3 flags=$4 log=$WORK/log m=$WORK/m.jsonl
  local micro=$((16 / world))
  local args="train $ROOT/bench/train-throughput.yaml --data.path=$DATA --train.steps=$STEPS --train.global_batch=16
    --train.micro_batch=$micro --train.sample_tokens=0 --metrics.path=$m --metrics.peak_flops=1e11 $MODEL $flags"
  rm -f "$m"
  PORT=$((PORT + 1))
  if [[ $link == loopback ]]; then
    timeout 900 "$ST" launch --nproc-per-node "$world" --threads 1 --master-port $PORT -- "$ST" $args >"$log" 2>&1 ||
      { cat "$log" >&2; return 1; }
  else
    local common="WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=$IP0 MASTER_PORT=$PORT OMP_NUM_THREADS=1 SCALETRAIN_THREADS=1"
    ip netns exec $NS1 env $common RANK=1 GLOO_SOCKET_IFNAME=$IF1 timeout 900 "$ST" $args >"$WORK/log1" 2>&1 &
    local pid1=$!
    ip netns exec $NS0 env $common RANK=0 GLOO_SOCKET_IFNAME=$IF0 timeout 900 "$ST" $args >"$log" 2>&1 ||
      { cat "$log" >&2; return 1; }
    wait $pid1 || { cat "$WORK/log1" >&2; return 1; }
  fi
  local psi states setup
  psi=$(grep -o '[0-9]* parameters' "$log" | head -1 | cut -d' ' -f1)
  states=$(grep -o 'model states at the end [0-9.]*' "$log" | awk '{print $NF}')
  setup=$(grep -o 'setup peak +[0-9.]*' "$log" | head -1 | tr -d '+' | awk '{print $NF}')
  local f
  f=$(formula "${name%% *}" "$psi" "$world")
  printf "| %s | %d | %s | %.1f | %.1f | %.1f / %.1f (%.3f) | %.0f | %.1f |\n" "$link" "$world" "$name" \
    "$(field "$m" step_ms)" "$(field "$m" comm_wait_ms)" "$states" "$f" "$(awk -v a="$states" -v b="$f" 'BEGIN {print a / b}')" \
    "$(tail -1 "$m" | grep -o '"peak_rss_mb": *[0-9.]*' | awk -F: '{print $2}')" "$setup"
}

{
  echo "| link | ranks | strategy | step ms (median) | comm wait ms | model states MiB/rank: measured / formula (ratio) | peak RSS MiB | setup +MiB |"
  echo "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |"
} | tee "$OUT"
IFS=, read -r -a links <<<"$LINKS"
IFS=, read -r -a worlds <<<"$WORLDS"
for link in "${links[@]}"; do
  [[ $link == netem ]] && netns_setup
  for world in "${worlds[@]}"; do
    [[ $link == netem && $world != 2 ]] && continue
    for c in "${CASES[@]}"; do
      name=${c%%|*} flags=${c#*|}
      [[ $name == HYBRID* && $world != 4 ]] && continue
      [[ -n $ONLY && $ONLY != *",${name%% *},"* ]] && continue
      for try in 1 2 3 4 5; do  # a run disturbed by a compiler is done again
        wait_quiet
        busy_watch_start
        row=$(run "$link" "$world" "$name" "$flags") || exit 1
        if busy_watch_stop && ((try < 5)); then echo "bench-sharded.sh: disturbed; again" >&2; continue; fi
        break
      done
      echo "$row" | tee -a "$OUT"
    done
  done
  [[ $link == netem ]] && netns_cleanup
done
echo
echo "model: $MODEL, global batch 16, $STEPS steps, 1 thread per rank; shaped link: ${SHAPER:-not used}"

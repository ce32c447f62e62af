#!/usr/bin/env bash
# Mixture-of-Experts benchmarks (bench/RESULTS.md section 13), with the real
# trainer on loopback, one thread per rank:
#  step  a small Mixtral-style model (models/moe.h) on 2 ranks, the same
#        global batch, experts replicated (parallel.ep=1) and split over the
#        2 ranks (parallel.ep=2: tokens move by all_to_all), under each of
#        STRATEGIES (ddp; zero3 shards the rest, Note [Experts in the sharded
#        engine]); median step time of each run (its first 2 steps left out)
#        and each rank's model states; the layouts alternate, REPEATS times.
#  route a longer single-process run with and without the load-balancing
#        loss; the slots each expert took per step, drawn by `scaletrain plot`
#        (SVG next to the raw lines).
# usage: scripts/bench-moe.sh [--build DIR] [--repeats K] [--steps N] [--strategies "ddp zero3"]
#                             [--route-steps N (0: no route part)] [--out DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build REPEATS=3 STEPS=12 ROUTE_STEPS=300 OUT=$ROOT/bench/results STRATEGIES="ddp zero3"
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --route-steps) ROUTE_STEPS=$2; shift 2 ;;
    --strategies) STRATEGIES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "bench-moe.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ST=$BUILD/scaletrain
[[ -x $ST ]] || { echo "bench-moe.sh: $ST not built (cmake --build $BUILD --target scaletrain)" >&2; exit 2; }
source "$ROOT/scripts/bench-common.sh"
WORK=$(mktemp -d /tmp/bench-moe.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
RESULTS=$OUT/moe.jsonl
: > "$RESULTS"

TOK=$(kjv_tokens)
# 4 layers x 256, 8 experts of width 512, top 2: 13.8M parameters, 4.3M used per token.
MODEL="--model.preset=mixtral-tiny --model.n_layer=4 --model.n_embd=256 --model.n_head=4 --model.n_kv_head=4 \
--model.intermediate_size=512 --model.num_local_experts=8 --model.block_size=128"
COMMON="$ROOT/examples/main.yaml --data.path=$TOK $MODEL --train.sample_tokens=0 --metrics.log_every=1000"


port=$((29400 + RANDOM % 100))
for ((k = 0; k < REPEATS; k++)); do
  degrees=(1 2)
  ((k % 2)) && degrees=(2 1)
  for strategy in $STRATEGIES; do
    for ep in "${degrees[@]}"; do
      wait_quiet
      m=$WORK/step-$strategy-ep$ep.jsonl
      port=$((port + 1))
      "$ST" launch --nproc-per-node 2 --threads 1 --master-port $port --log-dir "$WORK/logs" -- \
        "$ST" train $COMMON --train.steps=$STEPS --train.global_batch=16 --train.micro_batch=8 --parallel.ep=$ep \
        --parallel.strategy=$strategy --metrics.path="$m" >"$WORK/step.log" 2>&1 ||
        { tail -5 "$WORK/step.log" >&2; exit 1; }
      states=$(sed -n 's/.*model states at the end \([0-9.]*\) MiB\/rank.*/\1/p' "$WORK/logs/rank0.log" | tail -1)
      echo "{\"part\": \"step\", \"strategy\": \"$strategy\", \"ep\": $ep, \"repeat\": $k, \"step_ms\": $(median_step "$m"), \"states_mib\": $states}" | tee -a "$RESULTS"
    done
  done
done

((ROUTE_STEPS > 0)) && for coef in 0 0.02; do
  wait_quiet
  m=$OUT/moe-route-aux$coef.jsonl
  SCALETRAIN_THREADS=1 OMP_NUM_THREADS=1 WORLD_SIZE=1 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$((port + 10)) "$ST" train $COMMON --train.steps=$ROUTE_STEPS --train.global_batch=16 \
    --train.micro_batch=16 --model.router_aux_loss_coef=$coef --metrics.path="$m" >"$WORK/route.log" 2>&1 ||
    { tail -5 "$WORK/route.log" >&2; exit 1; }
  "$ST" plot "$m" -o "$OUT/moe-route-aux$coef.svg" --title "Tokens per expert, router_aux_loss_coef $coef" >/dev/null
done

python3 - "$RESULTS" "$OUT" "$ROUTE_STEPS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| strategy | experts | step ms (median) | vs ep 1 | model states MiB/rank |")
print("| --- | --- | ---: | ---: | ---: |")
for strategy in dict.fromkeys(r["strategy"] for r in rows):
    base = statistics.median(r["step_ms"] for r in rows if r["ep"] == 1 and r["strategy"] == strategy)
    for ep in (1, 2):
        rs = [r for r in rows if r["ep"] == ep and r["strategy"] == strategy]
        t = statistics.median(r["step_ms"] for r in rs)
        print(f"| {strategy} | ep {ep} | {t:.1f} | {t / base:.3f}x | {rs[0]['states_mib']} |")
for coef in ("0", "0.02") if int(sys.argv[3]) > 0 else ():
    steps = [json.loads(l) for l in open(f"{sys.argv[2]}/moe-route-aux{coef}.jsonl") if "record" not in l]
    tail = steps[-50:]
    imb = statistics.mean(max(s["moe_tokens_per_expert"]) / (sum(s["moe_tokens_per_expert"]) / len(s["moe_tokens_per_expert"])) for s in tail)
    aux = statistics.mean(s["moe_aux_loss"] for s in tail)
    print(f"aux coef {coef}: last 50 steps, busiest expert / mean {imb:.3f}, aux loss {aux:.4f}, final loss {steps[-1]['loss']:.4f}")
PY

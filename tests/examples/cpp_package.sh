#!/usr/bin/env bash
# The installed package as a user meets it: installs the build into a fresh
# prefix, checks that no installed header includes one that was not
# installed, builds examples/cpp out of tree against the prefix with
# find_package(scaletrain), and runs each program on 2 processes with the
# installed CLI, twice: in float64 (no argument), then with --float32. Each
# program checks itself against one process (to 1e-10 in float64, to 1e-5 in
# float32).
# Usage: cpp_package.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -euo pipefail
src=$1 build=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null

# Every "scaletrain/..." include of an installed header must be installed too.
missing=0
while IFS= read -r -d '' header; do
  while IFS= read -r inc; do
    if [ ! -f "$prefix/include/$inc" ]; then
      echo "installed ${header#"$prefix"/} includes $inc, which is not installed" >&2
      missing=1
    fi
  done < <(sed -n 's/^#include "\(scaletrain\/[^"]*\)".*/\1/p' "$header")
done < <(find "$prefix/include/scaletrain" -name '*.h' -print0)
[ "$missing" = 0 ] || exit 1
test -f "$prefix/lib/cmake/scaletrain/scaletrainConfig.cmake"

# The optional component this build has (rpc) is found by name; one that
# does not exist is refused.
mkdir -p "$work/components"
printf '%s\n' 'cmake_minimum_required(VERSION 3.18)' 'project(components CXX)' \
  'find_package(scaletrain CONFIG REQUIRED COMPONENTS ${WANTED})' >"$work/components/CMakeLists.txt"
cmake -S "$work/components" -B "$work/components/ok" -DCMAKE_PREFIX_PATH="$prefix" -DWANTED=rpc >/dev/null
if cmake -S "$work/components" -B "$work/components/bad" -DCMAKE_PREFIX_PATH="$prefix" -DWANTED=nccl \
  >/dev/null 2>&1; then
  echo "find_package(scaletrain COMPONENTS nccl) succeeded, but there is no such component" >&2
  exit 1
fi

# Out of tree: the consumer sees only the prefix.
cmake -S "$src/examples/cpp" -B "$work/examples" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/examples" -j2 >/dev/null
for example in toy_ddp mnist resnet_fsdp resnet_pipeline tensor_parallel lstm_lm; do
  for flag in "" --float32; do
    echo "== $example ${flag:-(float64)} on 2 processes"
    "$prefix/bin/scaletrain" launch --nproc-per-node 2 --threads 1 --timeout 240 \
      -- "$work/examples/$example" ${flag:+"$flag"}
  done
done

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
# At -O1, as the test binaries build (tests/CMakeLists.txt: a test file builds
# in about two thirds of the time), and GCC's -O levels do not change
# floating-point results without -ffast-math.
cmake -S "$src/examples/cpp" -B "$work/examples" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" >/dev/null
cmake --build "$work/examples" -j2 >/dev/null
for example in toy_ddp mnist resnet_fsdp resnet_pipeline tensor_parallel lstm_lm; do
  for flag in "" --float32; do
    echo "== $example ${flag:-(float64)} on 2 processes"
    "$prefix/bin/scaletrain" launch --nproc-per-node 2 --threads 1 --timeout 240 \
      -- "$work/examples/$example" ${flag:+"$flag"}
  done
done

# The CLI trains a module library (examples/cpp/module_library.cpp): one
# process, then 2 under DDP and under FULL_SHARD (the library's units), each
# step's loss the same to 1e-10 in float64; what it cannot train is refused.
lib=$work/examples/libmodule_library.so
st=$prefix/bin/scaletrain
train_lib() {  # NPROC NAME [overrides...]
  local n=$1 name=$2
  shift 2
  echo "== module library, $name, on $n process(es)"
  "$st" launch --nproc-per-node "$n" --threads 1 --timeout 240 -- "$st" train "$src/examples/cpp/module_library.yaml" \
    --model.library="$lib" --model.library_args=float64 --metrics.path="$work/lib_$name.jsonl" "$@"
}
train_lib 1 one
train_lib 2 ddp
train_lib 2 full_shard --parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=FULL_SHARD
/usr/bin/python3 - "$work" <<'PY'
import json, sys
def losses(name):
    return [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/lib_{name}.jsonl")]
one = losses("one")
assert len(one) == 20 and one[-1] < 0.6 * one[0], one
for name in ("ddp", "full_shard"):
    got = losses(name)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, one))
    assert len(got) == len(one) and worst < 1e-10, (name, worst)
    print(f"module library {name}: {len(got)} steps, largest relative difference from one process {worst:.1e}")
PY
refused() {  # EXPECTED-TEXT ARGS...: exit 2 and one line naming the problem
  local want=$1 out rc=0
  shift
  out=$("$st" train "$src/examples/cpp/module_library.yaml" "$@" 2>&1) || rc=$?
  if [ "$rc" != 2 ] || ! grep -qF -- "$want" <<<"$out"; then
    echo "expected exit 2 and '$want', got $rc: $out" >&2
    exit 1
  fi
}
refused "model.library: no file $work/none.so" --model.library="$work/none.so"
refused "exports no scaletrain_module_task_v1" --model.library="$prefix/lib/libscaletrain_core.so"
refused "model.preset=gpt2 would have no effect" --model.library="$lib" --model.preset=gpt2
# fp16 is accepted from the keys, but this module computes on the CPU, which has no fp16 matmul.
refused "needs the module on a CUDA device" --model.library="$lib" --precision.mode=fp16
echo "module library: refusals named"

#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU and PyTorch 2.x
# (python3 -c 'import torch' works) but no package registry:
#
#   scripts/gpu-carry.sh                        # here, on a Debian machine: makes carry/
#   scripts/check-gpu.sh                        # there, with carry/ next to the sources
#
# Stages (each records a JSON line in $OUT/check-gpu.jsonl, or
# build-gpu/out/ without $OUT, and the run goes on after a failed stage):
#   env       the GPU, PyTorch and CUDA versions, libtorch's C++ ABI
#   deps      yaml-cpp, PCRE2, utf8proc, zlib, zstd, GoogleTest from carry/src,
#             built with libtorch's ABI flag into build-gpu/deps; the built
#             prefix comes back as deps-prefix.tgz, and a later run that finds
#             it in carry/ skips this stage
#   build     scaletrain (library and CLI) against the PyTorch 2.x libtorch
#             (CUDA + NCCL), keeping going past a failing file: build-errors.txt
#             then lists every compiler error at once
#   parity    per-step losses of a tiny GPT: 1 rank on NCCL (world 1) is the
#             reference; DDP and ZeRO-3 with 2 ranks sharing cuda:0 over Gloo
#             (NCCL refuses two ranks on one GPU), and ZeRO-3 with parameter
#             and optimizer offload, must follow it within PARITY_TOL
#   fp8       the same tiny GPT in bf16 with FP8 linears (emulated, Note [FP8
#             linears]) against bf16 alone: finite, within FP8_TOL
#   mfu       GPT-2 124M, bf16 autocast, sequence 1024, one GPU: tokens/s and
#             MFU against the dense bf16 peak PEAK_FLOPS (H100/H200 SXM: 989e12)
#   tests     the unit tests' binaries, then the unit tests (the trainer's runs
#             take train.device auto = cuda) for what is left of BUDGET
#
# Options through the environment: DEVICE (cuda; cpu runs the parity and mfu
# stages' logic on a CPU build), BUILD (an existing build dir: skips deps and
# build), PARITY_TOL (1e-4), FP8_TOL (0.05), PEAK_FLOPS (989e12), MFU_STEPS
# (30), MFU_MICRO (16), BUDGET (seconds the whole check may take; stages that
# would not fit are left out; 0: no limit), TESTS (0 leaves the tests stage out).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/build-gpu/out}
logs=$root/build-gpu/logs
mkdir -p "$out" "$logs"
jsonl=$out/check-gpu.jsonl
: > "$jsonl"
DEVICE=${DEVICE:-cuda}
PARITY_TOL=${PARITY_TOL:-1e-4}
FP8_TOL=${FP8_TOL:-0.05}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}
MFU_STEPS=${MFU_STEPS:-30}
MFU_MICRO=${MFU_MICRO:-16}
BUDGET=${BUDGET:-0}
TESTS=${TESTS:-1}
jobs=$(nproc)
PY=${PYTHON:-python3}
start=$(date +%s)
keep_going=(-k)  # make's; ninja's is -k 0
# record STAGE OK JSON-FIELDS...: one line {"stage":..., "ok":..., ...}.
record() {
  local stage=$1 ok=$2
  shift 2
  "$PY" - "$stage" "$ok" "$@" >> "$jsonl" <<'PYEOF'
import json, sys
stage, ok, *kv = sys.argv[1:]
d = {"stage": stage, "ok": ok == "1"}
for item in kv:
    k, _, v = item.partition("=")
    try:
        d[k] = json.loads(v)
    except ValueError:
        d[k] = v
print(json.dumps(d))
PYEOF
  echo "check-gpu: $stage: $([ "$ok" = 1 ] && echo ok || echo FAILED) $*"
}


elapsed() { echo $(($(date +%s) - start)); }
# Seconds left of BUDGET (a large number without one).
left() { if [ "$BUDGET" -gt 0 ]; then echo $((BUDGET - $(elapsed))); else echo 100000; fi; }

# The summary table, the logs as one archive, then exit.
finish() {
  tar -czf "$out/logs.tgz" -C "$root/build-gpu" logs work 2> /dev/null
  echo
  echo "check-gpu: results ($jsonl), after $(elapsed) s"
  "$PY" - "$jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    rest = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("stage", "ok"))
    print(f"| {d['stage']:<18} | {'ok' if d['ok'] else 'FAILED':<6} | {rest} |")
PYEOF
  exit "$1"
}

# A failed run's first fatal line (else its last), quoted for record().
first_error() {
  { grep -m1 -E 'fatal|error' "$1" || tail -1 "$1"; } | tr '"\\' "' "
}

# The compiler's errors in a build log, each once, with the line that follows
# each (the context g++ prints).
compile_errors() {
  grep -E -A2 '^FAILED:|: error:|: fatal error:|undefined reference|CMake Error' "$1" | grep -v '^--$' | head -600
}

build_deps() {  # DEPS-DIR PREFIX: the compiled libraries, from carry/src
  local deps=$1 prefix=$2 ok=0
  mkdir -p "$prefix"
  cp -r carry/prefix/. "$prefix/"
  # Gloo's headers only where the wheel has none (its own must win if it ships them).
  if [ "$(get has_gloo_headers)" = 1 ]; then rm -rf "$prefix/include/gloo"; fi
  build_dep() {  # NAME SOURCE-DIR CMAKE-ARGS...
    local name=$1 src=$2
    shift 2
    cmake -S "$src" -B "$deps/build-$name" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" \
      -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
      -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_CXX_FLAGS="$flags" -DBUILD_SHARED_LIBS=OFF "$@" \
      > "$logs/dep-$name.log" 2>&1 &&
      cmake --build "$deps/build-$name" -j"$jobs" >> "$logs/dep-$name.log" 2>&1 &&
      cmake --install "$deps/build-$name" >> "$logs/dep-$name.log" 2>&1
  }
  for t in carry/src/*.orig.tar.*; do tar -xf "$t" -C "$deps"; done
  src_of() { find "$deps" -maxdepth 1 -type d -iname "$1*" | head -1; }
  # Debian's zlib tarball drops win32/, whose resource file zlib's CMake lists anyway.
  mkdir -p "$(src_of zlib)/win32" && touch "$(src_of zlib)/win32/zlib1.rc"
  build_dep zlib "$(src_of zlib)" || ok=1
  build_dep yaml-cpp "$(src_of yaml-cpp)" -DYAML_CPP_BUILD_TESTS=OFF -DYAML_CPP_BUILD_TOOLS=OFF || ok=1
  build_dep pcre2 "$(src_of pcre2)" -DPCRE2_BUILD_PCRE2_8=ON -DPCRE2_SUPPORT_JIT=ON -DPCRE2_BUILD_TESTS=OFF \
    -DPCRE2_BUILD_PCRE2GREP=OFF || ok=1
  build_dep utf8proc "$(src_of utf8proc)" -DUTF8PROC_ENABLE_TESTING=OFF || ok=1
  build_dep zstd "$(src_of zstd)/build/cmake" -DZSTD_BUILD_PROGRAMS=OFF -DZSTD_BUILD_SHARED=OFF \
    -DZSTD_BUILD_STATIC=ON -DZSTD_BUILD_TESTS=OFF || ok=1
  build_dep googletest carry/src/googletest || ok=1
  # utf8proc's CMake build may not install its pkg-config file.
  for libdir in "$prefix/lib" "$prefix/lib64"; do
    if [ -e "$libdir/libutf8proc.a" ] && [ ! -e "$libdir/pkgconfig/libutf8proc.pc" ]; then
      mkdir -p "$libdir/pkgconfig"
      printf 'prefix=%s\nName: libutf8proc\nDescription: utf8proc\nVersion: 2\nCflags: -I%s/include\nLibs: -L%s -lutf8proc\n' \
        "$prefix" "$prefix" "$libdir" > "$libdir/pkgconfig/libutf8proc.pc"
    fi
  done
  return $ok
}

# --- env ---
info=$("$PY" - <<'PYEOF'
import json, torch
d = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
     "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI), "prefix": torch.utils.cmake_prefix_path,
     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
try:
    import nvidia.nccl, os
    d["nccl_include"] = os.path.join(list(nvidia.nccl.__path__)[0], "include")
except Exception:
    d["nccl_include"] = ""
try:
    d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:
    d["nccl"] = "none"
d["has_gloo_headers"] = int(__import__("os").path.isdir(__import__("os").path.join(torch.utils.cmake_prefix_path, "..", "..", "include", "gloo")))
print(json.dumps(d))
PYEOF
)
get() { "$PY" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$info" "$1"; }
abi=$(get abi)
# PyTorch's CUDA CMake config needs a CUDA toolkit (nvcc) no older than torch's CUDA.
cuda_home=${CUDA_HOME:-/usr/local/cuda}
# Without /usr/local/cuda, the toolkit of the nvcc on PATH.
if [ ! -x "$cuda_home/bin/nvcc" ] && command -v nvcc > /dev/null; then
  cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
export PATH="$cuda_home/bin:$PATH"
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
# The nccl.h we compile against must be the NCCL torch runs.
nccl_header=""
if [ -f "$(get nccl_include)/nccl.h" ]; then
  nccl_header=$(awk '/#define NCCL_MAJOR/{a=$3} /#define NCCL_MINOR/{b=$3} /#define NCCL_PATCH/{c=$3} END{print a"."b"."c}' \
    "$(get nccl_include)/nccl.h")
fi
env_ok=1
[ -n "$nvcc_version" ] || env_ok=0
[ "$DEVICE" = cpu ] && env_ok=1
record env "$env_ok" "torch=\"$(get torch)\"" "cuda=\"$(get cuda)\"" "nvcc=\"${nvcc_version:-none}\"" \
  "gpu=\"$(get gpu)\"" "gpus=$(get gpus)" "abi=$abi" "nccl=\"$(get nccl)\"" "nccl_header=\"${nccl_header:-none}\"" \
  "pkg_config=$(command -v pkg-config >/dev/null && echo 1 || echo 0)"
if [ "$env_ok" = 0 ] && [ -z "${BUILD:-}" ]; then
  echo "check-gpu: no nvcc under $cuda_home/bin or on PATH: PyTorch's CUDA CMake config needs a CUDA toolkit (set CUDA_HOME)"
  finish 1
fi
flags="-D_GLIBCXX_USE_CXX11_ABI=$abi"

if [ -z "${BUILD:-}" ]; then
  # --- deps: carry/ from scripts/gpu-carry.sh, or the prefix an earlier run saved ---
  deps=$root/build-gpu/deps
  prefix=$deps/prefix
  deps_ok=1
  if [ -f carry/deps-prefix.tgz ]; then
    mkdir -p "$deps" && tar -xzf carry/deps-prefix.tgz -C "$deps"
    record deps 1 "prefix=\"$prefix\"" "from=\"carry/deps-prefix.tgz\""
  elif [ ! -d carry/src ]; then
    record deps 0 'error="carry/ is missing: run scripts/gpu-carry.sh on a Debian machine and carry it"'
    deps_ok=0
  else
    build_deps "$deps" "$prefix" || deps_ok=0
    record deps "$deps_ok" "prefix=\"$prefix\"" "seconds=$(elapsed)"
    # The built prefix comes back, to be carried next time (carry/deps-prefix.tgz).
    [ "$deps_ok" = 1 ] && tar -czf "$out/deps-prefix.tgz" -C "$deps" prefix
  fi

  # --- build: the library and CLI first, every failing file at once (keep going) ---
  BUILD=$root/build-gpu/build
  export PKG_CONFIG_PATH="$prefix/lib/pkgconfig:$prefix/lib64/pkgconfig:${PKG_CONFIG_PATH:-}"
  cuda_root=()
  [ -n "$nvcc_version" ] && cuda_root=(-DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
  generator=()
  keep_going=(-k)
  if command -v ninja > /dev/null; then generator=(-G Ninja); keep_going=(-k 0); fi
  t0=$(date +%s)
  if cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(get prefix);$prefix" \
       -DCMAKE_CXX_FLAGS="$flags -I$prefix/include" -DSCALETRAIN_BUILD_BENCH=OFF -DSCALETRAIN_RPC=OFF -DSCALETRAIN_CLANG_TIDY=OFF \
       -DSCALETRAIN_NCCL_INCLUDE_DIR="$(get nccl_include)" "${cuda_root[@]}" > "$logs/configure.log" 2>&1 &&
     cmake --build "$BUILD" -j"$jobs" --target scaletrain -- "${keep_going[@]}" > "$logs/build.log" 2>&1; then
    record build 1 "seconds=$(($(date +%s) - t0))" \
      "cuda_path=$(grep -c 'with CUDA: building the CUDA device path' "$logs/configure.log")"
  else
    record build 0 "seconds=$(($(date +%s) - t0))" "failed_files=$(grep -c '^FAILED:' "$logs/build.log")" \
      "log=\"$(tail -c 400 "$logs/configure.log" 2>/dev/null | tr '\n"\\' '   ')\""
    compile_errors "$logs/build.log" > "$out/build-errors.txt"
    tail -c 20000 "$logs/configure.log" > "$out/configure-tail.log"
    echo "check-gpu: the build failed; see $out/build-errors.txt"
    # The tests' files too, for what BUDGET leaves: their errors at once as well.
    if [ -d "$BUILD/CMakeFiles" ] && [ "$(left)" -gt 90 ]; then
      secs=$(($(left) - 40))
      [ "$secs" -gt "${TESTS_COMPILE_MAX:-120}" ] && secs=${TESTS_COMPILE_MAX:-120}
      timeout "$secs" cmake --build "$BUILD" -j"$jobs" --target st_unit st_unit_core st_dist -- \
        "${keep_going[@]}" > "$logs/build-tests.log" 2>&1
      compile_errors "$logs/build-tests.log" > "$out/build-tests-errors.txt"
    fi
    finish 1
  fi
fi
ST=$BUILD/scaletrain

# --- parity: a tiny GPT on a byte-level token file of this repository's text ---
work=$root/build-gpu/work/parity
rm -rf "$work" && mkdir -p "$work"
cat README.md src/scaletrain/*/*.h > "$work/corpus.txt"
"$ST" prepare "$work/corpus.txt" -o "$work/corpus.tok" > "$work/prepare.log" 2>&1
dev0=$DEVICE
[ "$DEVICE" = cuda ] && dev0=cuda:0
common=(examples/main.yaml --data.path="$work/corpus.tok" --model.preset=tiny --train.steps=12 --train.global_batch=8
        --train.micro_batch=4 --train.sample_tokens=0 --metrics.log_every=1 --metrics.progress=false
        --train.warmup_steps=2 --train.lr=1e-3)
run() {  # NAME NPROC ARGS...: per-step losses in $work/NAME.jsonl
  local name=$1 n=$2
  shift 2
  "$ST" launch --nproc-per-node "$n" --master-port $((29600 + RANDOM % 200)) -- "$ST" train "${common[@]}" \
    --metrics.path="$work/$name.jsonl" "$@" > "$work/$name.log" 2>&1
}
compare() {  # NAME [BASE]: max relative loss difference to BASE (reference), or the failure
  "$PY" - "$work/${2:-reference}.jsonl" "$work/$1.jsonl" <<'PYEOF'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if '"record"' not in l]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
if len(a) != len(b) or not a:
    print("nan"); sys.exit()
print(max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)))
PYEOF
}
backend=nccl
[ "$DEVICE" = cpu ] && backend=gloo
if run reference 1 --train.device="$dev0" --parallel.backend="$backend"; then
  record parity_reference 1 "device=\"$dev0\"" "backend=\"$backend\""
  scratch=$(mktemp -d)
  for spec in "ddp|--parallel.strategy=ddp" "zero3|--parallel.strategy=zero3" \
              "zero3_offload|--parallel.strategy=zero3 --parallel.zero.offload_param=cpu --parallel.zero.offload_optimizer=cpu" \
              "zero3_nvme|--parallel.strategy=zero3 --parallel.zero.offload_param=nvme --parallel.zero.offload_optimizer=nvme --parallel.zero.offload_dir=$scratch"; do
    name=${spec%%|*}
    read -r -a extra <<< "${spec#*|}"
    if run "$name" 2 --train.device="$dev0" --parallel.backend=gloo "${extra[@]}"; then
      d=$(compare "$name")
      ok=$("$PY" -c "import sys; print(int(float(sys.argv[1]) <= float(sys.argv[2])))" "$d" "$PARITY_TOL")
      record "parity_$name" "$ok" "max_rel_loss_diff=$d" "tol=$PARITY_TOL" "ranks=2" "backend=\"gloo\""
    else
      record "parity_$name" 0 "error=\"$(first_error "$work/$name.log")\""
    fi
  done
  rm -rf "$scratch"
else
  record parity_reference 0 "error=\"$(first_error "$work/reference.log")\""
fi

# --- fp8: FP8 linears (emulated) on the device against bf16 alone ---
if [ -f "$work/corpus.tok" ] && [ "$(left)" -gt 60 ]; then
  if run bf16 1 --train.device="$dev0" --parallel.backend="$backend" --precision.mode=bf16 &&
     run fp8 1 --train.device="$dev0" --parallel.backend="$backend" --precision.mode=bf16 --precision.fp8=true; then
    d=$(compare fp8 bf16)
    ok=$("$PY" -c "import sys; print(int(float(sys.argv[1]) <= float(sys.argv[2])))" "$d" "$FP8_TOL")
    record fp8 "$ok" "max_rel_loss_diff_to_bf16=$d" "tol=$FP8_TOL" "device=\"$dev0\""
  else
    record fp8 0 "error=\"$(first_error "$work/bf16.log") $(first_error "$work/fp8.log" 2> /dev/null)\""
  fi
fi

# --- mfu: GPT-2 124M, bf16, sequence 1024, one GPU ---
mfu=$root/build-gpu/work/mfu
rm -rf "$mfu" && mkdir -p "$mfu"
mfu_seq=1024
[ "$DEVICE" = cpu ] && mfu_seq=64  # the logic only, on a CPU
if [ "$(left)" -lt 90 ]; then
  record mfu 0 'error="skipped: less than 90 s of BUDGET left"'
elif "$ST" train examples/main.yaml --data.path="$work/corpus.tok" --model.preset=gpt2 --model.vocab_size=50304 \
     --model.block_size=$mfu_seq --precision.mode=bf16 --train.device="$dev0" --train.steps="$MFU_STEPS" \
     --train.global_batch="$MFU_MICRO" --train.micro_batch="$MFU_MICRO" --train.sample_tokens=0 \
     --metrics.peak_flops="$PEAK_FLOPS" --metrics.log_every=1 --metrics.progress=false \
     --metrics.path="$mfu/metrics.jsonl" > "$mfu/train.log" 2>&1; then
  read -r tps mfu_med alloc <<< "$("$PY" - "$mfu/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"record"' not in l]
rows = rows[5:]  # warm-up steps left out
print(statistics.median(r["tokens_per_s"] for r in rows), statistics.median(r["mfu"] for r in rows),
      max(r.get("device_max_allocated_mb", -1) for r in rows))
PYEOF
)"
  record mfu 1 "model=\"gpt2 124M\"" "seq=$mfu_seq" "micro_batch=$MFU_MICRO" "tokens_per_s=$tps" "mfu=$mfu_med" \
    "peak_flops=$PEAK_FLOPS" "device_max_allocated_mb=$alloc"
else
  record mfu 0 "error=\"$(first_error "$mfu/train.log")\""
fi


# --- tests: the unit tests' binaries, then as many unit tests as BUDGET leaves time for ---
if [ "$TESTS" = 1 ] && [ -d "$BUILD/CMakeFiles" ] && [ "$(left)" -gt 150 ]; then
  t0=$(date +%s)
  if timeout $(($(left) - 60)) cmake --build "$BUILD" -j"$jobs" --target st_unit st_unit_core st_dist -- \
       "${keep_going[@]}" > "$logs/build-tests.log" 2>&1; then
    record build_tests 1 "seconds=$(($(date +%s) - t0))"
    if [ "$(left)" -gt 45 ]; then
      timeout $(($(left) - 25)) ctest --test-dir "$BUILD" -L unit -j"$jobs" --timeout 300 --output-on-failure > "$logs/unit.log" 2>&1
      passed=$(grep -c ' Passed ' "$logs/unit.log")
      failed=$(grep -E '\*\*\*Failed|\*\*\*Timeout|\*\*\*Exception| Failed ' "$logs/unit.log" | sed 's/.*Test *#[0-9]*: //' |
        tr '\n"' ';\047' | head -c 3000)
      total=$(grep -m1 -oE '[0-9]+/[0-9]+ Test' "$logs/unit.log" | cut -d/ -f2 | cut -d' ' -f1)
      record unit "$([ -z "$failed" ] && grep -q '100% tests passed' "$logs/unit.log" && echo 1 || echo 0)" \
        "passed=$passed" "of=${total:-0}" "failed=\"$failed\"" "summary=\"$(grep -E 'tests passed' "$logs/unit.log")\""
    fi
  else
    record build_tests 0 "seconds=$(($(date +%s) - t0))" "failed_files=$(grep -c '^FAILED:' "$logs/build-tests.log")"
    compile_errors "$logs/build-tests.log" > "$out/build-tests-errors.txt"
  fi
fi
finish 0

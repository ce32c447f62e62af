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
#   deps      yaml-cpp, PCRE2, utf8proc, zlib, GoogleTest from carry/src,
#             built with libtorch's ABI flag into build-gpu/deps
#   build     scaletrain against the PyTorch 2.x libtorch (CUDA + NCCL)
#   unit      the unit tests (the trainer's runs take train.device auto = cuda)
#   parity    per-step losses of a tiny GPT: 1 rank on NCCL (world 1) is the
#             reference; DDP and ZeRO-3 with 2 ranks sharing cuda:0 over Gloo
#             (NCCL refuses two ranks on one GPU), and ZeRO-3 with parameter
#             and optimizer offload, must follow it within PARITY_TOL
#   mfu       GPT-2 124M, bf16 autocast, sequence 1024, one GPU: tokens/s and
#             MFU against the dense bf16 peak PEAK_FLOPS (H100/H200 SXM: 989e12)
#
# Options through the environment: DEVICE (cuda; cpu runs the parity and mfu
# stages' logic on a CPU build), BUILD (an existing build dir: skips deps and
# build), PARITY_TOL (1e-4), PEAK_FLOPS (989e12), MFU_STEPS (30), MFU_MICRO (16).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/build-gpu/out}
mkdir -p "$out"
jsonl=$out/check-gpu.jsonl
: > "$jsonl"
DEVICE=${DEVICE:-cuda}
PARITY_TOL=${PARITY_TOL:-1e-4}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}
MFU_STEPS=${MFU_STEPS:-30}
MFU_MICRO=${MFU_MICRO:-16}
jobs=$(nproc)
PY=${PYTHON:-python3}

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
  exit 1
fi
flags="-D_GLIBCXX_USE_CXX11_ABI=$abi"

if [ -z "${BUILD:-}" ]; then
  # --- deps: carry/ from scripts/gpu-carry.sh ---
  deps=$root/build-gpu/deps
  prefix=$deps/prefix
  deps_ok=1
  if [ ! -d carry/src ]; then
    record deps 0 'error="carry/ is missing: run scripts/gpu-carry.sh on a Debian machine and carry it"'
    deps_ok=0
  else
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
        > "$deps/$name.log" 2>&1 &&
        cmake --build "$deps/build-$name" -j"$jobs" >> "$deps/$name.log" 2>&1 &&
        cmake --install "$deps/build-$name" >> "$deps/$name.log" 2>&1
    }
    for t in carry/src/*.orig.tar.*; do tar -xf "$t" -C "$deps"; done
    src_of() { find "$deps" -maxdepth 1 -type d -iname "$1*" | head -1; }
    build_dep zlib "$(src_of zlib)" || deps_ok=0
    build_dep yaml-cpp "$(src_of yaml-cpp)" -DYAML_CPP_BUILD_TESTS=OFF -DYAML_CPP_BUILD_TOOLS=OFF || deps_ok=0
    build_dep pcre2 "$(src_of pcre2)" -DPCRE2_BUILD_PCRE2_8=ON -DPCRE2_SUPPORT_JIT=ON -DPCRE2_BUILD_TESTS=OFF \
      -DPCRE2_BUILD_PCRE2GREP=OFF || deps_ok=0
    build_dep utf8proc "$(src_of utf8proc)" -DUTF8PROC_ENABLE_TESTING=OFF || deps_ok=0
    build_dep googletest carry/src/googletest || deps_ok=0
    # utf8proc's CMake build may not install its pkg-config file.
    for libdir in "$prefix/lib" "$prefix/lib64"; do
      if [ -e "$libdir/libutf8proc.a" ] && [ ! -e "$libdir/pkgconfig/libutf8proc.pc" ]; then
        mkdir -p "$libdir/pkgconfig"
        printf 'prefix=%s\nName: libutf8proc\nDescription: utf8proc\nVersion: 2\nCflags: -I%s/include\nLibs: -L%s -lutf8proc\n' \
          "$prefix" "$prefix" "$libdir" > "$libdir/pkgconfig/libutf8proc.pc"
      fi
    done
    record deps "$deps_ok" "prefix=\"$prefix\""
  fi

  # --- build ---
  BUILD=$root/build-gpu/build
  export PKG_CONFIG_PATH="$prefix/lib/pkgconfig:$prefix/lib64/pkgconfig:${PKG_CONFIG_PATH:-}"
  cuda_root=()
  [ -n "$nvcc_version" ] && cuda_root=(-DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
  t0=$(date +%s)
  if cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(get prefix);$prefix" \
       -DCMAKE_CXX_FLAGS="$flags -I$prefix/include" -DSCALETRAIN_BUILD_BENCH=OFF -DSCALETRAIN_RPC=OFF \
       -DSCALETRAIN_NCCL_INCLUDE_DIR="$(get nccl_include)" "${cuda_root[@]}" > "$out/configure.log" 2>&1 &&
     cmake --build "$BUILD" -j"$jobs" --target scaletrain st_unit st_dist > "$out/build.log" 2>&1; then
    record build 1 "seconds=$(($(date +%s) - t0))" \
      "cuda_path=$(grep -c 'with CUDA: building the CUDA device path' "$out/configure.log")"
  else
    record build 0 "seconds=$(($(date +%s) - t0))" "log=\"$(tail -c 600 "$out/build.log" "$out/configure.log" 2>/dev/null |
      tr '\n"\\' '   ')\""
    echo "check-gpu: the build failed; see $out/configure.log and $out/build.log"
    exit 1
  fi
  # --- unit ---
  ctest --test-dir "$BUILD" -L unit -j"$jobs" --timeout 600 > "$out/unit.log" 2>&1
  summary=$(grep -E 'tests passed|tests failed' "$out/unit.log" | tail -1)
  failed=$(grep -E '^\s+[0-9]+ - ' "$out/unit.log" | sed 's/^ *//' | tr '\n"' ';\047' | head -c 3000)
  record unit "$(grep -q '100% tests passed' "$out/unit.log" && echo 1 || echo 0)" "summary=\"$summary\"" \
    "failed=\"$failed\""
fi
ST=$BUILD/scaletrain

# --- parity: a tiny GPT on a byte-level token file of this repository's text ---
work=$out/parity
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
compare() {  # NAME: max relative loss difference to the reference, or the failure
  "$PY" - "$work/reference.jsonl" "$work/$1.jsonl" <<'PYEOF'
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
      record "parity_$name" 0 "error=\"$(tail -1 "$work/$name.log" | tr '"' "'")\""
    fi
  done
  rm -rf "$scratch"
else
  record parity_reference 0 "error=\"$(tail -1 "$work/reference.log" | tr '"' "'")\""
fi

# --- mfu: GPT-2 124M, bf16, sequence 1024, one GPU ---
mfu=$out/mfu
rm -rf "$mfu" && mkdir -p "$mfu"
mfu_seq=1024
[ "$DEVICE" = cpu ] && mfu_seq=64  # the logic only, on a CPU
if "$ST" train examples/main.yaml --data.path="$work/corpus.tok" --model.preset=gpt2 --model.vocab_size=50304 \
     --model.block_size=$mfu_seq --precision.mode=bf16 --train.device="$dev0" --train.steps="$MFU_STEPS" \
     --train.global_batch="$MFU_MICRO" --train.micro_batch="$MFU_MICRO" --train.sample_tokens=0 \
     --metrics.peak_flops="$PEAK_FLOPS" --metrics.log_every=5 --metrics.progress=false \
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
  record mfu 0 "error=\"$(tail -1 "$mfu/train.log" | tr '"' "'")\""
fi

echo
echo "check-gpu: results ($jsonl)"
"$PY" - "$jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    rest = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("stage", "ok"))
    print(f"| {d['stage']:<18} | {'ok' if d['ok'] else 'FAILED':<6} | {rest} |")
PYEOF

"""PyTorch 1.13 peer of bench_attention.cpp: the plain attention written in
Python (q @ k^T, scale, causal mask, softmax, @ v) on the same shapes
(B=1, H=8, D=64, causal, fp32), forward + backward from a random gradient of
the output, median of a few runs after one warm-up.

    /usr/bin/python3 bench/attention_torch.py [--max-t 8192] [--threads 1,2] [--max-gib 12] [--no-mem]

Threads: torch.set_num_threads(n) and OpenBLAS's own thread count (through
ctypes, when the BLAS is OpenBLAS), like the C++ bench. Memory: VmHWM - VmRSS
of a fresh child process per T (this script run with --mem-child T), the
high-water mark reset just before forward + backward; the alloc column of
the C++ bench has no peer here and prints "-". The flash columns are "-":
PyTorch 1.13 has no fused attention on the CPU.
"""
import argparse
import ctypes
import math
import statistics
import subprocess
import sys
import time

import torch

B, H, D = 1, 8, 64


def set_threads(n):
    torch.set_num_threads(n)
    try:
        ctypes.CDLL("libopenblas.so.0").openblas_set_num_threads(n)
    except (OSError, AttributeError):
        pass


def attention(q, k, v):
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def inputs(T):
    return [torch.randn(B, H, T, D) for _ in range(4)]  # q, k, v, grad of out


def step(q, k, v, gout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v)
    torch.autograd.grad(out, (q, k, v), gout)


def median_ms(args, reps):
    step(*args)  # warm-up
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(*args)
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def mem_child(T):
    set_threads(1)
    step(*inputs(64))
    args = inputs(T)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = status_kib("VmRSS")
    step(*args)
    print("MEM", (status_kib("VmHWM") - rss0) * 1024)


def measure_in_child(T):
    r = subprocess.run([sys.executable, __file__, "--mem-child", str(T)], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("MEM "):
            return int(line.split()[1]) / 2**20
    return -1.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-t", type=int, default=8192)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--max-gib", type=float, default=12)
    p.add_argument("--no-mem", action="store_true")
    p.add_argument("--mem-child", type=int, default=0)
    a = p.parse_args()
    if a.mem_child:
        return mem_child(a.mem_child)
    torch.manual_seed(0)
    print(f"torch {torch.__version__} B={B} H={H} D={D} causal fp32; ms: median fwd+bwd; MiB: hwm, 1 thread")
    print(f"{'T':>6} {'threads':>7} {'naive ms':>10} {'flash ms':>10} {'speedup':>8} {'naive MiB a/hwm':>17} "
          f"{'flash MiB a/hwm':>17}")
    T = 512
    while T <= a.max_t:
        if 5.0 * B * H * T * T * 4 / 2**30 > a.max_gib:
            break
        mib = -1.0 if a.no_mem else measure_in_child(T)
        args = inputs(T)
        for n in (int(x) for x in a.threads.split(",")):
            set_threads(n)
            ms = median_ms(args, 5 if T <= 1024 else 3 if T <= 4096 else 1)
            mem = f"{'-':>8}/{mib:<8.1f}" if mib >= 0 else f"{'-':>8}/{'-':<8}"
            print(f"{T:>6} {n:>7} {ms:>10.1f} {'-':>10} {'-':>8} {mem} {'-':>8}/{'-':<8}", flush=True)
        T *= 2


if __name__ == "__main__":
    main()

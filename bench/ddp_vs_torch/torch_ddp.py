#!/usr/bin/python3
"""PyTorch's own DDP on gloo: the peer of bench_ddp.cpp, same phases, same JSON.

The GPT below mirrors scaletrain's models/gpt.cpp layer for layer (names,
registration order, shapes): token + position embeddings, pre-LayerNorm
blocks (causal self-attention by matmul + mask + softmax, GELU-tanh MLP),
final LayerNorm, output head tied to the token embedding, no dropout. The
parameter count is printed in the JSON so scripts/bench-ddp.sh can check
that both sides built the same model.

Phases (taking turns for --rounds rounds, slowest rank's time per step,
medians): comp = forward+backward+AdamW on a plain copy (no DDP); comm = the
all-reduces of DDP's buckets alone (sizes read from DDP's logging data);
ddp = forward+backward+AdamW under torch.nn.parallel.DistributedDataParallel.

Run: build/scaletrain launch --nproc-per-node 2 --threads 1 -- /usr/bin/python3 bench/ddp_vs_torch/torch_ddp.py
(environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; optional
GLOO_SOCKET_IFNAME, SCALETRAIN_THREADS / OMP_NUM_THREADS).
"""
import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {"tiny": dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)}


class CausalSelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_attn = nn.Linear(c["n_embd"], 3 * c["n_embd"])
        self.c_proj = nn.Linear(c["n_embd"], c["n_embd"])
        self.n_head, self.n_embd = c["n_head"], c["n_embd"]
        # A plain tensor, not a buffer (scaletrain's mask is not one either).
        self.mask = torch.ones(c["block_size"], c["block_size"], dtype=torch.bool).tril()

    def forward(self, x):
        B, T, _ = x.shape
        hs = self.n_embd // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, 2)
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.mask[:T, :T].logical_not(), float("-inf"))
        att = torch.softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(B, T, self.n_embd)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c["n_embd"], 4 * c["n_embd"])
        self.c_proj = nn.Linear(4 * c["n_embd"], c["n_embd"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"], eps=1e-5)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"], eps=1e-5)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["block_size"], c["n_embd"])
        self.h = nn.ModuleList([Block(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["n_embd"])
        with torch.no_grad():  # GPT-2 initialisation, as in gpt.cpp
            for name, p in self.named_parameters():
                if "ln_" in name:
                    continue
                if name.endswith(".bias"):
                    p.zero_()
                elif "c_proj.weight" in name:
                    p.normal_(0.0, 0.02 / math.sqrt(2.0 * c["n_layer"]))
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = torch.matmul(x, self.wte.weight.t())  # tied head
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def make_optimizer(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-4, betas=(0.9, 0.95), eps=1e-8)


def bucket_sizes(ddp, model, first_mb, cap_mb):
    """Bucket sizes in elements, in DDP's order: from the reducer (after its
    rebuild), else recomputed the way DDP's first assignment does it."""
    try:
        return [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except Exception:
        pass
    sizes, cur, cap = [], 0, first_mb * 2**20
    for p in reversed(list(model.parameters())):
        if cur and cur * 4 >= cap:
            sizes.append(cur)
            cur, cap = 0, cap_mb * 2**20
        cur += p.numel()
    return sizes + [cur]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--n-head", type=int, default=0)
    ap.add_argument("--n-embd", type=int, default=0)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--first-bucket-mb", type=float, default=1)
    ap.add_argument("--phases", default="comp,comm,ddp")
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()

    threads = 1
    for var in ("SCALETRAIN_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            threads = int(os.environ[var])
            break
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()

    c = dict(PRESETS[a.preset])
    for k in ("n_layer", "n_head", "n_embd"):
        if getattr(a, k):
            c[k] = getattr(a, k)
    T = a.seq or c["block_size"]
    assert a.global_batch % n == 0, "global batch must divide by the world size"
    B = a.global_batch // n

    torch.manual_seed(1234)
    plain = GPT(c)
    torch.manual_seed(1234)
    model = GPT(c)
    if hasattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES"):
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(a.first_bucket_mb * 2**20)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt_plain, opt_ddp = make_optimizer(plain), make_optimizer(ddp)

    torch.manual_seed(99 + rank)
    xs, ys = [], []
    for _ in range(4):
        tok = torch.randint(c["vocab_size"], (B, T + 1), dtype=torch.long)
        xs.append(tok[:, :T].contiguous())
        ys.append(tok[:, 1:].contiguous())

    parts = {"fwd": [], "bwd": [], "opt": []}  # rank 0's split of a compute-only step

    def train_step(m, opt, i, split=False):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = m(xs[i % len(xs)], ys[i % len(ys)])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        if split:
            parts["fwd"].append((t1 - t0) * 1e3)
            parts["bwd"].append((t2 - t1) * 1e3)
            parts["opt"].append((time.perf_counter() - t2) * 1e3)

    buckets = None

    def comm_step():
        with torch.no_grad():
            works = []
            for b in buckets:
                b.div_(n)
                works.append(dist.all_reduce(b, async_op=True))
            for w in works:
                w.wait()

    phases = [p for p in a.phases.split(",") if p]
    if "comm" in phases:  # DDP rebuilds its buckets in the second step's forward
        for i in range(2):
            train_step(ddp, opt_ddp, i)
        buckets = [torch.randn(k) for k in bucket_sizes(ddp, model, a.first_bucket_mb, a.bucket_mb)]
    times = {p: [] for p in phases}
    for r in range(a.rounds):
        for pi in range(len(phases)):
            ph = phases[(pi + r) % len(phases)]
            warm = a.warmup if r == 0 else 1
            local = []
            for i in range(warm + a.steps):
                dist.barrier()
                t0 = time.perf_counter()
                if ph == "comp":
                    train_step(plain, opt_plain, i, i >= warm)
                elif ph == "ddp":
                    train_step(ddp, opt_ddp, i)
                elif ph == "comm":
                    comm_step()
                else:
                    raise SystemExit(f"torch_ddp.py: unknown phase {ph!r}")
                ms = (time.perf_counter() - t0) * 1000.0
                if i >= warm:
                    local.append(ms)
            t = torch.tensor(local, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[ph] += t.tolist()

    if rank == 0:
        med = lambda k: statistics.median(times[k]) if times.get(k) else 0.0
        comp, comm, step = med("comp"), med("comm"), med("ddp")
        eff = (comp + comm - step) / min(comp, comm) if comp > 0 and comm > 0 and step > 0 else -1
        out = dict(impl="pytorch", world=n, threads=torch.get_num_threads(),
                   params=sum(p.numel() for p in model.parameters()), global_batch=a.global_batch, seq=T,
                   buckets=len(buckets) if buckets else 0, step_ms=round(step, 3), comp_ms=round(comp, 3),
                   comm_ms=round(comm, 3), comm_wait_ms=-1, overlap_eff=round(eff, 3),
                   tokens_per_s=round(a.global_batch * T / (step / 1000.0), 1) if step else 0,
                   steps_timed=len(times.get("ddp", [])),
                   **{f"comp_{k}_ms": round(statistics.median(v), 3) if v else 0.0 for k, v in parts.items()})
        print(json.dumps(out), flush=True)
        if a.table:
            print(f"T_step {step:.1f} ms, T_comp {comp:.1f} ms (fwd {out['comp_fwd_ms']:.1f}, bwd {out['comp_bwd_ms']:.1f}, "
                  f"opt {out['comp_opt_ms']:.1f}), T_comm {comm:.1f} ms, overlap efficiency {eff:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

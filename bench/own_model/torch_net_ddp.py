#!/usr/bin/env python3
"""The peer of bench_own_model --mode net-ddp: the MNIST Net of
pytorch/examples under PyTorch's own DistributedDataParallel (gloo), same
batch, same optimizer, same timing (slowest rank, median of the timed steps).
Started by `scaletrain launch`, which sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Prints one JSON line on rank 0."""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, 5)
        self.conv2 = nn.Conv2d(10, 20, 5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        x = F.dropout(x, 0.5, self.training)
        return F.log_softmax(self.fc2(x), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(max(threads, 1))
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    net = Net()
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.5)
    local = a.global_batch // n
    x, y = torch.randn(local, 1, 28, 28), torch.randint(10, (local,))
    times = []
    for s in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.nll_loss(ddp(x), y).backward()
        opt.step()
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if s >= a.warmup:
            times.append(ms.item())
    if rank == 0:
        print(json.dumps({"impl": "pytorch", "mode": "net-ddp", "ranks": n, "global_batch": a.global_batch,
                          "median_ms": round(statistics.median(times), 3), "steps": len(times)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

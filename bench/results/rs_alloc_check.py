#!/usr/bin/python3
"""Check of the reduce_scatter gap in bench/RESULTS.md: all_to_all + sum of a
64 MiB buffer on gloo, with the receive buffer reused vs allocated per call.
Run: build-bench/scaletrain launch --nproc-per-node 2 --threads 1 -- /usr/bin/python3 bench/results/rs_alloc_check.py"""
import time, torch, torch.distributed as dist, statistics
torch.set_num_threads(1); dist.init_process_group("gloo"); n=dist.get_world_size()
N=16*2**20; full=torch.randn(N); out=torch.empty(N); k=N//n; shard=torch.empty(k)
def reuse():
    dist.all_to_all_single(out, full); shard.copy_(out.view(n,k).sum(0))
def fresh():
    o=torch.empty(N); dist.all_to_all_single(o, full); shard.copy_(o.view(n,k).sum(0))
def fresh_sumout():
    o=torch.empty(N); dist.all_to_all_single(o, full); torch.sum(o.view(n,k), 0, out=shard)
res={}
for r in range(5):
    for name,f in [("reuse",reuse),("fresh",fresh),("fresh_sumout",fresh_sumout)]:
        dist.barrier(); t=time.perf_counter()
        for i in range(3): f()
        res.setdefault(name,[]).append((time.perf_counter()-t)/3*1e3)
if dist.get_rank()==0:
    for k_,v in res.items(): print(k_, "%.1f ms"%statistics.median(v))

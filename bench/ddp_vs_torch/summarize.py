#!/usr/bin/python3
"""Markdown table from the JSON lines of scripts/bench-ddp.sh (median over runs)."""
import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cells = defaultdict(list)
for r in rows:
    cells[(r["link"], r["config"], r["impl"])].append(r)

params = {r["impl"]: r["params"] for r in rows}
if len(set(params.values())) > 1:
    print(f"WARNING: parameter counts differ: {params}")
else:
    print(f"parameters: {next(iter(params.values()), 0)} on both sides")

print()
print("| link | buckets | impl | runs | T_step ms | T_comp ms | T_comm ms | comm_wait ms | comm/comp | overlap eff | tokens/s | step vs PyTorch |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
seen = []
for (link, cfg, impl) in cells:
    if (link, cfg) not in seen:
        seen.append((link, cfg))
for link, cfg in seen:
    med = {}
    for impl in ("scaletrain", "pytorch"):
        rs = cells.get((link, cfg, impl), [])
        if not rs:
            continue
        m = {k: statistics.median(r[k] for r in rs) for k in
             ("step_ms", "comp_ms", "comm_ms", "comm_wait_ms", "overlap_eff", "tokens_per_s", "buckets")}
        m["runs"] = len(rs)
        med[impl] = m
    for impl, m in med.items():
        vs = ""
        if "pytorch" in med and impl == "scaletrain":
            vs = f"{m['step_ms'] / med['pytorch']['step_ms']:.3f}x"
        wait = f"{m['comm_wait_ms']:.1f}" if m["comm_wait_ms"] >= 0 else "-"
        print(f"| {link} | {cfg} ({int(m['buckets'])}) | {impl} | {m['runs']} | {m['step_ms']:.1f} | {m['comp_ms']:.1f} | "
              f"{m['comm_ms']:.1f} | {wait} | {m['comm_ms'] / m['comp_ms']:.2f} | {m['overlap_eff']:.2f} | "
              f"{m['tokens_per_s']:.0f} | {vs} |")

# Ours only: where T_step - T_comp goes. CPU is rank 0's process CPU time per
# step (all threads, and the kernel's work charged to it).
ours = [(link, cfg) for link, cfg in seen if any("ddp_cpu_ms" in r for r in cells.get((link, cfg, "scaletrain"), []))]
if ours:
    print()
    print("| link | buckets | backward ms, compute / DDP | comm_wait ms | CPU ms per step, compute / DDP / all-reduces alone "
          "| DDP CPU beyond compute, share of T_comm |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for link, cfg in ours:
        rs = [r for r in cells[(link, cfg, "scaletrain")] if "ddp_cpu_ms" in r]
        m = {k: statistics.median(r[k] for r in rs) for k in
             ("comp_bwd_ms", "ddp_bwd_ms", "comm_wait_ms", "comp_cpu_ms", "ddp_cpu_ms", "comm_cpu_ms", "comm_ms",
              "buckets")}
        extra = m["ddp_cpu_ms"] - m["comp_cpu_ms"]
        print(f"| {link} | {cfg} ({int(m['buckets'])}) | {m['comp_bwd_ms']:.0f} / {m['ddp_bwd_ms']:.0f} | "
              f"{m['comm_wait_ms']:.1f} | {m['comp_cpu_ms']:.0f} / {m['ddp_cpu_ms']:.0f} / {m['comm_cpu_ms']:.0f} | "
              f"{extra:.0f} ms, {extra / m['comm_ms']:.2f} |")

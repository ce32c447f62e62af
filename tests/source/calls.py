#!/usr/bin/env python3
"""No two source files of the libraries call each other, checked on the build.

Each object file of scaletrain_core and scaletrain_lib (the current ones, from
compile_commands.json) calls another when it leaves undefined a symbol of
ours that the other defines (`nm`; weak definitions, which inline code and
templates leave in every object, do not count). A cycle in that graph is two
or more files that can only be understood together: it fails the check,
naming the files and one call each way.

Some files are the pieces of one unit, split for length and sharing an
internal header; GROUPS lists them with the reason. A cycle must lie inside
one group. A group whose files no longer call each other in a cycle must be
removed from GROUPS, so the list only shrinks. Usage: calls.py BUILD_DIR.
"""
import json
import os
import shlex
import subprocess
import sys

# files (relative to src/scaletrain, no extension) that are one unit: why.
GROUPS = {
    frozenset({"parallel/fsdp/fsdp", "parallel/fsdp/fsdp_init", "parallel/fsdp/fully_shard"}):
        "the sharded engine's class, in three files around parallel/fsdp/engine_state.h",
    frozenset({"launch/launcher", "launch/launcher_spawn", "launch/launcher_supervise"}):
        "the launcher, split along launcher_internal.h (spawning, supervision, the entry point)",
    frozenset({"template/filters", "template/ops", "template/predicates"}):
        "the chat-template interpreter's built-ins, which call each other as Jinja's do",
    frozenset({"rpc/agent", "rpc/rpc", "rpc/dist_autograd"}):
        "the RPC agent delivers distributed autograd's messages, which are RPCs",
    frozenset({"comm/rendezvous_store", "comm/rendezvous_server"}):
        "the store's client runs its own server on rank 0 and shares its file handles",
}


def objects(build):
    """(source relative to src/scaletrain without extension, object path) of both libraries."""
    out = []
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    for e in entries:
        args = shlex.split(e["command"])
        obj = args[args.index("-o") + 1] if "-o" in args else ""
        if not any(t in obj for t in ("/scaletrain_core.dir/", "/scaletrain_lib.dir/")):
            continue
        src = e["file"].split("src/scaletrain/", 1)
        if len(src) != 2:
            continue
        out.append((os.path.splitext(src[1])[0], os.path.join(e["directory"], obj)))
    return out


def symbols(obj, defined):
    args = ["nm", "-C", "--defined-only" if defined else "--undefined-only", obj]
    text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    found = set()
    for line in text.splitlines():
        parts = line.split(None, 2) if defined else [""] + line.split(None, 1)
        if len(parts) == 3 and "scaletrain::" in parts[2] and (not defined or parts[1] in "TDBR"):
            found.add(parts[2])
    return found


def cycles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(build):
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        batched = [e["file"] for e in json.load(f)
                   if "/Unity/unity_" in e["file"]
                   and any(t in e["file"] for t in ("/scaletrain_core.dir/", "/scaletrain_lib.dir/"))]
    if batched:  # one object holds many sources: the calls between them are hidden
        print(f"calls: the libraries are built in {len(batched)} unity batches: configure with "
              "-DSCALETRAIN_UNITY_BUILD=OFF to check the calls between source files (scripts/run-tests.sh does)")
        return 1
    objs = objects(build)
    if not objs:
        print("calls: no object files of the libraries in %s/compile_commands.json" % build)
        return 1
    owner, needs = {}, {}
    for name, obj in objs:
        for s in symbols(obj, True):
            owner.setdefault(s, name)
        needs[name] = symbols(obj, False)
    graph, why = {name: set() for name, _ in objs}, {}
    for name, wanted in needs.items():
        for s in wanted:
            other = owner.get(s)
            if other and other != name:
                graph[name].add(other)
                why.setdefault((name, other), s)
    problems, used = [], set()
    for comp in cycles(graph):
        group = next((g for g in GROUPS if comp <= g), None)
        if group is not None:
            used.add(group)
            continue
        calls = ["%s -> %s (%s)" % (a, b, why[(a, b)][:90]) for a in sorted(comp) for b in sorted(graph[a] & comp)]
        problems.append("files that call each other: %s; calls: %s" % (", ".join(sorted(comp)), "; ".join(calls)))
    for g in GROUPS:
        if g not in used:
            problems.append("GROUPS lists %s, which no longer call each other in a cycle: remove it" % sorted(g))
    for p in problems:
        print("calls: " + p)
    print("calls: %d problem(s) over %d object files, %d known group(s)" % (len(problems), len(objs), len(used)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build"))

#!/usr/bin/env python3
"""The registry of process-wide mutable state, checked against the sources.

State that outlives one object (a variable at namespace scope, a function's
static, a thread_local) makes two worlds, engines or tests in one process see
each other. The library keeps such state only where what it serves is
process-wide itself: libtorch's allocator and operator callbacks, POSIX
signal handlers, the RPC agent (one per process, as in torch.distributed.rpc),
the trace and communication recorders (like torch.profiler), and per-thread
recursion guards. REGISTRY below lists each with that reason; anything else
found fails this test, and so does an entry whose variable is gone, so the
list stays true. Usage: globals.py SRC_DIR (src/scaletrain).

What is found: in .cpp files, a definition at column 0 that is not const or
constexpr, and an indented `static` or `thread_local` variable that is not
const. Headers hold declarations only (classes, inline constants).
"""
import os
import re
import sys

# (file, variable): why it is process-wide.
REGISTRY = {
    # Tracing (util/trace.h, Note [Tracing]): one recorder per process, like torch.profiler.
    ("util/trace.cpp", "g_on"): "tracing on or off for the whole process",
    ("util/trace.cpp", "s"): "the recorded events of every thread",
    ("util/trace.cpp", "t_lane"): "per thread: its lane in the trace",
    # The communication profile (Note [Communication profile] in comm/group.h).
    ("comm/profile.cpp", "t"): "per-(group, op) totals over every group of the process",
    ("comm/group.cpp", "g_waiting"): "collectives this process waits on (comm/activity.h, for the watchdog)",
    ("comm/group.cpp", "t_described"): "per thread: the collective being described, for its error message",
    # The launcher's signal handling: POSIX handlers are process-wide.
    ("launch/launcher.cpp", "g_running"): "one run() per process, since its signal handlers are global",
    ("launch/launcher.cpp", "once"): "one watcher of the launcher per process (follow_launcher)",
    ("launch/launcher_spawn.cpp", "g_pending_int"): "SIGINTs the handler saw and the loop has not handled",
    ("launch/launcher_spawn.cpp", "g_pending_term"): "SIGTERMs the handler saw and the loop has not handled",
    ("launch/launcher_spawn.cpp", "g_wake_fd"): "the self-pipe the signal handler writes to",
    # The counting allocator wraps libtorch's process-wide CPU allocator (observe/memory.h).
    ("observe/memory.cpp", "g_current"): "live bytes of the wrapped allocator",
    ("observe/memory.cpp", "g_counting"): "the allocator installed into libtorch",
    ("observe/memory.cpp", "g_installed"): "whether it was installed",
    ("observe/memory.cpp", "once"): "installed once",
    # libtorch's RecordFunction callbacks are process-wide: the hooks that
    # gather parameters on use (parallel/fsdp/gather_on_use.h) and split
    # linears (parallel/tensor/parallelize_module.h) register in them.
    ("parallel/fsdp/gather_on_use.cpp", "g_mu"): "guards the live engines' registry",
    # Note [Nested fully_shard]: a module's fully_shard finds the live engines over its submodules.
    ("parallel/fsdp/fully_shard.cpp", "g_live_mu"): "guards the live fully_shard engines by module",
    ("parallel/fsdp/fully_shard.cpp", "m"): "the live fully_shard engines by module (any caller may compose them)",
    # Note [Checkpointing a user's module]: a C++ module has no hooks and no room for a policy's mark, so
    # checkpointed(block, ...) finds its selection by the block's address (a weak reference guards reuse).
    ("train/module_checkpointing.cpp", "g_selected_mu"): "guards the blocks that policies selected",
    ("train/module_checkpointing.cpp", "selected"): "the blocks that policies selected, by module",
    ("parallel/fsdp/gather_on_use.cpp", "r"): "the live engines whose parameters gather on use",
    ("parallel/fsdp/gather_on_use.cpp", "t_quiet"): "per thread: our own operators are not looked at",
    ("parallel/fsdp/gather_on_use.cpp", "g_watch"): "the process-wide callback that names reads of a live engine's "
                                                    "parameters on threads other than its own",
    ("parallel/tensor/parallelize_module.cpp", "g_mu"): "guards the callback's registration",
    ("parallel/tensor/parallelize_module.cpp", "g_callback"): "the one RecordFunction callback",
    ("parallel/tensor/parallelize_module.cpp", "m"): "the split linears the callback looks for, by weight storage",
    ("parallel/tensor/parallelize_module.cpp", "t_busy"): "per thread: our own operators are not looked at",
    ("parallel/tensor/parallelize_module.cpp", "t_colwise"):
        "per thread: the storages of its forward's latest colwise outputs (Note [A head count that tensor "
        "parallelism split])",
    ("parallel/tensor/parallelize_module.cpp", "told"): "the layers whose reshape hint was printed: one line each",
    # Activation checkpointing: per-thread recursion depth of a recomputation.
    ("models/checkpoint.cpp", "recompute_depth"): "per thread: inside a recomputed forward",
    # RPC (rpc/rpc.h): one agent per process, as torch.distributed.rpc has,
    # and the distributed autograd contexts it serves.
    ("rpc/rpc.cpp", "g_mu"): "guards the agent",
    ("rpc/rpc.cpp", "g_agent"): "the process's RPC agent",
    ("rpc/rpc.cpp", "once"): "the built-in functions registered once",
    ("rpc/agent.cpp", "mu"): "guards the registered functions",
    ("rpc/agent.cpp", "r"): "the functions remote callers may name",
    ("rpc/agent.cpp", "t_caller"): "per thread: the worker whose call this thread serves",
    ("rpc/dist_autograd.cpp", "t_current"): "per thread: the distributed autograd context in use",
    ("rpc/dist_autograd.cpp", "g_mu"): "guards the contexts",
    ("rpc/dist_autograd.cpp", "g_contexts"): "the distributed autograd contexts of this process",
    ("rpc/dist_autograd.cpp", "g_next"): "the next context id",
    ("rpc/dist_autograd.cpp", "g_opt_mu"): "guards the distributed optimizers' local parts",
    ("rpc/dist_autograd.cpp", "g_optimizers"): "the distributed optimizers' local parts",
    ("rpc/dist_autograd.cpp", "g_next_optimizer"): "the next optimizer id",
}

TOP = re.compile(r"^(?:thread_local\s+|static\s+)?(?!return\b|using\b|namespace\b|template\b|typedef\b|extern\b|"
                 r"friend\b|class\b|struct\b|enum\b|union\b|#)([A-Za-z_][\w:<>, *&]*?)\s+\*?([A-Za-z_]\w*)"
                 r"\s*(?:\{[^;]*\}|=[^;]*|\([^;]*\))?(?:,\s*\*?[A-Za-z_]\w*\s*(?:\{[^;]*\}|=[^;]*)?)*;\s*(?://.*)?$")
LOCAL = re.compile(r"^\s+(?:static|thread_local)\s+(?!const\b|constexpr\b)([\w:<>, *]+?)\s*[*&]?\s*([A-Za-z_]\w*)"
                   r"\s*(?:\{|=|;)")


def found(src):
    for root, _, files in os.walk(src):
        for f in sorted(files):
            if not f.endswith(".cpp"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, src)
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                m = TOP.match(line) if not line[:1].isspace() else None
                # A const inside template arguments (map<const T*, U>) does not make the variable const.
                kind = re.sub(r"<.*>", "", m.group(1)) if m else ""
                if m and not re.search(r"\bconst(expr)?\b", kind) and "(" not in line.split("=")[0].split("{")[0]:
                    yield rel, m.group(2), number
                m = LOCAL.match(line)
                if m:
                    yield rel, m.group(2), number


def main():
    src = sys.argv[1]
    problems, seen = [], set()
    for rel, name, number in found(src):
        seen.add((rel, name))
        if (rel, name) not in REGISTRY:
            problems.append("%s:%d: `%s` is process-wide mutable state: keep it in an object (a World, an engine), "
                            "or add it to REGISTRY in tests/source/globals.py with why it must be process-wide" %
                            (rel, number, name))
    for gone in sorted(set(REGISTRY) - seen):
        problems.append("%s no longer defines `%s`: remove it from REGISTRY in tests/source/globals.py" % gone)
    for p in problems:
        print(p)
    print("globals: %d problem(s), %d registered" % (len(problems), len(REGISTRY)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

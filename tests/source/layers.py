#!/usr/bin/env python3
"""The layer rules of DESIGN.md, checked on every #include of src/scaletrain.

Each folder may include only the folders its row allows (and what those
allow, transitively); an include outside that is an upward or sideways
dependency and fails the check, naming the file, the line and the rule.
KNOWN lists violations allowed for now, each with the reason it is not
fixed yet (empty today); one that disappears must be removed from KNOWN, so
the list only shrinks. Usage: layers.py SRC_DIR (src/scaletrain).
"""
import os
import re
import sys

# folder -> folders it may include directly (DESIGN.md, "Layers, bottom up").
RULES = {
    "util": set(),
    "interfaces": {"util"},  # what engines need from a module (blocks, deferred storage)
    "comm": {"util"},
    "precision": {"comm"},
    "optim": {"comm", "precision", "kernels"},  # kernels/adamw.h: the fused step
    # parallel/* may also use each other (composition)
    "parallel": {"comm", "precision", "optim", "kernels", "interfaces"},
    "kernels": {"util"},
    "models": {"precision", "util", "kernels", "interfaces", "estimate"},  # estimate: each family's spec
    "template": {"util"},
    "data": {"util", "template"},
    "checkpoint": {"comm", "util"},
    "hub": {"checkpoint", "models", "interfaces", "util"},  # Hugging Face and PEFT formats
    "estimate": {"util"},
    # the run's config, torch-free: env.h (world size), hf_names.h (layer classes)
    "config": {"util", "precision", "comm", "models"},
    "launch": {"util"},
    "rpc": {"comm"},
    "observe": {"comm", "estimate", "util"},  # metrics, traces, memory: what a run shows
    "train": None,  # all of the above
}

# (including file, included file): why it is still there.
KNOWN = {}  # (including file, included file): why it is still there

INCLUDE = re.compile(r'^\s*#\s*include\s+"scaletrain/([^"]+)"')


def layer(path):
    """The layer of a path relative to src/scaletrain ('parallel' for parallel/ddp/x.h)."""
    return path.split("/", 1)[0] if "/" in path else ""


def allowed(src):
    out, todo = set(), [src]
    while todo:
        for dep in RULES.get(todo.pop()) or ():
            if dep not in out:
                out.add(dep)
                todo.append(dep)
    return out


def main(root):
    problems, seen_known = [], set()
    for dirpath, _, files in os.walk(root):
        for name in sorted(files):
            if not name.endswith((".h", ".cpp")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            src = layer(rel) or "train"  # scaletrain.h, the umbrella header, sees everything
            if src not in RULES:
                problems.append("%s: folder %s has no row in the layer table (tests/source/layers.py)" % (rel, src))
                continue
            if RULES[src] is None:
                continue
            ok = allowed(src) | {src}
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m or layer(m.group(1)) in ok or m.group(1) == "scaletrain.h":
                        continue
                    if (rel, m.group(1)) in KNOWN:
                        seen_known.add((rel, m.group(1)))
                        continue
                    problems.append("%s:%d includes %s: %s/ may include only %s" %
                                    (rel, number, m.group(1), src, ", ".join(sorted(allowed(src))) or "nothing"))
    for gone in sorted(set(KNOWN) - seen_known):
        problems.append("%s no longer includes %s: remove it from KNOWN in tests/source/layers.py" % gone)
    for p in problems:
        print(p)
    print("layers: %d problem(s), %d known violation(s) left" % (len(problems), len(seen_known)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src/scaletrain"))

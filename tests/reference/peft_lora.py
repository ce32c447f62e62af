#!/usr/bin/env python3
"""Independent reference for PEFT LoRA adapters (save_pretrained's layout) on Hub causal LMs.

  loss BASE_DIR ADAPTER_DIR IDS_FILE OUT_JSON [--dtype float32|float64]
      hf_causal_lm.py's loss of the base with the adapter merged into a float64 copy of its state
      dict, then converted to --dtype. OUT_JSON: {"loss", "adapted_layers", "scaling", "n_predicted", "dtype"}.
  merge BASE_DIR ADAPTER_DIR OUT_DIR [--dtype float32|bfloat16|float16]
      config.json (torch_dtype rewritten under --dtype), generation_config.json and one
      model.safetensors: every base tensor, adapted weights W + delta summed in float64, each in
      the base's stored dtype or in --dtype.
  make BASE_DIR OUT_ADAPTER_DIR --r R --alpha A --targets q_proj,v_proj [--rslora] [--seed S]
       [--fan-in-fan-out auto|true|false] [--zero-b]
      A, B ~ N(0, 0.05^2) in float32 (--zero-b: B = 0, PEFT's init) for each adaptable base layer
      whose module path ends in a target, and the adapter_config.json PEFT writes.
  selftest

Semantics (PEFT's LoraConfig and LoRA layers): adapter_config.json + adapter_model.safetensors;
peft_type "LORA", task_type CAUSAL_LM (or null), r > 0; scaling = lora_alpha / r (lora_alpha /
sqrt(r) with use_rslora). Refused: use_dora, non-empty rank_pattern / alpha_pattern, non-null
modules_to_save / layers_to_transform / layer_replication, bias other than "none". Tensors
"base_model.model.<module path>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r]; in eval the
layer computes W x + b + scaling * B (A x), i.e. W + scaling * B @ A. Adaptable layers: Llama family
model.layers.N.{self_attn,mlp}.*_proj (nn.Linear, W [out, in]); GPT-2 transformer.h.N.{attn.c_attn,
attn.c_proj, mlp.c_fc, mlp.c_proj} (Conv1D, W stored [in, out]: it gets (scaling * B @ A)^T; the path
keeps "transformer." when the file's names are bare). As in PEFT the layer type decides the
orientation; a disagreeing fan_in_fan_out only gets a warning on stderr. target_modules: a list
matches a path equal to an entry or ending in "." + entry; a string is a full-match regex
("all-linear": any). Each tensor pair must name a base layer that target_modules selects, with
matching in/out features. Bad input: one line on stderr, exit 1.
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_causal_lm as hcl  # noqa: E402
import hf_models as hm  # noqa: E402
import hub_checkpoint  # noqa: E402
import hub_configs  # noqa: E402
import safetensors_io as st  # noqa: E402

LLAMA_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj")
GPT2_LINEAR = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)")
TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_adapter(adapter_dir):
    """(adapter_config dict, {name: tensor}) after refusing what this reference does not model."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        ac = json.load(f)
    r, alpha = ac.get("r"), ac.get("lora_alpha")
    problems = [
        (ac.get("peft_type") != "LORA", "peft_type %r is not supported (only LORA)" % ac.get("peft_type")),
        (ac.get("task_type") not in ("CAUSAL_LM", None), "task_type %r is not CAUSAL_LM" % ac.get("task_type")),
        (type(r) is not int or r <= 0, "r must be a positive integer, got %r" % (r,)),
        (type(alpha) not in (int, float), "lora_alpha must be a number, got %r" % (alpha,)),
        (ac.get("use_rslora", False) not in (True, False), "use_rslora must be a bool"),
        (bool(ac.get("use_dora")), "use_dora=true (DoRA) is not supported"),
        (bool(ac.get("rank_pattern")), "a non-empty rank_pattern is not supported"),
        (bool(ac.get("alpha_pattern")), "a non-empty alpha_pattern is not supported"),
        (ac.get("modules_to_save") is not None, "modules_to_save must be null"),
        (ac.get("layers_to_transform") is not None, "layers_to_transform must be null"),
        (ac.get("layer_replication") is not None, "layer_replication must be null"),
        (ac.get("bias", "none") != "none", "bias %r is not supported (only \"none\")" % ac.get("bias")),
        (not isinstance(ac.get("target_modules"), (str, list)) or not ac.get("target_modules"),
         "target_modules must be a non-empty list or a string"),
    ]
    for bad, msg in problems:
        if bad:
            raise ValueError(msg)
    return ac, st.read_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def scaling_of(ac):
    return ac["lora_alpha"] / (math.sqrt(ac["r"]) if ac.get("use_rslora") else ac["r"])


def base_shapes(base_dir):
    """{stored name: shape} from the safetensors headers (no tensor data read)."""
    index = os.path.join(base_dir, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    return {n: i["shape"] for fn in files for n, i in st.read_header(os.path.join(base_dir, fn))[0].items()}


def linear_layers(cfg, names):
    """{module path as PEFT names it: stored weight name} of the base's adaptable linear layers."""
    gpt2 = hub_configs.arch_of(cfg) == "gpt2"
    out = {}
    for n in names:
        path = n[:-len(".weight")] if n.endswith(".weight") else None
        if path and gpt2 and not path.startswith("transformer."):
            path = "transformer." + path
        if path and (GPT2_LINEAR if gpt2 else LLAMA_LINEAR).fullmatch(path):
            out[path] = n
    return out


def targeted(path, tm):
    if isinstance(tm, str):
        return tm == "all-linear" or re.fullmatch(tm, path) is not None
    return any(path == t or path.endswith("." + t) for t in tm)


def lora_deltas(cfg, shapes, ac, tensors):
    """({stored weight name: float64 delta in the stored orientation}, scaling)."""
    layers, conv1d, r, s = linear_layers(cfg, shapes), hub_configs.arch_of(cfg) == "gpt2", ac["r"], scaling_of(ac)
    pairs = {}
    for name in tensors:
        m = TENSOR.fullmatch(name)
        if not m:
            raise ValueError("adapter tensor %s is not base_model.model.<layer>.lora_A/lora_B.weight" % name)
        pairs.setdefault(m.group(1), {})[m.group(2)] = name
    if not pairs:
        raise ValueError("the adapter holds no LoRA tensors")
    out = {}
    for path, ab in sorted(pairs.items()):
        if len(ab) != 2:
            raise ValueError("%s has no lora_%s partner" % (next(iter(ab.values())), "B" if "A" in ab else "A"))
        if path not in layers:
            raise ValueError("adapter tensor %s names %s, not a linear layer of the base" % (ab["A"], path))
        if not targeted(path, ac["target_modules"]):
            raise ValueError("adapter tensor %s: target_modules %s does not select %s"
                             % (ab["A"], ac["target_modules"], path))
        w_shape = list(shapes[layers[path]])
        out_f, in_f = (w_shape[1], w_shape[0]) if conv1d else w_shape
        for k, want in (("A", [r, in_f]), ("B", [out_f, r])):
            if list(tensors[ab[k]].shape) != want:
                raise ValueError("adapter tensor %s has shape %s, but base weight %s has shape %s (r=%d needs %s)"
                                 % (ab[k], list(tensors[ab[k]].shape), layers[path], w_shape, r, want))
        d = s * (tensors[ab["B"]].double() @ tensors[ab["A"]].double())
        out[layers[path]] = d.t() if conv1d else d
    if bool(ac.get("fan_in_fan_out", False)) != conv1d:
        sys.stderr.write("peft_lora: warning: fan_in_fan_out=%s but the layers are %s; using %s as PEFT does\n"
                         % (ac.get("fan_in_fan_out", False), "Conv1D" if conv1d else "nn.Linear", conv1d))
    return out, s


def _load(base_dir, adapter_dir, dtype):
    cfg, (ac, tensors) = hub_checkpoint.load_config(base_dir), read_adapter(adapter_dir)
    base = st.load_checkpoint_dir(base_dir, dtype)
    return (cfg, base) + lora_deltas(cfg, {n: t.shape for n, t in base.items()}, ac, tensors)


def adapted_weights(base_dir, adapter_dir, dtype):
    """(cfg, merged state dict in dtype, adapted layer count, scaling); the merge runs in float64."""
    cfg, base, deltas, s = _load(base_dir, adapter_dir, torch.float64)
    return cfg, {n: (t + deltas[n] if n in deltas else t).to(dtype) for n, t in base.items()}, len(deltas), s


def merge_dir(base_dir, adapter_dir, out_dir, dtype=None):
    cfg, base, deltas, _ = _load(base_dir, adapter_dir, None)
    out = {n: (t.double() + deltas[n] if n in deltas else t).to(DTYPES[dtype] if dtype else t.dtype)
           for n, t in base.items()}
    os.makedirs(out_dir, exist_ok=True)
    st.write_file(os.path.join(out_dir, "model.safetensors"), out, {"format": "pt"})
    for fn in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(base_dir, fn)):
            shutil.copy(os.path.join(base_dir, fn), out_dir)
    if dtype:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write(hub_configs.config_json_text(dict(cfg, torch_dtype=dtype)))
    return len(deltas)


def make_adapter(base_dir, out_dir, r, alpha, targets, rslora=False, seed=0, fan_in_fan_out="auto", zero_b=False):
    cfg = hub_checkpoint.load_config(base_dir)
    shapes = base_shapes(base_dir)
    conv1d = hub_configs.arch_of(cfg) == "gpt2"
    layers = linear_layers(cfg, shapes)
    for t in targets:
        if not any(targeted(p, [t]) for p in layers):
            raise ValueError("target %r matches no linear layer of %s" % (t, base_dir))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path in sorted(p for p in layers if targeted(p, targets)):
        w_shape = shapes[layers[path]]
        out_f, in_f = (w_shape[1], w_shape[0]) if conv1d else w_shape
        tensors["base_model.model.%s.lora_A.weight" % path] = torch.randn(r, in_f, generator=g) * 0.05
        b = torch.randn(out_f, r, generator=g) * 0.05
        tensors["base_model.model.%s.lora_B.weight" % path] = torch.zeros_like(b) if zero_b else b
    ac = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
          "target_modules": sorted(targets), "use_rslora": rslora, "bias": "none",
          "fan_in_fan_out": conv1d if fan_in_fan_out == "auto" else fan_in_fan_out == "true",
          "base_model_name_or_path": base_dir, "inference_mode": True, "init_lora_weights": True,
          "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
          "use_dora": False}
    os.makedirs(out_dir, exist_ok=True)
    st.write_file(os.path.join(out_dir, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        f.write(json.dumps(ac, indent=2, sort_keys=True) + "\n")
    return len(tensors) // 2


# ---------------------------------------------------------------------------- selftest

def unmerged_logits(cfg, base, tensors, s, ids):
    """fp64 logits of the base with s * B (A x) added to each adapted layer's output by hooks on
    F.linear (Llama's layers) and Tensor.__matmul__ (GPT-2's x @ W), the weight found by its storage."""
    lora = {}
    for name, a in tensors.items():
        path = TENSOR.fullmatch(name).group(1)
        key = path + ".weight" if path + ".weight" in base else path[len("transformer."):] + ".weight"
        if name.endswith("lora_A.weight"):
            lora[base[key].data_ptr()] = (a.double(), tensors[name.replace("lora_A", "lora_B")].double())
    lin, mm = F.linear, torch.Tensor.__matmul__

    def hooked_linear(x, w, b=None):
        e = lora.get(w.data_ptr())
        return lin(x, w, b) + (0 if e is None else s * lin(lin(x, e[0]), e[1]))

    def hooked_matmul(x, w):
        e = lora.get(w.data_ptr()) if isinstance(w, torch.Tensor) else None
        return mm(x, w) + (0 if e is None else s * mm(mm(x, e[0].t()), e[1].t()))

    F.linear, torch.Tensor.__matmul__ = hooked_linear, hooked_matmul
    try:
        return hm.causal_lm_logits(cfg, base, ids, torch.float64)
    finally:
        F.linear, torch.Tensor.__matmul__ = lin, mm


def selftest():
    ok = True

    def check(cond, what):
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok = ok and bool(cond)

    def refusal(base, ad, edit_cfg=None, edit_t=None):
        """The error for a copy of adapter AD with config keys / tensors edited ("" if accepted)."""
        bad = j("bad")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(ad, bad)
        ac, t = read_adapter(ad)
        with open(os.path.join(bad, "adapter_config.json"), "w") as f:
            json.dump(dict(ac, **(edit_cfg or {})), f)
        st.write_file(os.path.join(bad, "adapter_model.safetensors"), edit_t(t) if edit_t else t)
        try:
            adapted_weights(base, bad, torch.float64)
            return ""
        except ValueError as e:
            return str(e)

    def forward():  # the merged model against the layers computed unmerged, x W + b + s B (A x)
        for arch, n_layers in (("llama", 14), ("gpt2", 8)):
            cfg, merged, n, s = adapted_weights(j(arch), j(arch + "-ad"), torch.float64)
            base = st.load_checkpoint_dir(j(arch), torch.float64)
            want = unmerged_logits(cfg, base, read_adapter(j(arch + "-ad"))[1], s, ids)
            got = hm.causal_lm_logits(cfg, merged, ids, torch.float64)
            moved = float((got - hm.causal_lm_logits(cfg, base, ids, torch.float64)).abs().max())
            diff = float((got - want).abs().max())
            check(n == n_layers and s == 2.0 and diff < 1e-10 and moved > 1e-3,
                  "%s: merged forward = unmerged W x + 2 B (A x) on %d layers (max diff %.1e; %.3f from base)"
                  % (arch, n, diff, moved))

    def conv1d():  # GPT-2's Conv1D stores [in, out]: the non-square c_attn [48, 144]
        ac, t = read_adapter(j("gpt2-ad"))
        a_n, b_n = ("base_model.model.transformer.h.0.attn.c_attn.lora_%s.weight" % k for k in "AB")
        merge_dir(j("gpt2"), j("gpt2-ad"), j("gpt2-merged"))
        w0, w1 = (st.read_file(j(d, "model.safetensors"))["transformer.h.0.attn.c_attn.weight"].double()
                  for d in ("gpt2", "gpt2-merged"))
        check(list(t[a_n].shape) == [4, 48] and list(t[b_n].shape) == [144, 4] and list(w0.shape) == [48, 144]
              and torch.allclose(w1 - w0, 2 * (t[b_n].double() @ t[a_n].double()).t(), atol=1e-6),
              "gpt2 c_attn (Conv1D [48, 144]): lora_A [4, 48], lora_B [144, 4]; stored weight += (2 B @ A)^T")
        msg = refusal(j("gpt2"), j("gpt2-ad"), edit_t=lambda t: dict(t, **{a_n: torch.randn(4, 144), b_n: torch.randn(48, 4)}))
        check(a_n in msg and "[4, 144]" in msg and "[48, 144]" in msg, "gpt2: A/B shaped like the stored weight: " + msg)
        cfg = hub_checkpoint.load_config(j("gpt2"))
        d_pre, d_bare = (lora_deltas(cfg, base_shapes(j(d)), ac, t)[0] for d in ("gpt2", "bare"))
        check(len(d_bare) == 8 and all(torch.equal(d_pre["transformer." + k], v) for k, v in d_bare.items()),
              "gpt2: a bare-named base (h.0...) takes the same adapter (module paths keep transformer.)")
        make_adapter(j("gpt2"), j("gpt2-ff"), 4, 8, ["c_attn", "c_proj", "c_fc"], seed=1, fan_in_fan_out="false")
        d_ff = lora_deltas(cfg, base_shapes(j("gpt2")), *read_adapter(j("gpt2-ff")))[0]
        check(all(torch.equal(d_pre[k], v) for k, v in d_ff.items()),
              "gpt2: fan_in_fan_out=false is overridden by the Conv1D layer type (the warning above is expected)")

    def rslora():  # alpha / sqrt(r) = 8 / 2 = 4 (alpha / r would be 2)
        make_adapter(j("llama"), j("rs"), 4, 8, ["q_proj"], rslora=True, seed=1)
        _, w_rs, n, s = adapted_weights(j("llama"), j("rs"), torch.float64)
        t, q = read_adapter(j("rs"))[1], "model.layers.1.self_attn.q_proj"
        base = st.load_checkpoint_dir(j("llama"), torch.float64)
        want = 4 * t["base_model.model.%s.lora_B.weight" % q].double() @ t["base_model.model.%s.lora_A.weight" % q].double()
        check(s == 4.0 and n == 2 and torch.allclose(w_rs[q + ".weight"] - base[q + ".weight"], want, atol=1e-12),
              "rslora: scaling 8 / sqrt(4) = 4, delta = 4 B @ A")

    def targets():  # a list entry matches the path or a "."-bounded suffix; a string is a full-match regex
        up, attn = "model.layers.1.mlp.up_proj", "transformer.h.0.attn.c_proj"
        check(targeted(attn, ["attn.c_proj"]) and not targeted(attn.replace("attn.", "mlp."), ["attn.c_proj"])
              and not targeted(up, ["p_proj"]) and not targeted(up, "up_proj") and targeted(up, r".*\.1\.mlp\..*"),
              "target_modules: [attn.c_proj] selects attn.c_proj, not mlp.c_proj; [p_proj] not up_proj; "
              "a string is a full-match regex")

    def losses():  # B = 0 gives exactly the base loss; the merged directory exactly the loss command's
        make_adapter(j("llama"), j("zb"), 8, 16, ["q_proj", "down_proj"], zero_b=True, seed=2)
        for dt in (torch.float32, torch.float64):
            cfg, w, _, _ = adapted_weights(j("llama"), j("zb"), dt)
            lz, lb = float(hcl.weights_loss(cfg, w, ids, dt)[1]), float(hcl.model_loss(j("llama"), ids, dt)[2])
            check(lz == lb, "B = 0, %s: loss %.9f == base loss %.9f exactly" % (dt, lz, lb))
        merge_dir(j("llama"), j("llama-ad"), j("merged"))
        cfg, w, _, _ = adapted_weights(j("llama"), j("llama-ad"), torch.float32)
        la, lm = float(hcl.weights_loss(cfg, w, ids)[1]), float(hcl.model_loss(j("merged"), ids)[2])
        check(la == lm, "merged directory's hf_causal_lm loss %.9f == loss command %.9f" % (lm, la))
        merge_dir(j("llama"), j("llama-ad"), j("merged16"), "bfloat16")
        mw = st.read_file(j("merged16", "model.safetensors"))
        check(set(mw) == set(base_shapes(j("llama"))) and all(v.dtype == torch.bfloat16 for v in mw.values())
              and hub_checkpoint.load_config(j("merged16"))["torch_dtype"] == "bfloat16",
              "merge --dtype bfloat16: every base tensor, all bf16, config says so")

    def refusals():
        qa = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        moved = lambda t: dict(t, **{k.replace("layers.0", "layers.5"): t[k] for k in (qa, qa.replace("_A", "_B"))})  # noqa
        msg = refusal(j("llama"), j("llama-ad"), edit_t=moved)
        check("layers.5" in msg and "not a linear layer" in msg, "a tensor naming a missing layer is refused: " + msg)
        msg = refusal(j("llama"), j("llama-ad"), edit_t=lambda t: dict(t, **{qa: torch.randn(4, 63)}))
        check(qa in msg and "[4, 63]" in msg and "[64, 64]" in msg, "a shape mismatch is refused: " + msg)
        for edit, word in (({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"), ({"r": 8}, "r=8 needs [8, "),
                           ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"), ({"alpha_pattern": {"q_proj": 2}}, "alpha"),
                           ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"layers_to_transform": [0]}, "layers_to"),
                           ({"target_modules": ["v_proj"]}, "target_modules")):
            msg = refusal(j("llama"), j("llama-ad"), edit)
            check(word in msg, "refused %s: %s" % (edit, msg))
        refusal(j("llama"), j("llama-ad"), {"peft_type": "PREFIX_TUNING"})  # leaves that adapter in j("bad")
        cmd = [sys.executable, os.path.abspath(__file__), "loss", j("llama"), j("bad"), "ids.json", j("o.json")]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
        check(p.returncode == 1 and p.stderr.count("\n") == 1 and "PREFIX_TUNING" in p.stderr,
              "CLI: peft_type PREFIX_TUNING, exit %d: %s" % (p.returncode, p.stderr.strip()))

    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="peft_lora_selftest_")
    j = lambda *p: os.path.join(tmp, *p)  # noqa: E731
    try:
        ids = torch.randint(0, 97, (2, 9))
        for d, arch, kw in (("llama", "llama", {}), ("gpt2", "gpt2", {}), ("bare", "gpt2", {"gpt2_bare_names": True})):
            hub_checkpoint.write_checkpoint(j(d), hcl._tiny(arch), "float32", seed=3, **kw)
        make_adapter(j("llama"), j("llama-ad"), 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                         "down_proj"], seed=1)
        make_adapter(j("gpt2"), j("gpt2-ad"), 4, 8, ["c_attn", "c_proj", "c_fc"], seed=1)
        for section in (forward, conv1d, rslora, targets, losses, refusals):
            try:
                section()
            except Exception as e:  # a bug that raises is a failed check, and the next sections still run
                check(False, "%s: %s: %s" % (section.__name__, type(e).__name__, e))
    finally:
        shutil.rmtree(tmp)
    print("selftest: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lo, me, mk = (sub.add_parser(c) for c in ("loss", "merge", "make"))
    for p, names in ((lo, "base_dir adapter_dir ids_file out_json"), (me, "base_dir adapter_dir out_dir"),
                     (mk, "base_dir out_dir")):
        for n in names.split():
            p.add_argument(n)
    lo.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    me.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    mk.add_argument("--r", type=int, required=True)
    mk.add_argument("--alpha", type=float, required=True)
    mk.add_argument("--targets", required=True, help="comma-separated leaf names, e.g. q_proj,v_proj")
    mk.add_argument("--rslora", action="store_true")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--fan-in-fan-out", choices=["auto", "true", "false"], default="auto")
    mk.add_argument("--zero-b", action="store_true")
    sub.add_parser("selftest")
    a = ap.parse_args()
    if a.cmd == "selftest":
        return selftest()
    try:
        if a.cmd == "loss":
            cfg, w, n, s = adapted_weights(a.base_dir, a.adapter_dir, DTYPES[a.dtype])
            ids = hcl.read_ids(a.ids_file)
            loss = float(hcl.weights_loss(cfg, w, ids, DTYPES[a.dtype])[1])
            with open(a.out_json, "w") as f:
                json.dump({"loss": loss, "adapted_layers": n, "scaling": s, "dtype": a.dtype,
                           "n_predicted": ids.shape[0] * (ids.shape[1] - 1)}, f)
        elif a.cmd == "merge":
            print("merged %d layers into %s" % (merge_dir(a.base_dir, a.adapter_dir, a.out_dir, a.dtype), a.out_dir))
        else:
            alpha = int(a.alpha) if a.alpha == int(a.alpha) else a.alpha
            n = make_adapter(a.base_dir, a.out_dir, a.r, alpha, a.targets.split(","), a.rslora, a.seed,
                             a.fan_in_fan_out, a.zero_b)
            print("wrote %s: %d adapted layers" % (a.out_dir, n))
    except (ValueError, KeyError, OSError) as e:
        sys.stderr.write("peft_lora: %s\n" % (e,))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

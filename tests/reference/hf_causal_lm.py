#!/usr/bin/env python3
"""Independent reference loss of a Hugging Face causal LM directory (semantics: hf_models.py).

  loss MODEL_DIR IDS_FILE OUT_JSON [--dtype float32|float64] [--logits] [--logits-safetensors PATH]
       [--targets TARGETS_FILE]
      MODEL_DIR: config.json (model_type llama, mistral, qwen2, mixtral or gpt2) +
      model.safetensors, or model.safetensors.index.json + shards
      (fp32/fp16/bf16 tensors; converted to --dtype, default float32).
      IDS_FILE: JSON, a list of equal-length lists of token ids ([[1, 5, 9], [2, 7, 3]]),
      or one flat list for a single sequence.
      OUT_JSON: {"loss": mean next-token cross-entropy over all B*(T-1) predictions,
      "loss_per_sequence": [...], "batch", "seq_len", "n_predicted", "model_type", "dtype",
      and "logits" [B][T][V] with --logits}. --targets: a JSON list of B lists of T ids,
      the target of every position (the logits at position j of sequence b are scored
      against targets[b][j], as a trainer's (input, target) pair is), -100 where nothing
      is scored; "loss" is then the mean over the scored positions (torch's ignore_index)
      and "n_predicted" their number. --logits-safetensors writes the logits
      (tensor "logits", [B, T, V], in --dtype) as a safetensors file.
      Exit 1 with a one-line message on a bad directory (missing/extra tensor, wrong shape,
      unsupported config) or ids out of range.
  selftest
      Checks that need no transformers: RoPE against Meta's complex-number form after
      HF's q/k permutation, the llama3 frequency scaling on hand-computed wavelengths,
      the attention against a per-position loop, GQA against MHA with k/v heads copied
      explicitly, the GPT-2 path against tests/unit/torch/hf_gpt2_reference.py, sharded
      vs single file, fp32 vs bf16 files, fp32 vs fp64 compute, Qwen2 biases,
      Mistral's sliding window in use; Mixtral's MoE block against the dense mixture
      (k = E) and a per-token loop, identical experts = the dense llama model, and the
      loss command's errors on mixtral directories.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree when tests run us
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as hm  # noqa: E402
import hub_checkpoint  # noqa: E402
import hub_configs  # noqa: E402
import safetensors_io as st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_REF = os.path.join(HERE, "..", "unit", "torch", "hf_gpt2_reference.py")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def read_ids(path):
    with open(path) as f:
        ids = json.load(f)
    if ids and not isinstance(ids[0], list):
        ids = [ids]
    if not ids or len({len(r) for r in ids}) != 1 or len(ids[0]) < 2:
        raise ValueError("%s: need equal-length sequences of at least 2 ids" % path)
    return torch.tensor(ids, dtype=torch.int64)


def weights_loss(cfg, w, ids, dtype=torch.float32):
    """(logits, loss) of the model described by cfg with state dict w (tensors in dtype) on ids."""
    V = cfg["vocab_size"]
    bad = ids[(ids < 0) | (ids >= V)]
    if bad.numel():
        raise ValueError("token id %d outside the vocabulary (%d)" % (int(bad[0]), V))
    logits = hm.causal_lm_logits(cfg, w, ids, dtype)
    return logits, hm.next_token_loss(logits, ids)


def model_loss(model_dir, ids, dtype=torch.float32):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    logits, loss = weights_loss(cfg, st.load_checkpoint_dir(model_dir, dtype), ids, dtype)
    return cfg, logits, loss


def cmd_loss(a):
    ids = read_ids(a.ids_file)
    dtype = DTYPES[a.dtype]
    try:
        cfg, logits, loss = model_loss(a.model_dir, ids, dtype)
    except (ValueError, KeyError, OSError) as e:
        sys.stderr.write("hf_causal_lm: %s: %s\n" % (a.model_dir, e))
        return 1
    per_seq = [float(hm.next_token_loss(logits[b:b + 1], ids[b:b + 1])) for b in range(ids.shape[0])]
    n_predicted = ids.shape[0] * (ids.shape[1] - 1)
    if a.targets:
        with open(a.targets) as f:
            targets = torch.tensor(json.load(f), dtype=torch.int64)
        if targets.shape != ids.shape:
            sys.stderr.write("hf_causal_lm: %s: targets shape %s, need %s\n" % (a.targets, list(targets.shape),
                                                                             list(ids.shape)))
            return 1
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100)
        n_predicted = int((targets != -100).sum())
    out = {"loss": float(loss), "loss_per_sequence": per_seq, "batch": ids.shape[0], "seq_len": ids.shape[1],
           "n_predicted": n_predicted, "model_type": cfg["model_type"], "dtype": a.dtype}
    if a.logits:
        out["logits"] = logits.tolist()
    if a.logits_safetensors:
        st.write_file(a.logits_safetensors, {"logits": logits.contiguous()})
    with open(a.out_json, "w") as f:
        json.dump(out, f)
    return 0


# ---------------------------------------------------------------------------- selftest

def _meta_rope(x, theta):
    """Meta's llama reference: consecutive pairs (2i, 2i+1) rotated as complex numbers. x: [T, h, d]."""
    T, _, d = x.shape
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    cis = torch.polar(torch.ones(T, d // 2, dtype=torch.float64), torch.outer(torch.arange(T, dtype=torch.float64), freqs))
    xc = torch.view_as_complex(x.reshape(T, x.shape[1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * cis[:, None, :]).flatten(2)


def _hf_permute(w, n_heads):
    """transformers' convert_llama_weights_to_hf.py permute() for q/k weights."""
    d1, d2 = w.shape
    return w.view(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def _loop_attention(q, k, v, scale):
    """Per head, per query position: softmax over keys 0..t. q,k,v: [h, T, d]."""
    out = torch.zeros_like(q)
    for h in range(q.shape[0]):
        for t in range(q.shape[1]):
            s = torch.tensor([float(q[h, t] @ k[h, j]) * scale for j in range(t + 1)], dtype=q.dtype)
            p = torch.exp(s - s.max())
            p = p / p.sum()
            out[h, t] = sum(p[j] * v[h, j] for j in range(t + 1))
    return out


def _tiny(arch, **over):
    base = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64}
    if arch == "gpt2":
        base = {"n_layer": 2, "n_embd": 48, "n_head": 4, "vocab_size": 97, "n_positions": 64}
    base.update(over)
    return hub_configs.make_config(arch, base, "float32")


def _expert(x, w1, w2, w3):
    return torch.nn.functional.silu(x @ w1.t()) * (x @ w3.t()) @ w2.t()


def _loop_moe(x, gate, experts, k):
    """MixtralSparseMoeBlock token by token: softmax, the k most probable experts (lower index first
    on a tie), their probabilities renormalized to sum 1, the weighted sum of those experts' outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = [float(x[t] @ gate[j]) for j in range(gate.shape[0])]
        m = max(logits)
        e = [math.exp(v - m) for v in logits]
        probs = [v / sum(e) for v in e]
        chosen = sorted(range(len(probs)), key=lambda j: (-probs[j], j))[:k]
        total = sum(probs[j] for j in chosen)
        for j in chosen:
            out[t] += probs[j] / total * _expert(x[t:t + 1], *experts[j])[0]
    return out


def _mixtral_checks(check, tmp, llama_dir, llama_cfg, ids):
    """Mixtral's sparse MoE block and the mixtral directories (called by selftest)."""
    f64 = torch.float64
    # The block alone, fp64: k = E is the dense softmax-weighted mixture; k = 2 of 4 the per-token loop.
    E, C, I = 4, 16, 24
    h = torch.randn(2, 5, C, dtype=f64)
    gate = torch.randn(E, C, dtype=f64)
    experts = [tuple(torch.randn(*s, dtype=f64) * s[1] ** -0.5 for s in ((I, C), (C, I), (I, C))) for _ in range(E)]
    bw = {"m.gate.weight": gate}
    for j, (w1, w2, w3) in enumerate(experts):
        bw.update({"m.experts.%d.w1.weight" % j: w1, "m.experts.%d.w2.weight" % j: w2, "m.experts.%d.w3.weight" % j: w3})
    x = h.reshape(-1, C)
    probs = (x @ gate.t()).softmax(-1)
    dense = sum(probs[:, j:j + 1] * _expert(x, *experts[j]) for j in range(E))
    full = hm.moe_block(h, bw, "m.", E, E).reshape(-1, C)
    check(torch.allclose(full, dense, atol=1e-12, rtol=0),
          "mixtral block: k = E (4 of 4) = sum_j softmax(x gate^T)_j w2_j(silu(w1_j x) * w3_j x)")
    sparse = hm.moe_block(h, bw, "m.", E, 2).reshape(-1, C)
    loop = _loop_moe(x, gate, experts, 2)
    top1 = hm.moe_block(h, bw, "m.", E, 1).reshape(-1, C)
    check(torch.allclose(sparse, loop, atol=1e-12, rtol=0) and not torch.allclose(sparse, dense, atol=1e-3),
          "mixtral block: k = 2 of 4 = per-token loop (top 2 probabilities renormalized to 1), != dense")
    check(torch.allclose(top1, _loop_moe(x, gate, experts, 1), atol=1e-12, rtol=0),
          "mixtral block: k = 1: each token's output is its most probable expert's, weight 1")
    b32 = {n: t.float() for n, t in bw.items()}
    s32 = hm.moe_block(h.float(), b32, "m.", E, 2)
    check(s32.dtype == torch.float32 and torch.allclose(s32.double().reshape(-1, C), sparse, atol=1e-5, rtol=0),
          "mixtral block: fp32 in, fp32 out, within 1e-5 of fp64")
    # A mixtral model whose experts are all the llama model's dense MLP (random router) = that llama model.
    lw = st.load_checkpoint_dir(llama_dir)
    over = {n: llama_cfg.get(n, hub_configs.LLAMA[n]) for n in ("rope_theta", "rms_norm_eps")}
    xcfg = _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, **over)
    xw = {n: t for n, t in lw.items() if ".mlp." not in n}
    for i in range(llama_cfg["num_hidden_layers"]):
        p = "model.layers.%d." % i
        xw[p + "block_sparse_moe.gate.weight"] = torch.randn(4, 64)
        for j in range(4):
            for wn, dn in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
                xw[p + "block_sparse_moe.experts.%d.%s.weight" % (j, wn)] = lw[p + "mlp.%s.weight" % dn]
    a = hm.causal_lm_logits(llama_cfg, lw, ids, f64)
    b = hm.causal_lm_logits(xcfg, xw, ids, f64)
    xw2 = dict(xw, **{"model.layers.0.block_sparse_moe.experts.2.w2.weight":
                      1.5 * xw["model.layers.0.block_sparse_moe.experts.2.w2.weight"]})
    c = hm.causal_lm_logits(xcfg, xw2, ids, f64)
    check(torch.allclose(a, b, atol=1e-12, rtol=0) and not torch.allclose(a, c, atol=1e-6),
          "mixtral: 4 copies of llama's MLP as experts (top 2, random router) = llama (max diff %.1e); "
          "changing one expert changes it" % float((a - b).abs().max()))
    # A random mixtral directory through the loss command; errors about its tensors.
    md = os.path.join(tmp, "mixtral")
    hub_checkpoint.write_checkpoint(md, _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2), "float32", seed=5)
    with open(os.path.join(tmp, "ids.json"), "w") as f:
        json.dump(ids.tolist(), f)

    def cli(d, dtype="float32"):
        out = os.path.join(tmp, "out.json")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "loss", d, os.path.join(tmp, "ids.json"), out,
                            "--dtype", dtype], capture_output=True, text=True)
        if r.returncode != 0:
            return r.returncode, r.stderr
        with open(out) as f:
            return 0, json.load(f)

    rc32, o32 = cli(md)
    rc64, o64 = cli(md, "float64")
    l32 = float(model_loss(md, ids)[2])
    check(rc32 == 0 and rc64 == 0 and o32["model_type"] == "mixtral" and o32["loss"] == l32
          and abs(o32["loss"] - o64["loss"]) < 1e-5 * o64["loss"] and abs(l32 - math.log(97)) < 3,
          "mixtral directory (4 experts, top 2): loss command %s (fp32) vs %s (fp64), model_type %s"
          % (o32 if rc32 else o32["loss"], o64 if rc64 else o64["loss"], None if rc32 else o32["model_type"]))
    mw = st.load_checkpoint_dir(md)
    mcfg = _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2)
    full = hm.causal_lm_logits(mcfg, mw, ids)
    narrow = hm.causal_lm_logits(dict(mcfg, sliding_window=4), mw, ids)
    same = hm.causal_lm_logits(dict(mcfg, sliding_window=13), mw, ids)
    # allclose, not equal: an expert's matmul over another set of tokens may round differently
    check(torch.allclose(full, same, atol=1e-6, rtol=0) and torch.allclose(full[:, :4], narrow[:, :4], atol=1e-6, rtol=0)
          and not torch.allclose(full[:, 4], narrow[:, 4], atol=1e-3),
          "mixtral: sliding_window as mistral's (13 = none on 13 tokens; 4 differs from position 4 on)")
    import hub_corrupt
    results = []
    for kind, name in (("missing_tensor", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
                       ("extra_tensor", "model.layers.0.mlp.gate_proj.weight"),
                       ("wrong_shape", "model.layers.0.block_sparse_moe.gate.weight")):
        bad = os.path.join(tmp, "bad-" + kind)
        shutil.copytree(md, bad)
        ns = dict(dir=bad, out=None, missing_shard=False, index_names_missing_file=False, header_lies=None,
                  extra_tensor=None, missing_tensor=None, wrong_shape=None)
        ns[kind] = name
        hub_corrupt.run(argparse.Namespace(**ns))
        rc, err = cli(bad)
        results.append(rc == 1 and name in err and err.count("\n") == 1)
    check(all(results), "mixtral: missing expert tensor, extra dense mlp tensor, gate of the wrong shape: "
          "one line naming it, exit 1 (%s)" % results)
    with open(os.path.join(md, "config.json")) as f:
        kcfg = json.load(f)
    kd = os.path.join(tmp, "mixtral-k5")
    shutil.copytree(md, kd)
    with open(os.path.join(kd, "config.json"), "w") as f:
        f.write(hub_configs.config_json_text(dict(kcfg, num_experts_per_tok=5)))
    rc, err = cli(kd)
    check(rc == 1 and "num_experts_per_tok" in err, "mixtral: num_experts_per_tok 5 > num_local_experts 4 refused")


def selftest():
    ok = True

    def check(cond, what):
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok = ok and bool(cond)

    torch.manual_seed(0)
    f64 = torch.float64
    # RoPE: Meta's interleaved complex rotation with weights W == HF's rotate_half on permuted weights.
    nh, d, dim, T, theta = 3, 8, 24, 11, 10000.0
    x = torch.randn(T, dim, dtype=f64)
    wq, wk = torch.randn(nh * d, dim, dtype=f64), torch.randn(nh * d, dim, dtype=f64)
    qm = _meta_rope((x @ wq.t()).view(T, nh, d), theta)
    km = _meta_rope((x @ wk.t()).view(T, nh, d), theta)
    c = {"head_dim": d, "rope_theta": theta}
    cos, sin = hm.rope_cos_sin(hm.inv_freq_of(c, f64), torch.arange(T), f64)
    qh = hm.apply_rope((x @ _hf_permute(wq, nh).t()).view(T, nh, d).transpose(0, 1), cos, sin)
    kh = hm.apply_rope((x @ _hf_permute(wk, nh).t()).view(T, nh, d).transpose(0, 1), cos, sin)
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))  # Meta pair (2i,2i+1) -> HF (i, i+d/2)
    check(torch.allclose(qh, qm[:, :, perm].transpose(0, 1), atol=1e-12, rtol=0),
          "rope: HF rotate_half on permuted q = Meta's complex rotation, head dims permuted")
    sm = torch.einsum("thd,shd->hts", qm, km)
    sh = torch.einsum("htd,hsd->hts", qh, kh)
    check(torch.allclose(sm, sh, atol=1e-10, rtol=0), "rope: attention scores q.k identical in both forms")
    qc = hm.apply_rope(torch.randn(d, dtype=f64).expand(1, T, d), cos, sin)[0]
    kc = hm.apply_rope(torch.randn(d, dtype=f64).expand(1, T, d), cos, sin)[0]
    sc = qc @ kc.t()
    check(abs(sc[5, 3] - sc[9, 7]) < 1e-12 and abs(sc[2, 8] - sc[0, 6]) < 1e-12 and abs(sc[5, 3] - sc[5, 4]) > 1e-6,
          "rope: q.k of fixed vectors depends only on the position difference")
    # RMSNorm against the formula written out per element; bf16 input comes back bf16.
    xr, wr = torch.randn(3, 10, dtype=f64), torch.randn(10, dtype=f64)
    hand = torch.tensor([[float(wr[j]) * float(xr[i, j]) / math.sqrt(sum(float(v) ** 2 for v in xr[i]) / 10 + 1e-5)
                          for j in range(10)] for i in range(3)], dtype=f64)
    xb = xr.bfloat16()
    check(torch.allclose(hm.rms_norm(xr, wr, 1e-5), hand, atol=1e-12) and hm.rms_norm(xb, wr.bfloat16(), 1e-5).dtype
          == torch.bfloat16, "rms_norm: w * x / sqrt(mean(x^2) + eps); bf16 in, bf16 out")
    # Loss: shift by one, mean over B*(T-1) predictions, against logsumexp written out.
    lg, li = torch.randn(2, 5, 7, dtype=f64), torch.randint(0, 7, (2, 5))
    want = sum(float(torch.logsumexp(lg[b, t], 0) - lg[b, t, li[b, t + 1]]) for b in range(2) for t in range(4)) / 8
    check(abs(float(hm.next_token_loss(lg, li)) - want) < 1e-12, "loss: predicts ids[:, 1:] from positions :-1, mean")
    # llama3 scaling on hand-computed wavelengths (orig 8192, low 1, high 4, factor 8: band 2048..8192).
    rs = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    wl = torch.tensor([1000.0, 2048.0, 4096.0, 8192.0, 10000.0], dtype=f64)
    got = hm.llama3_inv_freq(2 * math.pi / wl, rs) / (2 * math.pi / wl)
    check(torch.allclose(got, torch.tensor([1, 1, 5 / 12, 1 / 8, 1 / 8], dtype=f64), atol=1e-12),
          "llama3: wavelen 1000,2048 kept; 4096 -> 5/12 (s=1/3); 8192,10000 -> 1/8: %s" % got.tolist())
    c31 = dict(hub_checkpoint.load_config(os.path.join(hub_checkpoint.FIXTURES, "llama-3.1-8b")), head_dim=128)
    inv, base = hm.inv_freq_of(c31, f64), hm.inv_freq_of(dict(c31, rope_scaling=None), f64)
    ratio = inv / base
    check(ratio[0] == 1 and abs(ratio[-1] - 1 / 8) < 1e-15 and bool((inv[1:] < inv[:-1]).all())
          and bool((ratio[1:] <= ratio[:-1] + 1e-15).all()),
          "llama3 (Llama-3.1 config): highest frequency kept, lowest / 8, monotone; %d of 64 scaled"
          % int((ratio < 1).sum()))
    # Attention against a per-position loop; GQA grouping (query head j reads kv head j // rep).
    q, k, v = (torch.randn(1, 4, 6, 5, dtype=f64) for _ in range(3))
    fast = hm.attention(q, k[:, :2], v[:, :2], hm.causal_mask(6), 0.3)
    slow = _loop_attention(q[0], k[0, [0, 0, 1, 1]], v[0, [0, 0, 1, 1]], 0.3)
    check(torch.allclose(fast[0], slow, atol=1e-12), "attention: causal softmax = per-position loop; GQA 4 heads / 2 kv")
    tmp = tempfile.mkdtemp(prefix="hf_causal_lm_selftest_")
    try:
        ids = torch.randint(0, 97, (3, 13))
        cfg = _tiny("llama", num_attention_heads=4, num_key_value_heads=2)
        gqa = os.path.join(tmp, "gqa")
        hub_checkpoint.write_checkpoint(gqa, cfg, "float32", seed=1)
        w = st.load_checkpoint_dir(gqa)
        mha_w = dict(w)
        for i in range(2):
            for n in ("k_proj", "v_proj"):
                key = "model.layers.%d.self_attn.%s.weight" % (i, n)
                mha_w[key] = w[key].view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
        mha_cfg = dict(cfg, num_key_value_heads=4)
        a = hm.causal_lm_logits(cfg, w, ids, f64)
        b = hm.causal_lm_logits(mha_cfg, mha_w, ids, f64)
        check(torch.allclose(a, b, atol=1e-12, rtol=0), "GQA (4 heads, 2 kv) = MHA with each kv head copied to its group")
        # Sharded vs single, fp32 vs bf16, fp32 vs fp64 compute.
        many = os.path.join(tmp, "many")
        files = hub_checkpoint.write_checkpoint(many, cfg, "float32", max_shard_size=30000, seed=1)
        bf = os.path.join(tmp, "bf16")
        hub_checkpoint.write_checkpoint(bf, dict(cfg, torch_dtype="bfloat16"), "bfloat16", seed=1)
        l1, l2, l3 = (float(model_loss(p, ids)[2]) for p in (gqa, many, bf))
        l64 = float(model_loss(gqa, ids, f64)[2])
        check(len(files) > 1 and l1 == l2, "%d shards and one file give the same loss %.6f" % (len(files), l1))
        check(abs(l1 - l3) < 2e-2 * abs(l1), "bf16 file of the same weights: loss %.6f vs %.6f" % (l3, l1))
        check(abs(l1 - l64) < 1e-5 * abs(l64), "fp32 compute %.8f vs fp64 %.8f" % (l1, l64))
        check(abs(l1 - math.log(97)) < 3, "loss of random weights near ln(V) = %.3f: %.3f" % (math.log(97), l1))
        # Qwen2 q/k/v biases are read and used; tied head.
        qcfg = _tiny("qwen2", tie_word_embeddings=True)
        qd = os.path.join(tmp, "qwen2")
        hub_checkpoint.write_checkpoint(qd, qcfg, "float32", seed=2)
        qw = st.load_checkpoint_dir(qd)
        qz = dict(qw, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros_like(qw["model.layers.0.self_attn.q_proj.bias"])})
        la, lb = (float(hm.next_token_loss(hm.causal_lm_logits(qcfg, x_, ids), ids)) for x_ in (qw, qz))
        check("lm_head.weight" not in qw and la != lb, "qwen2: tied head, q bias changes the loss (%.6f vs %.6f)" % (la, lb))
        # Mistral's sliding window: W >= T is plain causal; W < T changes the result.
        mcfg = _tiny("mistral", sliding_window=13)
        md = os.path.join(tmp, "mistral")
        hub_checkpoint.write_checkpoint(md, mcfg, "float32", seed=1)
        mw = st.load_checkpoint_dir(md)
        full = hm.causal_lm_logits(mcfg, mw, ids)
        lcfg = _tiny("llama")
        same = hm.causal_lm_logits(lcfg, mw, ids)
        narrow = hm.causal_lm_logits(dict(mcfg, sliding_window=4), mw, ids)
        check(torch.equal(full, same) and not torch.allclose(full, narrow)
              and torch.equal(full[:, :4], narrow[:, :4]) and not torch.allclose(full[:, 4], narrow[:, 4]),
              "mistral: window 13 = llama on 13 tokens; window 4 (keys t-3..t) differs from position 4 on")
        # GPT-2 path against the existing reference (tests/unit/torch/hf_gpt2_reference.py).
        gcfg = _tiny("gpt2")
        gd = os.path.join(tmp, "gpt2")
        hub_checkpoint.write_checkpoint(gd, gcfg, "float32", seed=4)
        st.write_file(os.path.join(tmp, "ids.safetensors"), {"ids": ids})
        r = subprocess.run([sys.executable, GPT2_REF, os.path.join(gd, "model.safetensors"),
                            os.path.join(tmp, "ids.safetensors"), "4", os.path.join(tmp, "ref.safetensors")])
        ref = st.read_file(os.path.join(tmp, "ref.safetensors"))["logits"] if r.returncode == 0 else None
        mine = model_loss(gd, ids)[1]
        check(ref is not None and torch.allclose(mine, ref, atol=1e-5, rtol=0),
              "gpt2: logits = hf_gpt2_reference.py (max diff %.2e)" % (float((mine - ref).abs().max()) if ref is not None else -1))
        # Errors name the tensor.
        bad = os.path.join(tmp, "bad")
        shutil.copytree(gqa, bad)
        import hub_corrupt
        hub_corrupt.run(argparse.Namespace(dir=bad, out=None, missing_shard=False, index_names_missing_file=False,
                                           header_lies=None, extra_tensor=None, missing_tensor="model.norm.weight",
                                           wrong_shape=None))
        try:
            model_loss(bad, ids)
            msg = ""
        except ValueError as e:
            msg = str(e)
        check("model.norm.weight" in msg, "a missing tensor is an error naming it: %r" % msg)
        _mixtral_checks(check, tmp, gqa, cfg, ids)
    finally:
        shutil.rmtree(tmp)
    print("selftest: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("loss")
    lo.add_argument("model_dir")
    lo.add_argument("ids_file")
    lo.add_argument("out_json")
    lo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    lo.add_argument("--logits", action="store_true", help="include the logits in OUT_JSON")
    lo.add_argument("--logits-safetensors", metavar="PATH")
    lo.add_argument("--targets", metavar="TARGETS_FILE", help="score every position against these ids (-100: none)")
    sub.add_parser("selftest")
    a = ap.parse_args()
    return cmd_loss(a) if a.cmd == "loss" else selftest()


if __name__ == "__main__":
    sys.exit(main())

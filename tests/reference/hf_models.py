"""Forward passes of Hugging Face causal LMs, written from transformers' documented semantics.

LlamaForCausalLM (and the families that differ from it only in details,
MistralForCausalLM, Qwen2ForCausalLM and MixtralForCausalLM), following modeling_llama.py:
  x = embed_tokens[ids]
  per layer:  h = RMSNorm(x); q,k,v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
              q,k <- RoPE(q,k); k,v repeated num_heads/num_kv_heads times
              (query head j reads kv head j // (num_heads/num_kv_heads));
              a = softmax(q k^T / sqrt(head_dim) + causal mask) v
              x = x + a Wo^T (+bo)
              h = RMSNorm(x); x = x + down(silu(gate(h)) * up(h))
  logits = RMSNorm(x) lm_head^T   (lm_head = embed_tokens when tie_word_embeddings)
  - RMSNorm: upcast to fp32, var = mean(x^2), x * rsqrt(var + eps), cast back to the
    input dtype, then times weight (in fp64 mode the upcast is to fp64).
  - RoPE: inv_freq = 1 / theta^(arange(0, d, 2) / d) in fp32 (fp64 in fp64 mode);
    freqs = pos * inv_freq; emb = cat(freqs, freqs); q' = q cos(emb) + rotate_half(q)
    sin(emb) with rotate_half(x) = cat(-x[d/2:], x[:d/2]). rope_scaling rope_type
    "llama3" (_compute_llama3_parameters): wavelen = 2 pi / inv_freq; wavelen > orig /
    low_freq_factor -> inv_freq / factor; wavelen < orig / high_freq_factor -> kept;
    otherwise s = (orig / wavelen - low) / (high - low), (1 - s) inv_freq / factor +
    s inv_freq. Other rope types are refused.
  - Biases: Llama: attention_bias on q,k,v,o, mlp_bias on gate,up,down; Qwen2: q,k,v
    always, never o; Mistral: none.
  - Mistral's sliding_window W: query t sees keys t-W+1..t (HF's mask: key <= t - W is
    masked). Qwen2 with use_sliding_window=true is refused.
MixtralForCausalLM (modeling_mixtral.py) is the Mistral model above (no biases, the same
sliding_window) with each layer's mlp replaced by block_sparse_moe, MixtralSparseMoeBlock,
dropless, as in evaluation (router_jitter_noise and router_aux_loss_coef play no part in
the forward loss); E = num_local_experts, k = num_experts_per_tok:
  x = h.view(-1, C); router_logits = x gate^T               (gate.weight [E, C], no bias)
  p = softmax(router_logits) computed in fp32 (fp64 in fp64 mode)
  top-k of p per token; r = topk values / their sum, cast to x's dtype
  out[token] = sum over its k experts j of r_j * w2_j(silu(w1_j x) * w3_j x)
  (experts.J.w1 / w3 [I, C], w2 [C, I], no biases); the layer adds out to the residual.
GPT2LMHeadModel (modeling_gpt2.py), as tests/unit/torch/hf_gpt2_reference.py: learned
positions, pre-LayerNorm (eps = layer_norm_epsilon), Conv1D weights [in, out] used as
x W + b, fused c_attn split q|k|v, activation_function (gelu_new = tanh GELU), lm_head
tied to wte unless a lm_head.weight is present.
All math runs in the dtype asked for (float32 or float64) after converting the stored weights.
"""
import math

import torch
import torch.nn.functional as F

import hub_configs

IGNORED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # non-parameter entries old files carry


def rms_norm(x, weight, eps):
    up = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(up)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def llama3_inv_freq(inv_freq, rs):
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    orig = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def inv_freq_of(c, dtype):
    d, theta = c["head_dim"], float(c.get("rope_theta", 10000.0))
    ftype = torch.float64 if dtype == torch.float64 else torch.float32
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(ftype) / d))
    rs = c.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            inv = llama3_inv_freq(inv, rs)
        elif kind != "default":
            raise ValueError("rope_scaling type %r is not supported (only llama3)" % kind)
    return inv


def rope_cos_sin(inv_freq, positions, dtype):
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, heads, T, d]; cos, sin: [T, d]."""
    return x * cos + rotate_half(x) * sin


def causal_mask(T, window=None):
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


def attention(q, k, v, mask, scale):
    """q: [B, nh, T, d]; k, v: [B, nkv, T, d] with nh a multiple of nkv."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def _check_weights(cfg, w):
    arch = hub_configs.arch_of(cfg)
    specs = dict(hub_configs.param_specs(cfg, gpt2_prefix=""))
    if arch == "gpt2":
        w = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in w.items()}
        if "lm_head.weight" in w and cfg.get("tie_word_embeddings", True):
            specs["lm_head.weight"] = specs["wte.weight"]  # some files carry the tied copy too
    w = {k: v for k, v in w.items() if not k.endswith(IGNORED)}
    for name in sorted(set(specs) - set(w)):
        raise ValueError("missing tensor %s" % name)
    for name in sorted(set(w) - set(specs)):
        raise ValueError("unexpected tensor %s" % name)
    for name, shape in specs.items():
        if list(w[name].shape) != shape:
            raise ValueError("tensor %s has shape %s, config says %s" % (name, list(w[name].shape), shape))
    return w


def moe_block(h, w, p, E, k):
    """MixtralSparseMoeBlock on h [B, T, C] with the tensors of prefix p (".../block_sparse_moe.")."""
    B, T, C = h.shape
    x = h.reshape(-1, C)
    router_logits = F.linear(x, w[p + "gate.weight"])
    probs = router_logits.softmax(-1, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    top_p, top_e = probs.topk(k, dim=-1)
    r = (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for j in range(E):
        tok, slot = (top_e == j).nonzero(as_tuple=True)  # the tokens that chose expert j, and in which slot
        if tok.numel() == 0:
            continue
        e = p + "experts.%d." % j
        xj = x[tok]
        y = F.linear(F.silu(F.linear(xj, w[e + "w1.weight"])) * F.linear(xj, w[e + "w3.weight"]), w[e + "w2.weight"])
        out.index_add_(0, tok, y * r[tok, slot, None])
    return out.view(B, T, C)


def llama_logits(cfg, w, ids, dtype):
    arch, c = hub_configs.resolved(cfg)
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError("hidden_act %r is not supported" % c["hidden_act"])
    if arch == "qwen2" and c.get("use_sliding_window"):
        raise ValueError("qwen2 use_sliding_window=true is not supported")
    w = {k: v.to(dtype) for k, v in _check_weights(cfg, w).items()}
    B, T = ids.shape
    nh, nkv, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]
    window = c.get("sliding_window") if arch in ("mistral", "mixtral") else None
    if arch == "mixtral":
        n_exp, top_k = c["num_local_experts"], c["num_experts_per_tok"]
        if not (isinstance(n_exp, int) and isinstance(top_k, int) and 1 <= top_k <= n_exp):
            raise ValueError("mixtral needs 1 <= num_experts_per_tok <= num_local_experts, got %r and %r"
                             % (top_k, n_exp))
    cos, sin = rope_cos_sin(inv_freq_of(c, dtype), torch.arange(T), dtype)
    mask = causal_mask(T, window)

    def lin(x, p):
        return F.linear(x, w[p + ".weight"], w.get(p + ".bias"))

    x = w["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj").view(B, T, nh, hd).transpose(1, 2)
        k = lin(h, p + "self_attn.k_proj").view(B, T, nkv, hd).transpose(1, 2)
        v = lin(h, p + "self_attn.v_proj").view(B, T, nkv, hd).transpose(1, 2)
        a = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask, hd ** -0.5)
        x = x + lin(a.transpose(1, 2).reshape(B, T, nh * hd), p + "self_attn.o_proj")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if arch == "mixtral":
            x = x + moe_block(h, w, p + "block_sparse_moe.", n_exp, top_k)
        else:
            x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if c["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.t()


GPT2_ACT = {"gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
            "gelu": F.gelu, "relu": F.relu, "silu": F.silu}


def gpt2_logits(cfg, w, ids, dtype):
    _, c = hub_configs.resolved(cfg)
    w = {k: v.to(dtype) for k, v in _check_weights(cfg, w).items()}
    B, T = ids.shape
    E, nh, eps = c["n_embd"], c["n_head"], c["layer_norm_epsilon"]
    hs = E // nh
    act = GPT2_ACT[c["activation_function"]]
    mask = causal_mask(T)

    def ln(x, p):
        return F.layer_norm(x, (E,), w[p + ".weight"], w[p + ".bias"], eps)

    def conv1d(x, p):  # HF Conv1D: weight [in, out]
        return x @ w[p + ".weight"] + w[p + ".bias"]

    x = w["wte.weight"][ids] + w["wpe.weight"][torch.arange(T)]
    for i in range(c["n_layer"]):
        p = "h.%d." % i
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(E, dim=2)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
        scale = (hs ** -0.5 if c["scale_attn_weights"] else 1.0)
        if c["scale_attn_by_inverse_layer_idx"]:
            scale /= i + 1
        y = attention(q, k, v, mask, scale).transpose(1, 2).reshape(B, T, E)
        x = x + conv1d(y, p + "attn.c_proj")
        x = x + conv1d(act(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    head = w.get("lm_head.weight") if not c["tie_word_embeddings"] else w["wte.weight"]
    return ln(x, "ln_f") @ head.t()


def causal_lm_logits(cfg, weights, ids, dtype=torch.float32):
    """Logits [B, T, V] of the model described by cfg (a config.json dict) on ids [B, T]."""
    with torch.no_grad():
        if hub_configs.arch_of(cfg) == "gpt2":
            return gpt2_logits(cfg, weights, ids, dtype)
        return llama_logits(cfg, weights, ids, dtype)


def next_token_loss(logits, ids):
    """Mean cross-entropy of predicting ids[:, 1:] from positions :-1 (HF's shifted labels)."""
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

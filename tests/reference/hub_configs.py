"""Hugging Face config.json contents and parameter lists for the families scaletrain reads.

Written from transformers' documented configuration classes (LlamaConfig,
MistralConfig, Qwen2Config, MixtralConfig, GPT2Config; key set as transformers
4.46 writes them) and the models' module trees (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, GPT2LMHeadModel):

- config.json is PretrainedConfig.to_json_string(use_diff=True): every
  model-specific attribute, plus the common ones (bos/eos/pad_token_id,
  tie_word_embeddings, torch_dtype) when they differ from PretrainedConfig's
  default or the class's default; json.dumps(indent=2, sort_keys=True) + "\\n".
- param_specs() lists the state_dict that save_pretrained writes, in module
  registration order (which is the order the shard splitter walks): embedding,
  per layer q,k,v,o (weight then bias), gate, up, down (Mixtral instead:
  block_sparse_moe.gate, then per expert J experts.J.w1, w2, w3, no biases),
  input_layernorm, post_attention_layernorm, final norm, lm_head unless tie_word_embeddings
  (tied weights are saved once, under the embedding's name). Non-persistent
  buffers (rotary_emb.inv_freq, GPT-2's attn.bias masks) are not saved.
- param_count() is the sum over param_specs(), i.e. model.num_parameters().
"""
import json

TRANSFORMERS_VERSION = "4.46.3"
PRETRAINED_DEFAULTS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
                       "tie_word_embeddings": True, "torch_dtype": None}

# Class defaults (constructor defaults, with num_key_value_heads/head_dim already resolved for the
# default sizes). Keys not in PRETRAINED_DEFAULTS are model-specific and always written.
LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
         "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
         "pretraining_tp": 1, "use_cache": True, "rope_theta": 10000.0, "rope_scaling": None,
         "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "tie_word_embeddings": False}
MISTRAL = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
           "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
           "use_cache": True, "rope_theta": 10000.0, "sliding_window": 4096, "attention_dropout": 0.0,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "tie_word_embeddings": False}
QWEN2 = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
         "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-06,
         "use_cache": True, "rope_theta": 10000.0, "rope_scaling": None, "use_sliding_window": False,
         "sliding_window": 4096, "max_window_layers": 28, "attention_dropout": 0.0,
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
MIXTRAL = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
           "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-05,
           "use_cache": True, "rope_theta": 1000000.0, "sliding_window": None, "attention_dropout": 0.0,
           "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
           "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "tie_word_embeddings": False}
GPT2 = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "summary_type": "cls_index",
        "summary_use_proj": True, "summary_activation": None, "summary_proj_to_labels": True,
        "summary_first_dropout": 0.1, "scale_attn_weights": True, "use_cache": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None, "tie_word_embeddings": True}

ARCHS = {  # --arch -> (model_type, architectures[0], class defaults)
    "llama": ("llama", "LlamaForCausalLM", LLAMA),
    "mistral": ("mistral", "MistralForCausalLM", MISTRAL),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", QWEN2),
    "mixtral": ("mixtral", "MixtralForCausalLM", MIXTRAL),
    "gpt2": ("gpt2", "GPT2LMHeadModel", GPT2),
}
MODEL_TYPE_TO_ARCH = {v[0]: k for k, v in ARCHS.items()}


def make_config(arch, overrides, torch_dtype):
    """The dict transformers writes to config.json for ARCH with OVERRIDES (class attribute names)."""
    model_type, cls, defaults = ARCHS[arch]
    attrs = dict(defaults)
    unknown = set(overrides) - set(attrs)
    if unknown:
        raise ValueError("%s config has no key(s) %s" % (arch, ", ".join(sorted(unknown))))
    attrs.update(overrides)
    if "head_dim" in attrs and "head_dim" not in overrides:  # resolved from the sizes, as the class does
        attrs["head_dim"] = attrs["hidden_size"] // attrs["num_attention_heads"]
    attrs["torch_dtype"] = torch_dtype
    out = {"architectures": [cls], "model_type": model_type, "transformers_version": TRANSFORMERS_VERSION}
    for k, v in attrs.items():
        if k not in PRETRAINED_DEFAULTS or v != PRETRAINED_DEFAULTS[k] or (k in defaults and v != defaults[k]):
            out[k] = v
    return out


def config_json_text(cfg):
    return json.dumps(cfg, indent=2, sort_keys=True) + "\n"


def arch_of(cfg):
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPE_TO_ARCH:
        raise ValueError("unsupported model_type %r (supported: %s)" % (mt, ", ".join(sorted(MODEL_TYPE_TO_ARCH))))
    return MODEL_TYPE_TO_ARCH[mt]


def resolved(cfg):
    """Config with every class default filled in (what the model constructor sees)."""
    arch = arch_of(cfg)
    full = dict(ARCHS[arch][2])
    full.update(cfg)
    if arch != "gpt2":
        if cfg.get("num_key_value_heads") is None:
            full["num_key_value_heads"] = full["num_attention_heads"]
        if cfg.get("head_dim") is None:
            full["head_dim"] = full["hidden_size"] // full["num_attention_heads"]
    return arch, full


def param_specs(cfg, gpt2_prefix="transformer."):
    """[(name, shape)] of the saved state_dict, in module registration order."""
    arch, c = resolved(cfg)
    if arch == "gpt2":
        E, L, V, P = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
        inner = c["n_inner"] or 4 * E
        t = gpt2_prefix
        specs = [(t + "wte.weight", [V, E]), (t + "wpe.weight", [P, E])]
        for i in range(L):
            p = "%sh.%d." % (t, i)
            specs += [(p + "ln_1.weight", [E]), (p + "ln_1.bias", [E]),
                      (p + "attn.c_attn.weight", [E, 3 * E]), (p + "attn.c_attn.bias", [3 * E]),
                      (p + "attn.c_proj.weight", [E, E]), (p + "attn.c_proj.bias", [E]),
                      (p + "ln_2.weight", [E]), (p + "ln_2.bias", [E]),
                      (p + "mlp.c_fc.weight", [E, inner]), (p + "mlp.c_fc.bias", [inner]),
                      (p + "mlp.c_proj.weight", [inner, E]), (p + "mlp.c_proj.bias", [E])]
        specs += [(t + "ln_f.weight", [E]), (t + "ln_f.bias", [E])]
        if not c["tie_word_embeddings"]:
            specs.append(("lm_head.weight", [V, E]))
        return specs
    H, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    qkv_bias = arch == "qwen2" or bool(c.get("attention_bias"))
    o_bias = arch == "llama" and bool(c.get("attention_bias"))
    mlp_bias = arch == "llama" and bool(c.get("mlp_bias"))
    specs = [("model.embed_tokens.weight", [V, H])]
    for i in range(L):
        p = "model.layers.%d." % i
        for proj, out_dim in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            specs.append((p + "self_attn.%s.weight" % proj, [out_dim, H]))
            if qkv_bias:
                specs.append((p + "self_attn.%s.bias" % proj, [out_dim]))
        specs.append((p + "self_attn.o_proj.weight", [H, nh * hd]))
        if o_bias:
            specs.append((p + "self_attn.o_proj.bias", [H]))
        if arch == "mixtral":  # MixtralSparseMoeBlock: router, then the experts (w1, w2, w3 each)
            E = c["num_local_experts"]
            specs.append((p + "block_sparse_moe.gate.weight", [E, H]))
            for j in range(E):
                for proj, shape in (("w1", [I, H]), ("w2", [H, I]), ("w3", [I, H])):
                    specs.append((p + "block_sparse_moe.experts.%d.%s.weight" % (j, proj), shape))
        else:
            for proj, shape in (("gate_proj", [I, H]), ("up_proj", [I, H]), ("down_proj", [H, I])):
                specs.append((p + "mlp.%s.weight" % proj, shape))
                if mlp_bias:
                    specs.append((p + "mlp.%s.bias" % proj, [shape[0]]))
        specs += [(p + "input_layernorm.weight", [H]), (p + "post_attention_layernorm.weight", [H])]
    specs.append(("model.norm.weight", [H]))
    if not c["tie_word_embeddings"]:
        specs.append(("lm_head.weight", [V, H]))
    return specs


def param_count(cfg):
    n = 0
    for _, shape in param_specs(cfg):
        k = 1
        for s in shape:
            k *= s
        n += k
    return n


# Published parameter counts (model cards / model.num_parameters()) checked by the self-test.
PUBLISHED_COUNTS = {"llama-2-7b": 6738415616, "llama-3-8b": 8030261248, "smollm2-135m": 134515008,
                    "gpt2": 124439808}

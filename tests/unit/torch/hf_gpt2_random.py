#!/usr/bin/env python3
"""Writes a random GPT-2 in the published Hugging Face layout, independently of the C++ code.

Bare names (wte.weight, h.N.attn.c_attn.weight, ...), Conv1D weights stored
[in, out], the causal-mask buffers h.N.attn.bias, and a config.json beside the
weights with the keys transformers' GPT2Config writes. Used by
config_files_test.cpp to check that model.init_from takes every dimension from
the file.

usage: hf_gpt2_random.py OUT_DIR N_LAYER N_HEAD N_EMBD N_POSITIONS VOCAB
"""
import json
import os
import struct
import sys

import torch


def main():
    out, L, H, E, P, V = sys.argv[1], *map(int, sys.argv[2:7])
    g = torch.Generator().manual_seed(5)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.05).float()
    w = {"wte.weight": r(V, E), "wpe.weight": r(P, E), "ln_f.weight": 1 + r(E), "ln_f.bias": r(E)}
    for i in range(L):
        p = "h.%d." % i
        w.update({p + "ln_1.weight": 1 + r(E), p + "ln_1.bias": r(E), p + "ln_2.weight": 1 + r(E),
                  p + "ln_2.bias": r(E), p + "attn.c_attn.weight": r(E, 3 * E), p + "attn.c_attn.bias": r(3 * E),
                  p + "attn.c_proj.weight": r(E, E), p + "attn.c_proj.bias": r(E),
                  p + "mlp.c_fc.weight": r(E, 4 * E), p + "mlp.c_fc.bias": r(4 * E),
                  p + "mlp.c_proj.weight": r(4 * E, E), p + "mlp.c_proj.bias": r(E),
                  p + "attn.bias": torch.tril(torch.ones(P, P)).view(1, 1, P, P)})
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in sorted(w.items()):
        b = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
           "n_layer": L, "n_head": H, "n_embd": E, "n_positions": P, "n_ctx": P, "vocab_size": V,
           "layer_norm_epsilon": 1e-05, "n_inner": None, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
           "attn_pdrop": 0.1, "bos_token_id": 0, "eos_token_id": 0}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Independent reference for the HF GPT-2 mapping (used by checkpoint_io_test.cpp).

Reads a GPT-2 safetensors file the way Hugging Face's GPT2LMHeadModel
interprets it -- Conv1D weights stored [in, out] and applied as x @ W + b,
fused q|k|v split on the last dimension, tanh GELU, LayerNorm eps 1e-5, head
tied to wte -- runs the forward pass on the token ids in IDS_FILE, and writes
the logits to OUT_FILE as safetensors. The safetensors parsing here is written
from the format description with json/struct only, independent of the C++ code.

usage: hf_gpt2_reference.py MODEL_FILE IDS_FILE N_HEAD OUT_FILE
"""
import json
import math
import struct
import sys

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=DTYPES[info["dtype"]]) if buf else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in sorted(tensors.items()):
        b = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    model_file, ids_file, n_head, out_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    w = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in read_safetensors(model_file).items()}
    idx = read_safetensors(ids_file)["ids"]
    B, T = idx.shape
    E = w["wte.weight"].shape[1]
    hs = E // n_head
    n_layer = len({k.split(".")[1] for k in w if k.startswith("h.")})

    def ln(x, p):
        return F.layer_norm(x, (E,), w[p + ".weight"], w[p + ".bias"], 1e-5)

    def conv1d(x, p):  # HF Conv1D: weight [in, out]
        return torch.addmm(w[p + ".bias"], x.reshape(-1, x.shape[-1]), w[p + ".weight"]).reshape(*x.shape[:-1], -1)

    with torch.no_grad():
        x = w["wte.weight"][idx] + w["wpe.weight"][torch.arange(T)]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        for i in range(n_layer):
            p = "h.%d." % i
            q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(E, dim=2)
            q, k, v = (t.view(B, T, n_head, hs).permute(0, 2, 1, 3) for t in (q, k, v))
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
            att = torch.where(mask, att, torch.tensor(torch.finfo(att.dtype).min))
            y = (att.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, E)
            x = x + conv1d(y, p + "attn.c_proj")
            m = F.gelu(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
            x = x + conv1d(m, p + "mlp.c_proj")
        logits = ln(x, "ln_f") @ w["wte.weight"].t()
    write_safetensors(out_file, {"logits": logits})


if __name__ == "__main__":
    main()

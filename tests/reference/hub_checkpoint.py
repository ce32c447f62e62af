#!/usr/bin/env python3
"""Random-weight checkpoints in the Hugging Face Hub layout, parameter counts, broken copies.

  write OUT_DIR [--arch A | --config PATH] [dims] --dtype D [--max-shard-size S] [--seed N] [--tie|--no-tie]
        [--rope-scaling llama3:FACTOR,LOW,HIGH,ORIG] [--gpt2-bare-names]
      Writes what PreTrainedModel.save_pretrained(OUT_DIR, safe_serialization=True) writes:
      config.json (hub_configs.make_config), generation_config.json, and either
      model.safetensors or model-0000i-of-0000N.safetensors + model.safetensors.index.json.
      Sharding follows huggingface_hub.split_torch_state_dict_into_shards (which
      save_pretrained uses): walk the state_dict in order; a tensor larger than the limit
      gets a shard of its own (appended at once); otherwise a new shard starts when the
      tensor would take the current one over the limit. Sizes "1GB" = 10^9 bytes, "1GiB" =
      2^30 (huggingface_hub parse_size_to_int). The index is json.dumps(indent=2,
      sort_keys=True) of {"metadata": {"total_size": BYTES}, "weight_map": {name: file}}.
      Each file carries metadata {"format": "pt"}. Tensors are generated one at a time, in
      row chunks, each from its own generator seeded by (seed, crc32(name)): the values do
      not depend on dtype, sharding or order, and memory stays at one chunk + one tensor.
  params CONFIG_OR_DIR           prints the parameter count (model.num_parameters()).
  corrupt DIR [--out COPY] KIND  see hub_corrupt.py.
  selftest                       checks the writer and the published parameter counts.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import zlib

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree when tests run us
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hub_configs  # noqa: E402
import hub_corrupt  # noqa: E402
import safetensors_io as st  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "hub_configs")
DTYPES = {"float32": ("F32", torch.float32), "float16": ("F16", torch.float16), "bfloat16": ("BF16", torch.bfloat16)}
CHUNK_ELEMENTS = 1 << 20  # rows are generated in chunks of about this many elements (4 MB in fp32)
# --dims flag -> (llama-family key, gpt2 key)
DIMS = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
        "intermediate": ("intermediate_size", "n_inner"), "heads": ("num_attention_heads", "n_head"),
        "kv_heads": ("num_key_value_heads", None), "head_dim": ("head_dim", None), "vocab": ("vocab_size", "vocab_size"),
        "max_pos": ("max_position_embeddings", "n_positions"), "rope_theta": ("rope_theta", None),
        "rms_eps": ("rms_norm_eps", None), "sliding_window": ("sliding_window", None)}
TINY = {"llama": {"layers": 2, "hidden": 64, "intermediate": 160, "heads": 4, "kv_heads": 2, "vocab": 256, "max_pos": 128},
        "gpt2": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "max_pos": 128}}


def parse_size(s):
    s = str(s).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mult)
    return int(s)


def split_shards(sizes, max_size):
    """[(name, nbytes)] in state_dict order -> [[names]] (huggingface_hub's algorithm)."""
    shards, cur, cur_size = [], [], 0
    for name, n in sizes:
        if n > max_size:
            shards.append([name])
            continue
        if cur_size + n > max_size:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += n
    if cur:
        shards.append(cur)
    return shards


def init_chunks(name, shape, seed):
    """Yields the fp32 values of one tensor in row chunks (deterministic from name, shape, seed)."""
    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) % (2**63))
    base = name.split(".")[-2] if "." in name else name
    is_norm = name.endswith(".weight") and ("norm" in base or base.startswith("ln_"))
    if name.endswith(".bias"):
        scale, shift = 0.1, 0.0
    elif is_norm:
        scale, shift = 0.1, 1.0
    elif base in ("embed_tokens", "wte", "wpe"):
        scale, shift = shape[1] ** -0.5, 0.0
    elif base in ("c_attn", "c_proj", "c_fc") and ".h." in "." + name:  # GPT-2 Conv1D: [in, out]
        scale, shift = shape[0] ** -0.5, 0.0
    else:  # nn.Linear: [out, in]
        scale, shift = shape[1] ** -0.5, 0.0
    rows = shape[0]
    row = st.numel(shape[1:])
    step = max(1, CHUNK_ELEMENTS // max(row, 1))
    for r in range(0, rows, step):
        n = min(step, rows - r)
        yield torch.randn([n] + list(shape[1:]), generator=g).mul_(scale).add_(shift)


def build_config(a):
    if a.config:
        with open(a.config if a.config.endswith(".json") else os.path.join(a.config, "config.json")) as f:
            cfg = json.load(f)
        arch = hub_configs.arch_of(cfg)
    else:
        arch, cfg = a.arch, None
    over = {}
    fam = 1 if arch == "gpt2" else 0
    if not a.config:
        for k, v in TINY["gpt2" if arch == "gpt2" else "llama"].items():
            over[DIMS[k][fam]] = v
    for k, keys in DIMS.items():
        v = getattr(a, k)
        if v is not None:
            if keys[fam] is None:
                sys.exit("--%s does not apply to %s" % (k.replace("_", "-"), arch))
            over[keys[fam]] = v
    if a.tie is not None:
        over["tie_word_embeddings"] = a.tie
    if a.attention_bias:
        over["attention_bias"] = True
    if a.mlp_bias:
        over["mlp_bias"] = True
    if a.rope_scaling:
        kind, _, vals = a.rope_scaling.partition(":")
        if kind != "llama3":
            sys.exit("--rope-scaling: only llama3:FACTOR,LOW,HIGH,ORIG is supported")
        f, lo, hi, orig = vals.split(",")
        over["rope_scaling"] = {"factor": float(f), "low_freq_factor": float(lo), "high_freq_factor": float(hi),
                                "original_max_position_embeddings": int(orig), "rope_type": "llama3"}
    for kv in a.set or []:
        k, _, v = kv.partition("=")
        over[k] = json.loads(v)
    if cfg is None:
        return hub_configs.make_config(arch, over, a.dtype)
    cfg.update(over)
    if "head_dim" in cfg and "head_dim" not in over and ("hidden_size" in over or "num_attention_heads" in over):
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["torch_dtype"] = a.dtype
    return cfg


def write_checkpoint(out_dir, cfg, dtype, max_shard_size=parse_size("5GB"), seed=0, gpt2_bare_names=False):
    """Writes config.json, generation_config.json and the safetensors file(s); returns the file names."""
    os.makedirs(out_dir, exist_ok=True)
    st_dtype, torch_dtype = DTYPES[dtype]
    specs = hub_configs.param_specs(cfg, gpt2_prefix="" if gpt2_bare_names else "transformer.")
    shapes = dict(specs)
    sizes = [(n, st.nbytes(st_dtype, s)) for n, s in specs]
    shards = split_shards(sizes, max_shard_size)
    names = ["model.safetensors"] if len(shards) == 1 else [
        "model-%05d-of-%05d.safetensors" % (i + 1, len(shards)) for i in range(len(shards))]
    for fn, members in zip(names, shards):
        w = st.StreamWriter(os.path.join(out_dir, fn), [(n, st_dtype, shapes[n]) for n in members],
                            metadata={"format": "pt"})
        for n, _, shape in w.order:
            for chunk in init_chunks(n, shape, seed):
                w.write(n, chunk.to(torch_dtype))
        w.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(b for _, b in sizes)},
                 "weight_map": {n: fn for fn, members in zip(names, shards) for n in members}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(hub_configs.config_json_text(cfg))
    gen = {"_from_model_config": True, "transformers_version": hub_configs.TRANSFORMERS_VERSION}
    for k in ("bos_token_id", "eos_token_id"):
        if cfg.get(k) is not None:
            gen[k] = cfg[k]
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        f.write(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return names


def load_config(path):
    with open(path if path.endswith(".json") else os.path.join(path, "config.json")) as f:
        return json.load(f)


def selftest():
    ok = True

    def check(cond, what):
        nonlocal ok
        print(("ok   " if cond else "FAIL ") + what)
        ok = ok and bool(cond)

    for name, expect in hub_configs.PUBLISHED_COUNTS.items():
        got = hub_configs.param_count(load_config(os.path.join(FIXTURES, name)))
        check(got == expect, "params %s: %d (published %d)" % (name, got, expect))
    # Mixtral-8x7B (MixtralConfig's defaults are its dimensions): "46.7B" on the model card.
    got = hub_configs.param_count(hub_configs.make_config("mixtral", {}, "bfloat16"))
    check(got == 46702792704, "params mixtral-8x7b: %d (model card: 46.7B)" % got)
    check(split_shards([("a", 5), ("b", 3), ("c", 3), ("d", 12), ("e", 2)], 8) == [["a", "b"], ["d"], ["c", "e"]],
          "shard split follows huggingface_hub (oversized tensor gets its own shard, appended at once)")
    check(parse_size("1GB") == 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("123") == 123, "size units")
    hdr = st.encode_header(st.layout([("b", "F32", [1]), ("a", "BF16", [2])])[1], {"format": "pt"})
    want = b'{"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},' \
           b'"a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}'
    want += b" " * ((8 - len(want) % 8) % 8)
    check(hdr[8:] == want and int.from_bytes(hdr[:8], "little") == len(want) and len(want) % 8 == 0,
          "header: metadata first, larger dtype first then by name, compact JSON, space padding to 8")
    tmp = tempfile.mkdtemp(prefix="hub_ckpt_selftest_")
    try:
        for arch in ("llama", "qwen2", "mistral", "mixtral", "gpt2"):
            over = {"tie_word_embeddings": arch == "gpt2"}
            if arch != "gpt2":
                over.update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
            else:
                over.update(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64)
            if arch == "mixtral":
                over.update(num_local_experts=3, num_experts_per_tok=2)
            cfg = hub_configs.make_config(arch, over, "float32")
            one, many, bf = (os.path.join(tmp, arch + s) for s in ("-one", "-many", "-bf16"))
            write_checkpoint(one, cfg, "float32", seed=3)
            files = write_checkpoint(many, cfg, "float32", max_shard_size=20000, seed=3)
            write_checkpoint(bf, dict(cfg, torch_dtype="bfloat16"), "bfloat16", seed=3)
            a, b, c = (st.load_checkpoint_dir(d) for d in (one, many, bf))
            specs = hub_configs.param_specs(cfg)
            check(set(a) == {n for n, _ in specs} and all(list(a[n].shape) == s for n, s in specs),
                  "%s: names and shapes are the state_dict's" % arch)
            check(len(files) > 1 and set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a),
                  "%s: %d shards hold the same tensors as one file" % (arch, len(files)))
            check(all(torch.equal(a[n].bfloat16(), c[n]) for n in a), "%s: bf16 file = fp32 values rounded" % arch)
            with open(os.path.join(many, "model.safetensors.index.json")) as f:
                index = json.load(f)
            total = sum(t.numel() * 4 for t in a.values())
            sizes_ok = True
            for fn in files:
                header, meta, start, size = st.read_header(os.path.join(many, fn))
                ends = sorted(v["data_offsets"] for v in header.values())
                contiguous = all(x[1] == y[0] for x, y in zip(ends, ends[1:])) and ends[0][0] == 0
                sizes_ok &= (start % 8 == 0 and size == start + ends[-1][1] and contiguous and meta == {"format": "pt"}
                             and (ends[-1][1] <= 20000 or len(header) == 1))
            check(sizes_ok and index["metadata"]["total_size"] == total, "%s: shard files well formed, total_size" % arch)
            check(hub_configs.param_count(load_config(one)) == sum(t.numel() for t in a.values()),
                  "%s: params of config.json = elements written" % arch)
    finally:
        shutil.rmtree(tmp)
    print("selftest: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a random-weight Hub-layout checkpoint")
    w.add_argument("out_dir")
    w.add_argument("--arch", choices=sorted(hub_configs.ARCHS), default="llama")
    w.add_argument("--config", help="start from this config.json (or directory) instead of the tiny defaults")
    for k in DIMS:
        typ = float if k in ("rope_theta", "rms_eps") else int
        w.add_argument("--" + k.replace("_", "-"), dest=k, type=typ)
    w.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    w.add_argument("--max-shard-size", default="5GB", help="bytes, or with a unit: 1GB, 500MB, 2GiB (default 5GB)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tie", dest="tie", action="store_true", default=None)
    w.add_argument("--no-tie", dest="tie", action="store_false")
    w.add_argument("--attention-bias", action="store_true")
    w.add_argument("--mlp-bias", action="store_true")
    w.add_argument("--rope-scaling", help="llama3:FACTOR,LOW_FREQ_FACTOR,HIGH_FREQ_FACTOR,ORIGINAL_MAX_POS")
    w.add_argument("--set", action="append", metavar="KEY=JSON", help="any other config key")
    w.add_argument("--gpt2-bare-names", action="store_true",
                   help="GPT-2 names without 'transformer.' (as the openai-community/gpt2 file has them)")
    p = sub.add_parser("params", help="print the parameter count of a config.json")
    p.add_argument("config")
    hub_corrupt.add_parser(sub)
    sub.add_parser("selftest")
    a = ap.parse_args()
    if a.cmd == "write":
        cfg = build_config(a)
        files = write_checkpoint(a.out_dir, cfg, a.dtype, parse_size(a.max_shard_size), a.seed, a.gpt2_bare_names)
        print("wrote %s: %s, %d parameters" % (a.out_dir, ", ".join(files), hub_configs.param_count(cfg)))
    elif a.cmd == "params":
        print(hub_configs.param_count(load_config(a.config)))
    elif a.cmd == "corrupt":
        print(hub_corrupt.run(a))
    else:
        return selftest()
    return 0


if __name__ == "__main__":
    sys.exit(main())

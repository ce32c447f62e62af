"""Broken Hub-layout directories for loaders' bad-input tests (hub_checkpoint.py corrupt ...).

  corrupt DIR [--out COPY] KIND      (in place, or on a copy of DIR made at COPY)
  KIND, exactly one of:
    --missing-shard                deletes the last shard file named by the index
    --index-names-missing-file     repoints the last shard's tensors in weight_map to
                                   model-99999-of-0000N.safetensors (does not exist);
                                   the real file stays on disk
    --header-lies [past-end|shape|length]
                                   past-end (default): the last tensor of the last file
                                   claims one more row (shape and data_offsets agree with
                                   each other) so its bytes run past the end of the file;
                                   shape: a tensor's shape says more elements than its
                                   data_offsets span; length: the 8-byte header length
                                   says more bytes than the file has
    --extra-tensor NAME            adds NAME ([4], the file's dtype) to the last file + index
    --missing-tensor NAME          removes NAME from its file and from the index
    --wrong-shape NAME             rewrites NAME with its last dimension one shorter
                                   (a well-formed file whose shape disagrees with config.json)
    --add-inv-freq                 NOT a corruption: adds the non-parameter entries old Llama
                                   files carry, model.layers.N.self_attn.rotary_emb.inv_freq
                                   ([head_dim/2], the file's dtype, next to layer N's q_proj);
                                   a loader must ignore them
Every other byte and file of the directory stays as it was; the file rewritten keeps
metadata and the reference writer's layout. Prints one line saying what was done.
"""
import json
import os
import shutil

import torch

import safetensors_io as st


def add_parser(sub):
    c = sub.add_parser("corrupt", help="make a broken copy of a Hub-layout directory")
    c.add_argument("dir")
    c.add_argument("--out", help="copy DIR here first and break the copy")
    k = c.add_mutually_exclusive_group(required=True)
    k.add_argument("--missing-shard", action="store_true")
    k.add_argument("--index-names-missing-file", action="store_true")
    k.add_argument("--header-lies", nargs="?", const="past-end", choices=["past-end", "shape", "length"])
    k.add_argument("--extra-tensor", metavar="NAME")
    k.add_argument("--missing-tensor", metavar="NAME")
    k.add_argument("--wrong-shape", metavar="NAME")
    k.add_argument("--add-inv-freq", action="store_true")


def _index_path(d):
    return os.path.join(d, "model.safetensors.index.json")


def _load_index(d, need=False):
    p = _index_path(d)
    if not os.path.exists(p):
        if need:
            raise SystemExit("corrupt: %s is not sharded (no model.safetensors.index.json)" % d)
        return None
    with open(p) as f:
        return json.load(f)


def _save_index(d, index):
    with open(_index_path(d), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _files(d, index):
    return sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]


def _file_of(d, index, name):
    if index:
        if name not in index["weight_map"]:
            raise SystemExit("corrupt: no tensor %s in %s" % (name, d))
        return index["weight_map"][name]
    return "model.safetensors"


def _read_raw(path):
    header, meta, start, _ = st.read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    raw = {n: data[i["data_offsets"][0]:i["data_offsets"][1]] for n, i in header.items()}
    return header, meta, raw, data


def _rewrite(path, specs, raw, meta):
    """specs: [(name, st_dtype, shape)], raw: {name: bytes} -> a well-formed file."""
    w = st.StreamWriter(path, specs, meta)
    for n, _, _ in w.order:
        w.write(n, raw[n])
    w.close()


def run(a):
    d = a.dir
    if a.out:
        shutil.copytree(a.dir, a.out)
        d = a.out
    index = _load_index(d)
    if a.missing_shard:
        index = _load_index(d, need=True)
        victim = _files(d, index)[-1]
        os.remove(os.path.join(d, victim))
        return "removed %s" % os.path.join(d, victim)
    if a.index_names_missing_file:
        index = _load_index(d, need=True)
        files = _files(d, index)
        ghost = "model-99999-of-%05d.safetensors" % len(files)
        for n, fn in index["weight_map"].items():
            if fn == files[-1]:
                index["weight_map"][n] = ghost
        _save_index(d, index)
        return "index now names %s (absent) instead of %s" % (ghost, files[-1])
    if a.header_lies:
        fn = _files(d, index)[-1]
        path = os.path.join(d, fn)
        header, meta, _, data = _read_raw(path)
        if a.header_lies == "length":
            with open(path, "r+b") as f:
                f.write((os.path.getsize(path) + 8).to_bytes(8, "little"))
            return "header length of %s now exceeds the file" % path
        last = max(header, key=lambda n: header[n]["data_offsets"][1])
        info = header[last]
        row = st.nbytes(info["dtype"], info["shape"][1:])
        if a.header_lies == "past-end":
            info["shape"][0] += 1
            info["data_offsets"][1] += row
            what = "%s claims %s, %d bytes past the end of %s" % (last, info["shape"], row, path)
        else:
            info["shape"][0] += 1
            what = "%s's shape %s does not match its data_offsets %s in %s" % (
                last, info["shape"], info["data_offsets"], path)
        with open(path, "wb") as f:
            f.write(st.encode_header(header, meta) + data)
        return what
    if getattr(a, "add_inv_freq", False):
        return _add_inv_freq(d, index)
    name = a.extra_tensor or a.missing_tensor or a.wrong_shape
    fn = _files(d, index)[-1] if a.extra_tensor else _file_of(d, index, name)
    path = os.path.join(d, fn)
    header, meta, raw, _ = _read_raw(path)
    specs = {n: (i["dtype"], list(i["shape"])) for n, i in header.items()}
    if a.extra_tensor:
        if name in specs or (index and name in index["weight_map"]):
            raise SystemExit("corrupt: %s already exists" % name)
        dt = next(iter(header.values()))["dtype"]
        specs[name] = (dt, [4])
        raw[name] = st.tensor_bytes(torch.arange(4, dtype=st.ST_TO_TORCH[dt]))
        delta, what = st.nbytes(dt, [4]), "added %s [4] %s to %s" % (name, dt, path)
        if index:
            index["weight_map"][name] = fn
    elif a.missing_tensor:
        if name not in specs:
            raise SystemExit("corrupt: no tensor %s in %s" % (name, path))
        delta, what = -len(raw[name]), "removed %s from %s" % (name, path)
        del specs[name], raw[name]
        if index:
            del index["weight_map"][name]
    else:
        if name not in specs:
            raise SystemExit("corrupt: no tensor %s in %s" % (name, path))
        dt, shape = specs[name]
        t = torch.frombuffer(bytearray(raw[name]), dtype=st.ST_TO_TORCH[dt]).reshape(shape)
        t = t[..., :-1].contiguous()
        specs[name] = (dt, list(t.shape))
        delta = len(st.tensor_bytes(t)) - len(raw[name])
        raw[name] = st.tensor_bytes(t)
        what = "%s now has shape %s (was %s) in %s" % (name, list(t.shape), shape, path)
    _rewrite(path, [(n, dt, s) for n, (dt, s) in specs.items()], raw, meta)
    if index:
        index["metadata"]["total_size"] += delta
        _save_index(d, index)
    return what


def _add_inv_freq(d, index):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    by_file = {}
    for i in range(cfg["num_hidden_layers"]):
        q = "model.layers.%d.self_attn.q_proj.weight" % i
        by_file.setdefault(_file_of(d, index, q), []).append("model.layers.%d.self_attn.rotary_emb.inv_freq" % i)
    for fn, names in by_file.items():
        path = os.path.join(d, fn)
        header, meta, raw, _ = _read_raw(path)
        dt = next(iter(header.values()))["dtype"]
        specs = [(n, i["dtype"], i["shape"]) for n, i in header.items()]
        for n in names:
            specs.append((n, dt, [hd // 2]))
            raw[n] = st.tensor_bytes(inv.to(st.ST_TO_TORCH[dt]))
            if index:
                index["weight_map"][n] = fn
                index["metadata"]["total_size"] += len(raw[n])
        _rewrite(path, specs, raw, meta)
    if index:
        _save_index(d, index)
    return "added rotary_emb.inv_freq to %d layers" % cfg["num_hidden_layers"]

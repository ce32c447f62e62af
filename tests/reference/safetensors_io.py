"""Safetensors reading and streaming writing, from the format description only.

Format (https://github.com/huggingface/safetensors, README "Format"):
  8 bytes   N, unsigned little-endian 64-bit: size of the header
  N bytes   UTF-8 JSON object {"__metadata__": {str: str} (optional),
            NAME: {"dtype": "F32"|"F16"|"BF16"|..., "shape": [..],
                   "data_offsets": [BEGIN, END]}}  (offsets relative to the
            byte buffer after the header, END exclusive)
  rest      the byte buffer, tensors little-endian, row-major, no gaps.

What the reference writer (the Rust crate behind safetensors.torch.save_file,
which transformers' save_pretrained calls with metadata {"format": "pt"}) does
and this module copies:
  - tensors are laid out sorted by dtype alignment (larger first), then by name;
    the header lists "__metadata__" first and then the tensors in that order;
  - the header is compact JSON (no spaces) padded with spaces (0x20) to a
    multiple of 8 bytes, so the byte buffer starts 8-byte aligned.

Only json, struct and torch are used; nothing here is shared with the C++ code.
"""
import json
import os
import struct

import torch

# safetensors dtype name <-> torch dtype, and the element size in bytes.
ST_TO_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
               "U8": torch.uint8, "BOOL": torch.bool}
TORCH_TO_ST = {v: k for k, v in ST_TO_TORCH.items()}
ST_SIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Rank of each dtype in the Rust crate's Dtype enum; the writer sorts by it, descending.
_ST_RANK = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64",
            "I64", "U64"]


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(st_dtype, shape):
    return ST_SIZE[st_dtype] * numel(shape)


def tensor_bytes(t):
    """Little-endian raw bytes of a tensor (bf16 through an int16 view: numpy has no bfloat16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def read_header(path):
    """Returns (header dict without __metadata__, metadata or None, data start offset, file size)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError("%s: header length %d exceeds the file" % (path, n))
        header = json.loads(f.read(n).decode("utf-8"))
    meta = header.pop("__metadata__", None)
    return header, meta, 8 + n, size


def read_tensor(path, info, data_start):
    """Reads one tensor described by a header entry (seek + read, no whole-file load)."""
    begin, end = info["data_offsets"]
    dt = ST_TO_TORCH[info["dtype"]]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        buf = bytearray(f.read(end - begin))
    if len(buf) != end - begin or len(buf) != nbytes(info["dtype"], info["shape"]):
        raise ValueError("%s: tensor bytes do not match its header entry" % path)
    if not buf:
        return torch.empty(info["shape"], dtype=dt)
    return torch.frombuffer(buf, dtype=dt).reshape(info["shape"])


def read_file(path):
    """All tensors of one file as {name: tensor} (the file's own dtypes)."""
    header, _, start, _ = read_header(path)
    return {name: read_tensor(path, info, start) for name, info in header.items()}


def layout(specs):
    """Orders (name, st_dtype, shape) specs as the reference writer does and assigns data offsets.

    Returns (ordered list of (name, st_dtype, shape), header dict in that order)."""
    order = sorted(specs, key=lambda s: (-_ST_RANK.index(s[1]), s[0]))
    header, off = {}, 0
    for name, dt, shape in order:
        n = nbytes(dt, shape)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    return order, header


def encode_header(header, metadata=None):
    full = {}
    if metadata is not None:
        full["__metadata__"] = metadata
    full.update(header)
    h = json.dumps(full, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h


class StreamWriter:
    """Writes one safetensors file tensor by tensor: the header first (from the specs), then
    each tensor's bytes as the caller produces it, in the order returned by .order."""

    def __init__(self, path, specs, metadata=None):
        self.order, self.header = layout(specs)
        self.f = open(path, "wb")
        self.f.write(encode_header(self.header, metadata))
        self.next = 0  # index in .order of the tensor being written
        self.written = 0  # bytes of the buffer written so far

    def write(self, name, data):
        """data: a tensor of the spec's dtype (or raw bytes). May be called several times per
        tensor (chunks); the tensor is complete when its byte count is reached."""
        if self.next >= len(self.order) or name != self.order[self.next][0]:
            raise ValueError("write order: got %s, expected %s" % (
                name, self.order[self.next][0] if self.next < len(self.order) else "nothing more"))
        b = data if isinstance(data, (bytes, bytearray)) else tensor_bytes(data)
        self.f.write(b)
        self.written += len(b)
        end = self.header[name]["data_offsets"][1]
        if self.written == end:
            self.next += 1
        elif self.written > end:
            raise ValueError("too many bytes for %s" % name)

    def close(self):
        if self.next != len(self.order):
            raise ValueError("file closed before all tensors were written")
        self.f.close()


def write_file(path, tensors, metadata=None):
    """Writes {name: tensor} as one safetensors file (dtypes kept)."""
    specs = [(n, TORCH_TO_ST[t.dtype], list(t.shape)) for n, t in tensors.items()]
    w = StreamWriter(path, specs, metadata)
    for name, _, _ in w.order:
        w.write(name, tensors[name])
    w.close()


def load_checkpoint_dir(model_dir, dtype=None):
    """Reads a Hub-layout directory (model.safetensors, or model.safetensors.index.json + shards)
    and returns {name: tensor}, each converted to dtype as it is read when dtype is given. Every
    file named by the index must exist and hold the tensors the index assigns to it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    out = {}
    for fn in files:
        path = os.path.join(model_dir, fn)
        header, _, start, _ = read_header(path)
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name) != fn:
                raise ValueError("%s: tensor %s is not assigned to this file by the index" % (path, name))
            t = read_tensor(path, info, start)
            out[name] = t if dtype is None else t.to(dtype)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ValueError("index names tensors no shard holds: %s" % ", ".join(missing))
    return out

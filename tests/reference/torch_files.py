#!/usr/bin/env python3
"""PyTorch checkpoint files (`torch.save`) for the tests of the C++ reader: good ones
with an independent safetensors expectation, and hostile ones it must refuse.

Where the semantics come from:
  - `torch.save` (torch/serialization.py): a zip archive, every entry stored without
    compression under one top-level folder ("archive/" when torch writes it):
    `data.pkl` (the object, pickled with protocol 2), `data/<key>` (the raw little-endian
    bytes of each storage) and `version` (b"3\\n"). A tensor is pickled as a REDUCE of
    `torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
    requires_grad, backward_hooks)`, a Parameter as `_rebuild_parameter(tensor,
    requires_grad, backward_hooks)`, and the storage as a persistent id (BINPERSID) of
    the tuple ('storage', torch.<Type>Storage, key, location, numel). Views share their
    base's storage key; `_use_new_zipfile_serialization=False` writes the older
    non-zip ("legacy") layout instead.
  - Python's `pickle` and `pickletools` (the opcode table: PROTO, GLOBAL, REDUCE, MARK,
    TUPLE*, EMPTY_*, SETITEM(S), APPEND(S), BUILD, NEWOBJ, BINPERSID, BININT*, LONG1,
    BINUNICODE, ...; protocol 0 uses text opcodes such as DICT, INT, UNICODE, PUT).
    The hostile pickles here are assembled opcode by opcode as bytes (or produced by
    `pickle.dumps`, which only serialises) and are never unpickled by Python's own
    unpickler; the self-test only feeds them to `torch.load(weights_only=True)`.
  - `torch.load(weights_only=True)` (torch/_weights_only_unpickler.py): PyTorch's own
    restricted unpickler, used by `check` as the independent reader. The one of Debian's
    torch 1.13 lacks the BINFLOAT opcode (it says "Unsupported operand 71"), so it cannot
    read an optimizer state dict (lr, betas, eps are floats). Only for that refusal does
    `check` fall back to `pickle.Unpickler` with `find_class` restricted to the globals
    the C++ reader admits (Python's documented "restricting globals" pattern) and tells so
    on stderr.

The C++ reader admits only the globals collections.OrderedDict,
torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter(_with_state),
torch.Size and torch.<Float|Double|Half|BFloat16|Long|Int|Short|Char|Byte|Bool>Storage
(the latter only inside a storage persistent id), and refuses INST/OBJ/NEWOBJ(_EX)/EXT*,
BUILD on anything but an OrderedDict, protocol-0 text opcodes, nesting deeper than 512,
compressed or truncated archives, CRC mismatches, storages whose byte count is not
numel * element size, and tensors reaching past their storage. `malicious` writes one
file per refusal and a manifest of the phrase each error message must contain.

  torch_files.py write DIR                 state, training, model, legacy: .pt + .safetensors
  torch_files.py malicious DIR MARKER      hostile files + manifest.json (+ control.pt)
  torch_files.py check FILE EXPECTED.safetensors [--key KEY]
  torch_files.py selftest

Names in `check`: nested dicts, lists and tuples of the loaded object are flattened to
dotted paths (int dict keys as str(int)): {"optim": {"state": {0: {"exp_avg": t}}}} ->
"optim.state.0.exp_avg". Only the standard library, torch and safetensors_io.py are used.
"""
import argparse
import collections
import glob
import io
import json
import os
import pickle
import pickletools
import shlex
import shutil
import struct
import sys
import tempfile
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

# ---------------------------------------------------------------- good files


def random_ints(shape, dtype):
    """Uniform over the whole range of an integer dtype: random bytes reinterpreted."""
    size = torch.tensor([], dtype=dtype).element_size()
    n = safetensors_io.numel(shape)
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def state_tensors():
    """The OrderedDict saved as state.pt (seed 0). A few float elements are replaced by
    values only a bitwise comparison tells apart (-0.0, a NaN with a payload, inf)."""
    torch.manual_seed(0)
    sd = collections.OrderedDict()
    sd["f32"] = torch.randn(3, 4)
    sd["f32"][0, 0] = -0.0
    sd["f32"].view(torch.int32)[0, 1] = 0x7FC00001  # quiet NaN, payload 1
    sd["f64"] = torch.randn(2, 3, dtype=torch.float64)
    sd["f64"][1, 2] = float("inf")
    sd["f16"] = torch.randn(5).half()
    sd["f16"][4] = -0.0
    sd["bf16"] = torch.randn(2, 2).bfloat16()
    sd["i64"] = random_ints([4], torch.int64)
    sd["i64"][0] = -2 ** 63
    sd["i64"][1] = 2 ** 63 - 1
    sd["i32"] = random_ints([3, 2], torch.int32)
    sd["i16"] = random_ints([5], torch.int16)
    sd["i8"] = random_ints([2, 2, 2], torch.int8)
    sd["u8"] = random_ints([7], torch.uint8)
    b = torch.randint(0, 2, (6,)).bool()
    b[0], b[1] = True, False
    sd["bool"] = b
    sd["scalar"] = torch.randn(())
    sd["empty"] = torch.empty(0, 3)
    sd["base"] = torch.randn(4, 5)
    sd["view"] = sd["base"][1:3, 1:4]  # offset 6, stride (5, 1): not contiguous
    sd["transposed"] = torch.randn(3, 2, dtype=torch.float64).t()  # stride (1, 2)
    sd["param"] = torch.nn.Parameter(torch.randn(2, 3))
    return sd


def contiguous_copy(tensors):
    return {k: v.detach().contiguous() for k, v in tensors.items()}


def train_model():
    """Sequential(Linear(4, 8), LayerNorm(8), Linear(8, 2)), seed 1, 3 AdamW steps on MSE."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def training_expectation(model_sd, optim_sd):
    """The tensors of training.pt under the names `check` gives them (written out here,
    not through `flatten`, so that `check` tests the flattening)."""
    out = {"model." + k: v for k, v in model_sd.items()}
    for i, entry in optim_sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out["optim.state.%d.%s" % (i, k)] = entry[k]
    return contiguous_copy(out)


def legacy_tensors():
    w = torch.arange(6.0).reshape(2, 3)
    return {"w": w, "i": torch.tensor([1, -2, 3]), "col": w[:, 1]}


def cmd_write(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    p = lambda name: os.path.join(out_dir, name)  # noqa: E731
    sd = state_tensors()
    torch.save(sd, p("state.pt"))
    safetensors_io.write_file(p("state.safetensors"), contiguous_copy(sd))
    model, opt = train_model()
    model_sd, optim_sd = model.state_dict(), opt.state_dict()
    torch.save({"model": model_sd, "optim": optim_sd, "step": 3}, p("training.pt"))
    safetensors_io.write_file(p("training.safetensors"), training_expectation(model_sd, optim_sd))
    torch.save(model.state_dict(), p("model.pt"))
    safetensors_io.write_file(p("model.safetensors"), contiguous_copy(model.state_dict()))
    torch.save(legacy_tensors(), p("legacy.pt"), _use_new_zipfile_serialization=False)
    safetensors_io.write_file(p("legacy.safetensors"), contiguous_copy(legacy_tensors()))
    print("wrote %s: state, training, model, legacy (.pt and .safetensors)" % out_dir)


# ---------------------------------------------------------------- pickle assembly
# Opcode bytes of pickle protocol 2 (pickletools' table).
PROTO2, STOP, MARK = b"\x80\x02", b".", b"("
EMPTY_TUPLE, TUPLE, TUPLE1, TUPLE2, TUPLE3 = b")", b"t", b"\x85", b"\x86", b"\x87"
EMPTY_DICT, EMPTY_LIST, SETITEM, APPEND = b"}", b"]", b"s", b"a"
REDUCE, BUILD, NEWOBJ, BINPERSID = b"R", b"b", b"\x81", b"Q"
NEWFALSE = b"\x89"


def op_global(module, name):
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def op_str(s):
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def op_int(n):
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -2 ** 31 <= n < 2 ** 31:
        return b"J" + struct.pack("<i", n)
    # LONG1: length byte, then the shortest little-endian two's complement.
    data = n.to_bytes((n.bit_length() >> 3) + 1, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def op_tuple(items):
    """items: already-encoded elements."""
    if not items:
        return EMPTY_TUPLE
    if len(items) <= 3:
        return b"".join(items) + (TUPLE1, TUPLE2, TUPLE3)[len(items) - 1]
    return MARK + b"".join(items) + TUPLE


def op_int_tuple(values):
    return op_tuple([op_int(v) for v in values])


def op_empty_ordered_dict():
    return op_global("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE


def op_tensor(size, stride, offset=0, numel=6, key="0", storage="FloatStorage"):
    """_rebuild_tensor_v2 over the persistent id ('storage', torch.<storage>, key, 'cpu', numel)."""
    pid = op_tuple([op_str("storage"), op_global("torch", storage), op_str(key), op_str("cpu"), op_int(numel)])
    args = op_tuple([pid + BINPERSID, op_int(offset), op_int_tuple(size), op_int_tuple(stride), NEWFALSE,
                     op_empty_ordered_dict()])
    return op_global("torch._utils", "_rebuild_tensor_v2") + args + REDUCE


def op_state_dict(entries):
    """A plain dict {name: encoded value}, as torch.save pickles a dict."""
    body = b"".join(op_str(k) + v + SETITEM for k, v in entries.items())
    return PROTO2 + EMPTY_DICT + body + STOP


def valid_pickle():
    return op_state_dict({"w": op_tensor([6], [1])})


def torch_zip(data_pkl, compression=zipfile.ZIP_STORED):
    """The entries of a torch.save archive (folder "m/") around a given data.pkl; storage '0'
    holds 6 float32 zeros."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in (("m/data.pkl", data_pkl), ("m/data/0", bytes(24)), ("m/version", b"3\n")):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            z.writestr(info, data)
    return buf.getvalue()


def torch_save_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def storage_data_offset(archive, suffix):
    """Offset in the archive bytes of the data of the entry whose name ends with suffix: the
    local header (30 bytes, name and extra lengths at 26 and 28) follows header_offset."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    h = info.header_offset
    if archive[h:h + 4] != b"PK\x03\x04":
        raise ValueError("no local header at %d" % h)
    name_len, extra_len = struct.unpack("<HH", archive[h + 26:h + 30])
    return h + 30 + name_len + extra_len


# ---------------------------------------------------------------- hostile files


class Evil(collections.OrderedDict):
    """An OrderedDict subclass: its pickle names the global '__main__ Evil'."""


class SystemCall:
    """Serialises as a call of os.system (pickled as 'posix system' on Linux); pickling
    only stores the reference and the argument, nothing is called."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def hostile_files(marker):
    """[(file name, archive bytes, expected phrase)]; the payloads would create marker."""
    touch = "touch " + shlex.quote(marker)
    create = "open(%r, 'w').close()" % marker
    bad_crc = bytearray(torch_save_bytes({"w": torch.arange(16.0)}))
    bad_crc[storage_data_offset(bytes(bad_crc), "/data/0") + 5] ^= 0x40
    valid = torch_save_bytes({"w": torch.zeros(100)})
    return [
        ("os_system.pt",
         torch_zip(PROTO2 + op_global("os", "system") + op_tuple([op_str(touch)]) + REDUCE + STOP),
         "global 'os.system' is not allowed"),
        ("posix_system.pt", torch_zip(pickle.dumps(SystemCall(touch), protocol=2)),
         "global 'posix.system' is not allowed"),
        ("builtins_eval.pt",
         torch_zip(PROTO2 + op_global("builtins", "eval") + op_tuple([op_str(create)]) + REDUCE + STOP),
         "global 'builtins.eval' is not allowed"),
        ("subclass.pt", torch_zip(pickle.dumps(Evil(a=1), protocol=2)), "global '__main__.Evil' is not allowed"),
        ("storage_called.pt", torch_zip(PROTO2 + op_global("torch", "FloatStorage") + EMPTY_TUPLE + REDUCE + STOP),
         "'torch.FloatStorage' called"),
        ("newobj.pt", torch_zip(PROTO2 + op_global("collections", "OrderedDict") + EMPTY_TUPLE + NEWOBJ + STOP),
         "builds an arbitrary object"),
        ("build_tensor.pt", torch_zip(PROTO2 + op_tensor([6], [1]) + EMPTY_DICT + BUILD + STOP), "BUILD on a tensor"),
        ("offset_past_end.pt", torch_zip(op_state_dict({"w": op_tensor([2], [1], offset=100)})), "reaches past"),
        ("size_overflow.pt", torch_zip(op_state_dict({"w": op_tensor([2 ** 62, 2 ** 62], [1, 1])})), "reaches past"),
        ("storage_size.pt", torch_zip(op_state_dict({"w": op_tensor([6], [1], numel=1000)})), "holds 24 bytes"),
        ("deep.pt", torch_zip(PROTO2 + EMPTY_LIST * 100000 + APPEND * 99999 + STOP), "nested deeper than 512"),
        ("compressed.pt", torch_zip(valid_pickle(), zipfile.ZIP_DEFLATED), "is compressed"),
        ("truncated.pt", valid[:len(valid) // 2], "not a zip archive"),
        ("bad_crc.pt", bytes(bad_crc), "CRC-32"),
        ("text_protocol.pt", torch_zip(pickle.dumps({"a": 1}, protocol=0)), "not supported"),
    ]


def cmd_malicious(out_dir, marker):
    os.makedirs(out_dir, exist_ok=True)
    manifest = []
    for name, data, expect in hostile_files(marker):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        manifest.append({"file": name, "expect": expect})
    # The same archive with a harmless pickle: a reader must accept it ({'w': 6 zeros}).
    with open(os.path.join(out_dir, "control.pt"), "wb") as f:
        f.write(torch_zip(valid_pickle()))
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print("wrote %s: %d files to refuse, manifest.json, control.pt" % (out_dir, len(manifest)))


# ---------------------------------------------------------------- loading and checking

ALLOWED_GLOBALS = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
                   ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
                   ("torch", "Size")} | {("torch", t + "Storage") for t in (
                       "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")}


class AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError("global '%s.%s' is not allowed" % (module, name))
        return super().find_class(module, name)


def allow_list_pickle_module():
    """What torch.load needs of a pickle module: Unpickler (it subclasses it) and load."""
    mod = type(sys)("allow_list_pickle")
    mod.Unpickler = AllowListUnpickler
    mod.load = lambda f, **kw: AllowListUnpickler(f, **kw).load()
    mod.__name__ = "allow_list_pickle"
    return mod


def load(path):
    """torch.load(weights_only=True); on torch 1.13's missing BINFLOAT only, the allow-list
    fallback. Returns (object, how)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), "weights_only"
    except pickle.UnpicklingError as e:
        if "Unsupported operand 71" not in str(e):
            raise
    print("note: torch %s's weights_only loader lacks BINFLOAT; loaded %s with pickle.Unpickler restricted "
          "to the allowed globals" % (torch.__version__, path), file=sys.stderr)
    return torch.load(path, map_location="cpu", pickle_module=allow_list_pickle_module()), "allow-list"


def flatten(obj, prefix="", tensors=None, leaves=None):
    """{dotted name: tensor} and [(dotted name, value)] of the non-tensor leaves."""
    tensors = {} if tensors is None else tensors
    leaves = [] if leaves is None else leaves
    join = lambda k: str(k) if not prefix else "%s.%s" % (prefix, k)  # noqa: E731
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
    elif isinstance(obj, dict):
        if not obj:
            leaves.append((prefix, "{}"))
        for k, v in obj.items():
            flatten(v, join(int(k) if isinstance(k, int) and not isinstance(k, bool) else k), tensors, leaves)
    elif isinstance(obj, (list, tuple)):
        if not obj:
            leaves.append((prefix, "[]"))
        for i, v in enumerate(obj):
            flatten(v, join(i), tensors, leaves)
    else:
        leaves.append((prefix, obj))
    return tensors, leaves


BIT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}


def bits(t):
    t = t.detach().contiguous()
    return t.view(BIT_VIEW[t.dtype]) if t.dtype in BIT_VIEW else t


def compare(got, expected):
    """Mismatch lines between {name: tensor} dicts: names, dtypes, shapes, bits."""
    lines = []
    for name in sorted(set(expected) - set(got)):
        lines.append("missing %s: expected, not in the file" % name)
    for name in sorted(set(got) - set(expected)):
        lines.append("unexpected %s: in the file, not expected" % name)
    for name in sorted(set(got) & set(expected)):
        a, b = got[name], expected[name]
        if a.dtype != b.dtype:
            lines.append("dtype %s: file %s, expected %s" % (name, a.dtype, b.dtype))
        elif list(a.shape) != list(b.shape):
            lines.append("shape %s: file %s, expected %s" % (name, list(a.shape), list(b.shape)))
        elif not torch.equal(bits(a), bits(b)):
            diff = (bits(a) != bits(b)).reshape(-1)
            lines.append("values %s: %d of %d elements differ, first at flat index %d" % (
                name, int(diff.sum()), diff.numel(), int(diff.nonzero()[0])))
    return lines


def run_check(path, expected_path, key=None, out=sys.stdout):
    """Prints the leaves, the mismatches and the verdict; returns the exit status."""
    obj, _ = load(path)
    if key is not None:
        obj = obj[key]
    got, leaves = flatten(obj)
    for name, value in leaves:
        print("%s = %s" % (name, value), file=out)
    lines = compare(got, safetensors_io.read_file(expected_path))
    for line in lines:
        print(line, file=out)
    if lines:
        return 1
    print("ok %d tensors" % len(got), file=out)
    return 0


# ---------------------------------------------------------------- self-test


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def selftest_good(d):
    sd, how = load(os.path.join(d, "state.pt"))
    expect(how == "weights_only", "state.pt needs no fallback")
    expect(list(sd) == list(state_tensors()), "state.pt key order")
    expect(sd["view"].storage_offset() == 6 and not sd["view"].is_contiguous(), "view offset/contiguity")
    expect(sd["view"].storage().data_ptr() == sd["base"].storage().data_ptr(), "view shares base's storage")
    expect(sd["transposed"].stride() == (1, 2), "transposed stride")
    expect(isinstance(sd["param"], torch.nn.Parameter) and sd["param"].requires_grad, "param is a Parameter")
    expect(sd["scalar"].dim() == 0 and sd["empty"].shape == (0, 3), "scalar and empty shapes")
    expect(bool(sd["bool"].any()) and not bool(sd["bool"].all()), "bool holds both values")
    expect(sd["f32"].view(torch.int32)[0, 1] == 0x7FC00001, "NaN payload kept")

    sink = io.StringIO()
    expect(run_check(os.path.join(d, "state.pt"), os.path.join(d, "state.safetensors"), out=sink) == 0,
           "check state.pt: " + sink.getvalue())
    expect("ok 16 tensors" in sink.getvalue(), "16 tensors in state.pt")

    try:
        torch.load(os.path.join(d, "training.pt"), weights_only=True)
        training_how = "weights_only"
    except pickle.UnpicklingError as e:
        expect("Unsupported operand 71" in str(e), "training.pt refused for BINFLOAT only: %s" % e)
        training_how = "allow-list (torch's weights_only lacks BINFLOAT)"
    sink = io.StringIO()
    rc = run_check(os.path.join(d, "training.pt"), os.path.join(d, "training.safetensors"), out=sink)
    text = sink.getvalue()
    expect(rc == 0, "check training.pt: " + text)
    expect("ok 24 tensors" in text and "step = 3" in text and "optim.param_groups.0.lr = 0.01" in text
           and "optim.param_groups.0.betas.1 = 0.95" in text, "training.pt leaves: " + text)
    print("training.pt: loaded by %s; check ok (6 model + 18 optimizer tensors)" % training_how)

    # model.safetensors is the model.* part of training.safetensors; model.pt and
    # training.pt --key model both match it.
    training = safetensors_io.read_file(os.path.join(d, "training.safetensors"))
    model = safetensors_io.read_file(os.path.join(d, "model.safetensors"))
    expect(compare(model, {k[len("model."):]: v for k, v in training.items() if k.startswith("model.")}) == [],
           "model.safetensors = the model.* tensors of training.safetensors")
    for path, key in (("model.pt", None), ("training.pt", "model")):
        sink = io.StringIO()
        expect(run_check(os.path.join(d, path), os.path.join(d, "model.safetensors"), key, sink) == 0,
               "check %s --key %s: %s" % (path, key, sink.getvalue()))
    expect(list(torch.load(os.path.join(d, "model.pt"), weights_only=True)) ==
           ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"], "model.pt names")

    try:
        sink = io.StringIO()
        legacy_rc = run_check(os.path.join(d, "legacy.pt"), os.path.join(d, "legacy.safetensors"), out=sink)
        expect(legacy_rc == 0, "check legacy.pt: " + sink.getvalue())
        print("legacy.pt: loaded by torch.load(weights_only=True), check ok")
    except pickle.UnpicklingError as e:
        print("legacy.pt: torch's weights_only loader refuses it: %s" % str(e).splitlines()[-1])

    # check must see what it is meant to see: one flipped bit, -0.0 for 0.0, a dtype, a name.
    exp = safetensors_io.read_file(os.path.join(d, "state.safetensors"))
    mutations = {
        "bit": lambda e: e["i8"].view(-1).__setitem__(3, e["i8"].view(-1)[3] ^ 1),
        "nan payload": lambda e: e["f32"].view(torch.int32).view(-1).__setitem__(1, 0x7FC00000),
        "zero sign": lambda e: e["f16"].__setitem__(4, 0.0),
        "dtype": lambda e: e.__setitem__("i32", e["i32"].to(torch.int64)),
        "shape": lambda e: e.__setitem__("empty", torch.empty(3, 0)),
        "name": lambda e: e.__setitem__("extra", e.pop("u8")),
    }
    for what, mutate in mutations.items():
        e = {k: v.clone() for k, v in exp.items()}
        mutate(e)
        safetensors_io.write_file(os.path.join(d, "mutated.safetensors"), e)
        sink = io.StringIO()
        expect(run_check(os.path.join(d, "state.pt"), os.path.join(d, "mutated.safetensors"), out=sink) == 1,
               "check misses a changed %s" % what)


def selftest_hostile(d, marker):
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    expect(len(manifest) == 15 and all(os.path.exists(os.path.join(d, m["file"])) for m in manifest), "manifest")
    for m in manifest:
        path = os.path.join(d, m["file"])
        with open(path, "rb") as f:
            data = f.read()
        if m["file"] == "truncated.pt":
            expect(data[:4] == b"PK\x03\x04" and not zipfile.is_zipfile(path), "truncated.pt is a zip's head only")
        else:
            with zipfile.ZipFile(path) as z:
                pkl = next(z.read(n) for n in z.namelist() if n.endswith("/data.pkl"))
                if m["file"] == "bad_crc.pt":
                    expect(z.testzip() is not None, "bad_crc.pt: zipfile sees the CRC mismatch")
                if m["file"] == "compressed.pt":
                    expect(all(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist()), "deflated")
            pickletools.dis(pkl, out=io.StringIO())  # a well-formed opcode stream (nothing is run)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            print("  %-20s torch accepts it (%s)" % (m["file"], type(obj).__name__))
        except Exception as e:  # noqa: BLE001 - any refusal counts
            why = str(e).strip().splitlines()[-1]
            print("  %-20s torch refuses: %s" % (m["file"], why.split("WeightsUnpickler error: ")[-1][:100]))
        expect(not os.path.exists(marker), "%s created the marker" % m["file"])
    for name, global_line in (("os_system.pt", b"cos\nsystem\n"), ("posix_system.pt", b"cposix\nsystem\n"),
                              ("builtins_eval.pt", b"cbuiltins\neval\n"), ("subclass.pt", b"c__main__\nEvil\n")):
        with zipfile.ZipFile(os.path.join(d, name)) as z:
            expect(global_line in z.read("m/data.pkl"), "%s names %r" % (name, global_line))
    control = torch.load(os.path.join(d, "control.pt"), weights_only=True)
    expect(list(control) == ["w"] and torch.equal(control["w"], torch.zeros(6)), "control.pt loads as 6 zeros")


def cmd_selftest():
    d = tempfile.mkdtemp(prefix="torch_files_")
    try:
        marker = os.path.join(d, "MARKER")
        cmd_write(os.path.join(d, "good"))
        cmd_malicious(os.path.join(d, "hostile"), marker)
        selftest_good(os.path.join(d, "good"))
        print("hostile files under torch %s's weights_only loader:" % torch.__version__)
        selftest_hostile(os.path.join(d, "hostile"), marker)
        expect(not os.path.exists(marker), "marker created")
    finally:
        shutil.rmtree(d)
    print("selftest ok")
    return 0


def gpt2_masks(tensors, config):
    """The buffers old GPT-2 .bin files carry per block: the causal mask `attn.bias`
    [1, 1, n_positions, n_positions] and the scalar `attn.masked_bias` (-1e4)."""
    n = config["n_positions"]
    prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
    for i in range(config["n_layer"]):
        tensors["%sh.%d.attn.bias" % (prefix, i)] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        tensors["%sh.%d.attn.masked_bias" % (prefix, i)] = torch.tensor(-1e4)


def cmd_hubbin(src, out, shards, masks):
    """A copy of the Hub directory SRC (safetensors) with its weights as
    pytorch_model.bin, or as SHARDS files named by pytorch_model.bin.index.json
    (the layout transformers wrote before safetensors); with MASKS, GPT-2's
    mask buffers added as old GPT-2 files have them."""
    tensors = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(safetensors_io.read_file(path))
    if masks:
        with open(os.path.join(src, "config.json")) as f:
            gpt2_masks(tensors, json.load(f))
    os.makedirs(out, exist_ok=False)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(out, "config.json"))
    names = sorted(tensors)
    if shards <= 1:
        torch.save(collections.OrderedDict((n, tensors[n]) for n in names), os.path.join(out, "pytorch_model.bin"))
        return
    weight_map = {}
    for k in range(shards):
        file = "pytorch_model-%05d-of-%05d.bin" % (k + 1, shards)
        part = names[k::shards]
        torch.save(collections.OrderedDict((n, tensors[n]) for n in part), os.path.join(out, file))
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def resume_model():
    """The model of `train` and `resume`: float64, Linear(4, 8), LayerNorm(8), Tanh, Linear(8, 2)."""
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2)).double()


def fit(model, opt, x, y, steps):
    """`steps` AdamW steps on the whole batch; the loss of each (before its update)."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def cmd_train(out, before, after):
    """Trains BEFORE steps, saves {"model", "optim", "step"} as train64.pt, trains AFTER
    more; writes the batch (data.safetensors) and every step's loss (losses.json)."""
    model = resume_model()
    torch.manual_seed(3)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    os.makedirs(out, exist_ok=True)
    losses = fit(model, opt, x, y, before)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": before},
               os.path.join(out, "train64.pt"))
    losses += fit(model, opt, x, y, after)
    safetensors_io.write_file(os.path.join(out, "data.safetensors"), {"input": x, "target": y})
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"losses": losses}, f)


def cmd_resume(path, data, steps, out):
    """Loads {"model", "optim"} from PATH (written by anyone) into `train`'s model and an
    AdamW whose settings come from the file, trains STEPS steps on DATA, writes the losses."""
    obj, _ = load(path)
    model = resume_model()
    model.load_state_dict(obj["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=123.0)  # every setting comes from the file
    opt.load_state_dict(obj["optim"])
    batch = safetensors_io.read_file(data)
    with open(out, "w") as f:
        json.dump({"losses": fit(model, opt, batch["input"], batch["target"], steps)}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("write").add_argument("dir")
    m = sub.add_parser("malicious")
    m.add_argument("dir")
    m.add_argument("marker")
    c = sub.add_parser("check")
    c.add_argument("file")
    c.add_argument("expected")
    c.add_argument("--key")
    sub.add_parser("selftest")
    h = sub.add_parser("hubbin")
    h.add_argument("src")
    h.add_argument("out")
    h.add_argument("--shards", type=int, default=1)
    h.add_argument("--gpt2-masks", action="store_true")
    t = sub.add_parser("train")
    t.add_argument("out")
    t.add_argument("--before", type=int, default=3)
    t.add_argument("--after", type=int, default=3)
    r = sub.add_parser("resume")
    r.add_argument("file")
    r.add_argument("data")
    r.add_argument("steps", type=int)
    r.add_argument("out")
    a = ap.parse_args()
    if a.cmd == "train":
        cmd_train(a.out, a.before, a.after)
        return 0
    if a.cmd == "resume":
        cmd_resume(a.file, a.data, a.steps, a.out)
        return 0
    if a.cmd == "hubbin":
        cmd_hubbin(a.src, a.out, a.shards, a.gpt2_masks)
        return 0
    if a.cmd == "write":
        cmd_write(a.dir)
        return 0
    if a.cmd == "malicious":
        cmd_malicious(a.dir, a.marker)
        return 0
    if a.cmd == "check":
        return run_check(a.file, a.expected, a.key)
    return cmd_selftest()


if __name__ == "__main__":
    sys.exit(main())

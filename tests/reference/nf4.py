#!/usr/bin/env python3
"""Independent reference of NF4 blockwise quantization with double quantization
(the QLoRA storage format, in bitsandbytes' layout), for src/scaletrain/precision/nf4.h.

  quantize [VALUES... | --in FILE] [--block-size 64] [--no-double-quant]
           [--absmax-block-size 256] [--out FILE]
      The weight, flat, read as fp32: numbers on the command line or a JSON list in FILE.
      Prints (or writes to FILE) JSON: {"n", "block_size", "absmax_block_size",
      "double_quant", "codes": [4-bit index per value], "packed": [bytes],
      "absmax": [fp32 per block, exact], "offset", "absmax_q": [uint8 per block],
      "absmax_scale": [fp32 per absmax block], "absmax_dequant": [fp32 per block],
      "dequant": [fp32 per value]}. Without double quantization "offset",
      "absmax_q" and "absmax_scale" are null and "absmax_dequant" = "absmax".
  batch IN_JSON OUT_JSON
      IN_JSON: {"cases": [{"values": [...], "block_size": 64, "double_quant": true,
      "absmax_block_size": 256}, ...]} (keys other than "values" optional).
      OUT_JSON: {"dynamic_map": [256 values], "results": [the quantize JSON per case]}.
  dynamic-map
      Prints the 256 values of the signed dynamic 8-bit map as a JSON list.
  selftest
      Hand-checked codes and bytes, ties, the decision-tree thresholds, the
      dynamic map's structure, short and odd blocks, error bounds (see below).

The semantics, from bitsandbytes' documented behaviour (quantize_4bit with
quant_type="nf4", compress_statistics=True; create_dynamic_map(signed=True)):
- Blocks of block_size consecutive values of the flat weight (the last one short).
  absmax = max |x| over the block, fp32. s = x * fp32(1 / absmax) in fp32.
- The code of s is the nearest value of an ascending code book, decided by the
  fp32 midpoints of neighbouring values: the count of midpoints strictly below s
  (on a midpoint, the lower code). An all-zero block gets the code of 0.
- Two 4-bit codes per byte, the first value in the high nibble; an odd count is
  padded with the code of 0.
- Double quantization: offset = mean of the block absmax (computed exactly,
  rounded to fp32); absmax - offset quantized the same way in blocks of 256 on
  the dynamic map. Dequantization: map[q] * scale + offset, then nf4[c] * absmax,
  all fp32.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.dont_write_bytecode = True

# The 16 values of the NF4 data type (fp32, as bitsandbytes stores them).
NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
NF4_ZERO = 7

# bitsandbytes' CUDA kernel decides NF4 codes with a decision tree whose 15
# thresholds are these decimal numbers (compared as fp32, x > t goes up).
NF4_TREE_THRESHOLDS = [
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
]


def f32(v):
    """The nearest fp32 value of a Python float, as a Python float."""
    return torch.tensor(v, dtype=torch.float32).item()


def dynamic_map():
    """Signed dynamic 8-bit map: for exponent i = 0..6, the means of 2^i + 1
    boundaries spaced evenly over [0.1, 1] (fp32), times 10^(i-6), both signs;
    plus 0 and 1; ascending."""
    values = [0.0, 1.0]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        pos = (10 ** (i - 6)) * means
        values += pos.tolist() + (-pos).tolist()
    values.sort()
    assert len(values) == 256
    return values


def midpoints(code):
    # Each midpoint of two fp32 values is exact in float64; rounding it once to
    # fp32 gives the fp32 midpoint.
    return torch.tensor([(code[i] + code[i + 1]) / 2 for i in range(len(code) - 1)], dtype=torch.float32)


def nearest(s, code):
    """Index of the nearest code value for each fp32 value of s (lower on a tie)."""
    mids = midpoints(code)
    return (s.reshape(-1, 1) > mids.reshape(1, -1)).sum(dim=1).tolist()


def blockwise(values, code, block):
    """(codes, absmax) of a list of fp32 values."""
    codes, absmax = [], []
    for start in range(0, len(values), block):
        blk = torch.tensor(values[start:start + block], dtype=torch.float32)
        amax = blk.abs().max()
        absmax.append(amax.item())
        if amax.item() == 0:
            codes += nearest(torch.zeros_like(blk), code)
        else:
            inv = torch.tensor(1.0, dtype=torch.float32) / amax
            codes += nearest(blk * inv, code)
    return codes, absmax


def de_blockwise(codes, absmax, code, block):
    out = []
    for b, start in enumerate(range(0, len(codes), block)):
        vals = torch.tensor([code[c] for c in codes[start:start + block]], dtype=torch.float32)
        out += (vals * torch.tensor(absmax[b], dtype=torch.float32)).tolist()
    return out


def pack(codes):
    c = codes + [NF4_ZERO] if len(codes) % 2 else codes
    return [(c[i] << 4) | c[i + 1] for i in range(0, len(c), 2)]


def quantize(values, block_size=64, double_quant=True, absmax_block_size=256):
    values = [f32(v) for v in values]
    codes, absmax = blockwise(values, NF4, block_size)
    out = {"n": len(values), "block_size": block_size, "absmax_block_size": absmax_block_size,
           "double_quant": double_quant, "codes": codes, "packed": pack(codes), "absmax": absmax,
           "offset": None, "absmax_q": None, "absmax_scale": None, "absmax_dequant": absmax}
    if double_quant:
        dmap = dynamic_map()
        offset = f32(math.fsum(absmax) / len(absmax))
        centered = (torch.tensor(absmax, dtype=torch.float32) - offset).tolist()
        q, scale = blockwise(centered, dmap, absmax_block_size)
        deq = (torch.tensor(de_blockwise(q, scale, dmap, absmax_block_size), dtype=torch.float32) + offset).tolist()
        out.update(offset=offset, absmax_q=q, absmax_scale=scale, absmax_dequant=deq)
    out["dequant"] = de_blockwise(codes, out["absmax_dequant"], NF4, block_size)
    return out


# ---------------------------------------------------------------- selftest

def max_half_gap(code):
    """Largest distance from a point of [-1, 1] to its nearest code value."""
    gaps = [(code[i + 1] - code[i]) / 2 for i in range(len(code) - 1)]
    return max(gaps + [code[0] + 1.0, 1.0 - code[-1]])


def selftest():
    checks = 0

    def check(cond, what):
        nonlocal checks
        if not cond:
            raise AssertionError(what)
        checks += 1

    # Code book and thresholds.
    check(len(NF4) == 16 and NF4 == sorted(NF4) and NF4[NF4_ZERO] == 0.0, "nf4 code book shape")
    check(all(f32(v) == v for v in NF4), "nf4 values are fp32")
    mids = midpoints(NF4).tolist()
    check(mids == [f32(t) for t in NF4_TREE_THRESHOLDS], "midpoints = the decision tree's thresholds")

    # Hand-checked block: absmax 1, so s = x. 0.5 lies between 0.4407 and
    # 0.5626, below their midpoint 0.5017: code 12.
    r = quantize([1.0, -1.0, 0.5, 0.0], double_quant=False)
    check(r["codes"] == [15, 0, 12, 7], "codes of [1, -1, 0.5, 0]: %s" % r["codes"])
    check(r["packed"] == [0xF0, 0xC7], "bytes of [1, -1, 0.5, 0]: %s" % r["packed"])
    check(r["absmax"] == [1.0], "absmax")
    check(r["dequant"] == [1.0, -1.0, f32(0.44070982933044434), 0.0], "dequant of the hand block")

    # A value exactly on a midpoint takes the lower code; the next fp32 up the upper one.
    for i, m in enumerate(mids):
        up = torch.nextafter(torch.tensor(m), torch.tensor(2.0)).item()  # the next fp32
        r = quantize([1.0, m, up], double_quant=False)
        check(r["codes"][1:] == [i, i + 1], "tie at midpoint %d (%r): %s" % (i, m, r["codes"]))

    # Values are scaled by the fp32 reciprocal of absmax: 0.11937045 / 3 rounds
    # to the midpoint of codes 7 and 8, 0.11937045 * fp32(1/3) one ulp above it.
    r = quantize([3.0, 0.11937045305967331, -1.83189857006073], double_quant=False)
    check(r["codes"] == [15, 8, 1], "reciprocal scaling: %s" % r["codes"])

    # Scaling: a block of absmax 4 maps 4 to 1, -2 to -0.5 (between -0.5251
    # and -0.3949, nearer the first: code 2), and dequantizes back exactly.
    r = quantize([4.0, -2.0, 0.0, 1.0], double_quant=False)
    check(r["absmax"] == [4.0] and r["codes"][:3] == [15, 2, 7], "scaled block: %s" % r["codes"])

    # The nearest-code rule equals exact nearest (argmin in float64) away from ties.
    g = torch.Generator().manual_seed(1)
    s = torch.rand(20000, generator=g) * 2 - 1
    exact = (s.double().reshape(-1, 1) - torch.tensor(NF4, dtype=torch.float64)).abs().argmin(dim=1).tolist()
    check(nearest(s, NF4) == exact, "nearest = argmin on random values")

    # Dynamic map: structure and hand-computed entries.
    dmap = dynamic_map()
    check(len(set(dmap)) == 256 and dmap == sorted(dmap), "dynamic map ascending, distinct")
    check(dmap[127] == 0.0 and dmap[255] == 1.0, "0 at 127 and 1 at 255")
    check(all(dmap[127 - k] == -dmap[127 + k] for k in range(1, 128)), "negatives mirror positives")
    # (fp32 linspace values: hand values to 1e-7)
    check(abs(dmap[254] - 0.99296875) < 1e-7 and dmap[0] == -dmap[254], "outermost means (0.9859375 + 1) / 2")
    check(abs(dmap[128] - 0.55e-6) < 1e-12, "smallest positive: 10^-6 * (0.1 + 1) / 2")
    for i in range(7):  # 2^i values in decade i
        lo, hi = 0.1 * 10 ** (i - 6), 10 ** (i - 6)
        n = sum(1 for v in dmap[128:255] if lo <= v < hi)
        check(n == 2 ** i, "decade %d holds %d values" % (i, n))
    s = torch.rand(20000, generator=g) * 2 - 1
    exact = (s.double().reshape(-1, 1) - torch.tensor(dmap, dtype=torch.float64)).abs().argmin(dim=1).tolist()
    check(nearest(s, dmap) == exact, "8-bit nearest = argmin on random values")

    # Double quantization by hand: block absmax 1, 2, 3, 4 -> offset 2.5,
    # centered [-1.5, -0.5, 0.5, 1.5], scale 1.5, s = [-1, -1/3, 1/3, 1]:
    # codes 0 (-0.99296875), 255 (1); 1/3 -> 0.1 + 0.0140625 * 16.5 = 0.33203125.
    w = []
    for a in (1.0, 2.0, 3.0, 4.0):
        w += [a] + [0.0] * 63
    r = quantize(w)
    check(r["absmax"] == [1.0, 2.0, 3.0, 4.0] and r["offset"] == 2.5, "block absmax and offset")
    check(r["absmax_scale"] == [1.5] and r["absmax_q"][0] == 0 and r["absmax_q"][3] == 255, "8-bit codes")
    check(abs(dmap[r["absmax_q"][2]] - 0.33203125) < 1e-7 and r["absmax_q"][1] == 254 - r["absmax_q"][2],
          "1/3 -> 0.33203125, -1/3 -> its mirror")
    check(r["absmax_dequant"][3] == 4.0, "1 * 1.5 + 2.5 is exact")
    check(abs(r["absmax_dequant"][0] - (2.5 - 1.5 * 0.99296875)) < 1e-6, "lowest code")

    # Short last block, odd count: absmax over the tail only; the pad nibble is 7.
    r = quantize([0.5] * 64 + [-0.3, 0.15, 0.0], double_quant=False)
    check(r["absmax"] == [0.5, f32(0.3)], "short block absmax")
    check(r["codes"][64:] == [0, 12, 7], "short block codes %s" % r["codes"][64:])
    check(len(r["packed"]) == 34 and r["packed"][-1] & 0xF == NF4_ZERO and r["packed"][-1] >> 4 == 7, "pad nibble")

    # An all-zero block: absmax 0, codes of 0, dequantizes to 0.
    r = quantize([0.0] * 64 + [1.0] * 64)
    check(r["absmax"][0] == 0.0 and r["codes"][:64] == [7] * 64 and r["dequant"][:64] == [0.0] * 64, "zero block")

    # Error bounds on random weights of several sizes (incl. short and odd).
    hg4, hg8 = max_half_gap(NF4), max_half_gap(dmap)
    for n in (64, 1000, 4097, 64 * 300 + 7):
        x = (torch.randn(n, generator=g) * 0.02).tolist()
        for dq in (False, True):
            r = quantize(x, double_quant=dq)
            a, a2 = r["absmax"], r["absmax_dequant"]
            if dq:
                worst = max(abs(a[b] - a2[b]) - (r["absmax_scale"][b // 256] * hg8 * (1 + 1e-6) + 1e-7 * a[b])
                            for b in range(len(a)))
                check(worst <= 0, "absmax bound (n=%d): exceeded by %g" % (n, worst))
            xs = [f32(v) for v in x]
            worst = max(abs(xs[i] - r["dequant"][i]) - (a[i // 64] * hg4 + abs(a[i // 64] - a2[i // 64]) +
                                                      1e-6 * a[i // 64]) for i in range(n))
            check(worst <= 0, "round trip bound (n=%d, double quant %s): exceeded by %g" % (n, dq, worst))
            check(len(r["packed"]) == (n + 1) // 2 and len(a) == -(-n // 64), "sizes n=%d" % n)

    print("nf4.py selftest: %d checks passed" % checks)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("values", nargs="*", type=float)
    q.add_argument("--in", dest="infile")
    q.add_argument("--out")
    q.add_argument("--block-size", type=int, default=64)
    q.add_argument("--absmax-block-size", type=int, default=256)
    q.add_argument("--no-double-quant", action="store_true")
    b = sub.add_parser("batch")
    b.add_argument("infile")
    b.add_argument("outfile")
    sub.add_parser("dynamic-map")
    sub.add_parser("selftest")
    args = p.parse_args(argv)
    if args.cmd == "selftest":
        selftest()
        return 0
    if args.cmd == "batch":
        with open(args.infile) as f:
            cases = json.load(f)["cases"]
        results = [quantize(c["values"], c.get("block_size", 64), c.get("double_quant", True),
                            c.get("absmax_block_size", 256)) for c in cases]
        with open(args.outfile, "w") as f:
            json.dump({"dynamic_map": dynamic_map(), "results": results}, f)
        return 0
    if args.cmd == "dynamic-map":
        print(json.dumps(dynamic_map()))
        return 0
    values = list(args.values)
    if args.infile:
        with open(args.infile) as f:
            values += json.load(f)
    if not values or not all(math.isfinite(v) for v in values):
        print("nf4.py: need at least one value, all finite", file=sys.stderr)
        return 1
    r = quantize(values, args.block_size, not args.no_double_quant, args.absmax_block_size)
    text = json.dumps(r)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

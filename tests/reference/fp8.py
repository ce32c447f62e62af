#!/usr/bin/env python3
"""FP8 (OCP 8-bit floating point: E4M3 and E5M2) by exhaustion, the reference
of src/scaletrain/precision/fp8_format.h.

Every code's value is computed with exact fractions from the format's fields;
a number is encoded by searching the table of finite values for the nearest
one (a tie goes to the value whose significand is even), not by arithmetic on
exponents. Beyond the largest finite value the search also considers the next
value the format would have, and a number that rounds to it overflows:
saturated to the largest finite value, or +-inf (E5M2) / NaN (E4M3, which has
no infinity).

  fp8.py decode E4M3|E5M2            the 256 values, one per line (code order)
  fp8.py encode E4M3|E5M2 [--no-saturate] < numbers   one code per line
  fp8.py selftest
"""
import functools
import math
import sys
from fractions import Fraction

SPECS = {"E4M3": (4, 3, 7, False), "E5M2": (5, 2, 15, True)}


def fields(code, fmt):
    e_bits, m_bits, _, _ = SPECS[fmt]
    return code >> 7, (code >> m_bits) & ((1 << e_bits) - 1), code & ((1 << m_bits) - 1)


def value(code, fmt):
    """Fraction, or 'inf'/'nan' (with the sign applied by the caller)."""
    e_bits, m_bits, bias, has_inf = SPECS[fmt]
    _, e, m = fields(code, fmt)
    top = (1 << e_bits) - 1
    if fmt == "E4M3" and e == top and m == (1 << m_bits) - 1:
        return "nan"
    if has_inf and e == top:
        return "inf" if m == 0 else "nan"
    if e == 0:
        return Fraction(m, 1 << m_bits) * Fraction(2) ** (1 - bias)
    return (1 + Fraction(m, 1 << m_bits)) * Fraction(2) ** (e - bias)


@functools.lru_cache(maxsize=None)
def finite_table(fmt):
    """(value, significand_even, code) for every finite non-negative code, and the next value beyond."""
    _, m_bits, _, _ = SPECS[fmt]
    rows = [(value(c, fmt), fields(c, fmt)[2] % 2 == 0, c) for c in range(128) if not isinstance(value(c, fmt), str)]
    rows.sort()
    largest, _, largest_code = rows[-1]
    # The next value at the largest binade's spacing, and whether its
    # normalized significand would be even.
    _, e, m = fields(largest_code, fmt)
    step = largest - value(largest_code - 1, fmt)
    m_next = m + 1
    even_next = (m_next % (1 << m_bits)) % 2 == 0 if m_next < (1 << m_bits) else True
    return rows, (largest + step, even_next)


def encode(x, fmt, saturate=True):
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return sign | 0x7F
    rows, (beyond, beyond_even) = finite_table(fmt)
    largest_code = rows[-1][2]
    overflow = sign | (largest_code if saturate else (0x7C if SPECS[fmt][3] else 0x7F))
    if math.isinf(x):
        return sign | largest_code if saturate else overflow
    a = Fraction(abs(x))
    candidates = rows + [(beyond, beyond_even, None)]
    best = min(candidates, key=lambda r: (abs(r[0] - a), not r[1]))
    if best[2] is None:
        return overflow
    return sign | best[2]


def decode_line(code, fmt):
    v = value(code & 0x7F, fmt)
    neg = code & 0x80
    if v == "nan":
        return "nan"
    if v == "inf":
        return "-inf" if neg else "inf"
    f = float(v)
    return repr(-f if neg else f)


def selftest():
    assert float(value(0x7E, "E4M3")) == 448.0 and float(value(0x7B, "E5M2")) == 57344.0
    assert float(value(0x01, "E4M3")) == 2.0 ** -9 and float(value(0x01, "E5M2")) == 2.0 ** -16
    assert encode(1.1875, "E4M3") == encode(1.25, "E4M3")
    assert float(value(encode(2.7, "E4M3"), "E4M3")) == 2.75
    assert float(value(encode(2.7, "E5M2"), "E5M2")) == 2.5
    assert encode(2.0 ** -10, "E4M3") == 0
    assert encode(464.0, "E4M3") == 0x7E and encode(470.0, "E4M3", saturate=False) == 0x7F
    assert encode(61440.0, "E5M2", saturate=False) == 0x7C  # the tie goes to 65536's even significand
    print("fp8 reference: ok")


def main(argv):
    if argv[:1] == ["selftest"]:
        return selftest()
    cmd, fmt = argv[0], argv[1]
    if cmd == "decode":
        for c in range(256):
            print(decode_line(c, fmt))
    elif cmd == "encode":
        saturate = "--no-saturate" not in argv
        for line in sys.stdin:
            if line.strip():
                print(encode(float(line), fmt, saturate))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])

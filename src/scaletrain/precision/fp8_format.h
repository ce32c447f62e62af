#pragma once
// FP8 numbers as bytes: the two formats of the OCP 8-bit floating point
// specification, encoded and decoded exactly (torch-free; libtorch 1.13 has no
// float8 dtype, so FP8 storage and wire payloads are uint8 tensors).
//
//   format  sign exp mant  bias  largest finite  smallest subnormal  inf / NaN
//   E4M3    1    4   3     7     448 (S.1111.110)  2^-9              no inf; NaN = S.1111.111
//   E5M2    1    5   2     15    57344             2^-16             inf = S.11111.00; NaN = S.11111.{01,10,11}
//
// Note [FP8 rounding]: encode() rounds to nearest, ties to even (on the
// code's last mantissa bit), with subnormals. A value whose rounding exceeds
// the largest finite value overflows: saturating (the default, as scaled FP8
// training wants) gives +-largest, and so does an infinite input; otherwise
// E5M2 gives +-inf and E4M3, which has none, NaN. NaN stays NaN (the sign is
// kept; payload bits are not). A float's exponent and mantissa go through
// double arithmetic, where every step below is exact.
#include <cmath>
#include <cstdint>

namespace scaletrain::precision {

enum class Fp8Format { E4M3, E5M2 };

struct Fp8Spec {
  int exponent_bits, mantissa_bits, bias;
  bool has_inf;  // E5M2 only
};

constexpr Fp8Spec fp8_spec(Fp8Format f) {
  return f == Fp8Format::E4M3 ? Fp8Spec{4, 3, 7, false} : Fp8Spec{5, 2, 15, true};
}

// The largest finite value: 448 (E4M3) or 57344 (E5M2).
constexpr double fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? 448.0 : 57344.0; }

inline bool fp8_is_nan(uint8_t code, Fp8Format f) {
  const uint8_t magnitude = code & 0x7F;
  return f == Fp8Format::E4M3 ? magnitude == 0x7F : magnitude > 0x7C;
}

inline float fp8_decode(uint8_t code, Fp8Format f) {
  const Fp8Spec s = fp8_spec(f);
  const bool negative = (code & 0x80) != 0;
  const int e = (code >> s.mantissa_bits) & ((1 << s.exponent_bits) - 1);
  const int m = code & ((1 << s.mantissa_bits) - 1);
  double v;
  if (fp8_is_nan(code, f)) {
    v = std::nan("");
  } else if (s.has_inf && e == (1 << s.exponent_bits) - 1) {
    v = INFINITY;
  } else if (e == 0) {  // subnormal: m x 2^(1 - bias - mantissa_bits)
    v = std::ldexp(static_cast<double>(m), 1 - s.bias - s.mantissa_bits);
  } else {
    v = std::ldexp(static_cast<double>((1 << s.mantissa_bits) + m), e - s.bias - s.mantissa_bits);
  }
  return static_cast<float>(negative ? -v : v);
}

inline uint8_t fp8_encode(float x, Fp8Format f, bool saturate = true) {
  const Fp8Spec s = fp8_spec(f);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const uint8_t nan = sign | 0x7F;
  const uint8_t largest = sign | (f == Fp8Format::E4M3 ? 0x7E : 0x7B);
  const uint8_t inf = sign | 0x7C;  // E5M2
  if (std::isnan(x)) return nan;
  const double a = std::fabs(static_cast<double>(x));
  const auto overflow = [&] { return saturate ? largest : (s.has_inf ? inf : nan); };
  if (std::isinf(a)) return saturate ? largest : overflow();
  if (a == 0) return sign;
  // The spacing of representable values around `a` (Note [FP8 rounding]).
  const int min_exponent = 1 - s.bias;  // of the smallest normal, 2^(1 - bias)
  int exponent = std::ilogb(a);         // floor(log2(a))
  if (exponent < min_exponent) exponent = min_exponent;  // subnormals share the smallest normal's spacing
  const double quantum = std::ldexp(1.0, exponent - s.mantissa_bits);
  const double n = std::nearbyint(a / quantum);  // ties to even under the default rounding mode
  const double rounded = n * quantum;
  if (rounded > fp8_max(f)) return overflow();
  if (rounded == 0) return sign;
  // `rounded` is representable: split it into exponent field and mantissa.
  int e = std::ilogb(rounded);
  if (e < min_exponent) {  // subnormal
    const int m = static_cast<int>(std::ldexp(rounded, s.bias - 1 + s.mantissa_bits));
    return static_cast<uint8_t>(sign | m);
  }
  const int m = static_cast<int>(std::ldexp(rounded, s.mantissa_bits - e)) - (1 << s.mantissa_bits);
  return static_cast<uint8_t>(sign | ((e + s.bias) << s.mantissa_bits) | m);
}

}  // namespace scaletrain::precision

#pragma once
// Scalar math for the CPU kernels' element loops, written so that a loop over
// it vectorises: the float exponential of a non-positive argument as a short
// polynomial, and the sigmoid built on it. std::exp is a library call that
// GCC does not vectorise without -ffast-math; these are plain arithmetic and
// integer bit operations. Shared by the fused norm and activation kernels
// (norm_activation.cpp, layer_norm_gelu.cpp) and the tiled attention's
// softmax (attention_detail.h). Not a public API.
#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace scaletrain::kernels::detail {

// Bit views of a float, for the branch-free selections below. The helpers are
// forced inline: a call left in a loop keeps it from being vectorised.
C10_ALWAYS_INLINE int32_t float_bits(float v) { return __builtin_bit_cast(int32_t, v); }
C10_ALWAYS_INLINE float bits_float(int32_t b) { return __builtin_bit_cast(float, b); }

// e^-a in float without a library call, so that loops over it vectorise:
// a = n ln2 + t with integer n and |t| <= ln2 / 2; e^-t from its Taylor
// series to degree 7 (truncation error below 6e-9 relative); 2^-n written
// straight into the exponent bits. Exact to about 1e-7 relative for
// -88 <= a <= 87, where 2^-n is a normal float. For a above about 87.68, n
// is 127 and the exponent bits are 0, so the result is exactly 0 up to
// a = 88; callers clamp a into [-88, 88] (or [0, 87]) first. NaN is not
// handled.
C10_ALWAYS_INLINE float exp_neg(float a) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (a * 1.44269504088896341f + shifter) - shifter;
  const float t = (n * 0.693145751953125f - a) + n * 1.42860682030941723e-6f;  // -(a - n ln2), ln2 in two parts
  float p = 1.0f / 5040;
  p = p * t + 1.0f / 720;
  p = p * t + 1.0f / 120;
  p = p * t + 1.0f / 24;
  p = p * t + 1.0f / 6;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  return p * bits_float((127 - static_cast<int32_t>(n)) << 23);
}

// sigmoid(g) = f / (1 + e) with e = e^-|g| (never overflows), f = 1 for g >= 0
// and f = e for g < 0. Both selections (clamping |g| to 87, where e^-|g| is
// below the smallest normal float anyway, and choosing f) are integer masks:
// GCC does not turn floating-point selections into vector code unless
// -fno-trapping-math is given, and without them the loops stay scalar. A NaN
// argument gives a finite sigmoid here; callers that multiply it by g get
// NaN, as they must.
C10_ALWAYS_INLINE float sigmoid_of(float g) {
  const int32_t bits = float_bits(g);
  int32_t abs_bits = bits & 0x7fffffff;               // |g|, ordered like the float for |g| >= 0
  const int32_t room = float_bits(87.0f) - abs_bits;  // negative when |g| > 87
  abs_bits += room & (room >> 31);                    // min(|g|, 87)
  const float e = exp_neg(bits_float(abs_bits));
  const int32_t negative = bits >> 31;  // all ones when the sign bit is set
  const float f = bits_float((float_bits(e) & negative) | (float_bits(1.0f) & ~negative));
  return f / (1.0f + e);
}
C10_ALWAYS_INLINE double sigmoid_of(double g) { return 1.0 / (1.0 + std::exp(-g)); }

}  // namespace scaletrain::kernels::detail

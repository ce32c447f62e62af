// FP8 encode/decode (src/scaletrain/precision/fp8_format.h) against hand-
// checked values and against tests/reference/fp8.py, which encodes by
// searching the table of every code's exact value (an independent method).
#include "scaletrain/precision/fp8_format.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace scaletrain::precision {
namespace fp8_format_test {

constexpr Fp8Format E4M3 = Fp8Format::E4M3, E5M2 = Fp8Format::E5M2;

float rt(float x, Fp8Format f, bool saturate = true) { return fp8_decode(fp8_encode(x, f, saturate), f); }

TEST(Fp8Format, HandCheckedValues) {
  EXPECT_EQ(rt(1.1875f, E4M3), 1.25f);  // 1.0011b: a tie between 1.001 and 1.010, to the even 1.010
  EXPECT_EQ(rt(-2.7f, E4M3), -2.75f);
  EXPECT_EQ(rt(-2.7f, E5M2), -2.5f);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -10), E4M3), 0);  // half the smallest subnormal: a tie, to zero
  EXPECT_EQ(rt(std::ldexp(1.0f, -9), E4M3), std::ldexp(1.0f, -9));    // the smallest subnormal
  EXPECT_EQ(rt(std::ldexp(1.0f, -16), E5M2), std::ldexp(1.0f, -16));  // likewise
  EXPECT_EQ(rt(std::ldexp(3.0f, -10), E4M3), std::ldexp(1.0f, -8));   // 1.5 x 2^-9: a tie, to the even 2 x 2^-9
  EXPECT_EQ(fp8_decode(0x7E, E4M3), 448.0f);
  EXPECT_EQ(fp8_decode(0x7B, E5M2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x08, E4M3), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(fp8_encode(-0.0f, E4M3), 0x80);
  // Overflow: saturated by default; otherwise E5M2 has inf, E4M3 only NaN.
  EXPECT_EQ(rt(464.0f, E4M3), 448.0f);  // a tie between 448 and 480 (odd), to 448
  EXPECT_EQ(rt(470.0f, E4M3), 448.0f);
  EXPECT_TRUE(std::isnan(rt(470.0f, E4M3, /*saturate=*/false)));
  EXPECT_EQ(rt(1e9f, E5M2), 57344.0f);
  EXPECT_TRUE(std::isinf(rt(61440.0f, E5M2, false)));  // a tie between 57344 and 65536 (even): overflows
  EXPECT_EQ(rt(-INFINITY, E4M3), -448.0f);
  EXPECT_EQ(fp8_decode(0xFC, E5M2), -INFINITY);
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F, E4M3)));
  EXPECT_TRUE(std::isnan(rt(NAN, E5M2)));
}

TEST(Fp8Format, EveryCodeDecodesAndEncodesToItself) {
  for (Fp8Format f : {E4M3, E5M2})
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const float v = fp8_decode(code, f);
      if (fp8_is_nan(code, f)) {
        // NaN payloads are not kept: a NaN of the same sign comes back.
        EXPECT_TRUE(std::isnan(v));
        EXPECT_TRUE(fp8_is_nan(fp8_encode(v, f), f));
        continue;
      }
      // Infinities (E5M2) come back only without saturation.
      EXPECT_EQ(fp8_encode(v, f, /*saturate=*/!std::isinf(v)), code) << "code " << c << " value " << v;
    }
}

// Runs the reference; returns its output lines.
std::vector<std::string> reference(const std::string& args, const std::vector<float>& input = {}) {
  // One input file per process and call: CTest runs the tests of this file
  // as separate processes side by side, and a shared name would race.
  static int calls = 0;
  const std::string in =
      ::testing::TempDir() + "fp8_in." + std::to_string(::getpid()) + "." + std::to_string(calls++) + ".txt";
  std::ofstream(in) << [&] {
    std::string s;
    char buf[64];
    for (float x : input) s += (std::snprintf(buf, sizeof buf, "%.17g\n", x), buf);
    return s;
  }();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/fp8.py " +
                          args + " < " + in;
  std::vector<std::string> lines;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return lines;
  char buf[256];
  while (std::fgets(buf, sizeof buf, p)) lines.emplace_back(std::string(buf, std::strlen(buf) - 1));
  EXPECT_EQ(::pclose(p), 0) << cmd;
  std::remove(in.c_str());
  return lines;
}

TEST(Fp8Format, DecodingEqualsTheReferenceTable) {
  for (auto [f, name] : {std::pair{E4M3, "E4M3"}, std::pair{E5M2, "E5M2"}}) {
    const auto lines = reference(std::string("decode ") + name);
    ASSERT_EQ(lines.size(), 256u) << name;
    for (int c = 0; c < 256; ++c) {
      const float v = fp8_decode(static_cast<uint8_t>(c), f);
      if (lines[c] == "nan")
        EXPECT_TRUE(std::isnan(v)) << name << " code " << c;
      else
        EXPECT_EQ(v, std::stof(lines[c])) << name << " code " << c;
    }
  }
}

TEST(Fp8Format, EncodingEqualsTheReferenceSearch) {
  // Every midpoint between neighbouring codes (the ties), values just beside
  // them, and random magnitudes over the whole range and beyond.
  std::vector<float> xs;
  for (Fp8Format f : {E4M3, E5M2})
    for (int c = 0; c < 127; ++c) {
      const float a = fp8_decode(static_cast<uint8_t>(c), f), b = fp8_decode(static_cast<uint8_t>(c + 1), f);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const float mid = (a + b) / 2;
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
        xs.push_back(x);
        xs.push_back(-x);
      }
    }
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> exponent(-20, 18), mantissa(1, 2);
  for (int i = 0; i < 2000; ++i) xs.push_back((i % 2 ? -1 : 1) * std::ldexp(mantissa(gen), static_cast<int>(exponent(gen))));
  for (auto [f, name] : {std::pair{E4M3, "E4M3"}, std::pair{E5M2, "E5M2"}})
    for (bool saturate : {true, false}) {
      const auto lines = reference(std::string("encode ") + name + (saturate ? "" : " --no-saturate"), xs);
      ASSERT_EQ(lines.size(), xs.size()) << name;
      int wrong = 0;
      for (size_t i = 0; i < xs.size(); ++i)
        if (fp8_encode(xs[i], f, saturate) != std::stoi(lines[i]) && ++wrong <= 5)
          ADD_FAILURE() << name << (saturate ? "" : " non-saturating") << ": " << xs[i] << " -> "
                        << int(fp8_encode(xs[i], f, saturate)) << ", reference " << lines[i];
      EXPECT_EQ(wrong, 0) << name;
    }
}

}  // namespace fp8_format_test
}  // namespace scaletrain::precision

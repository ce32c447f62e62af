// NF4 storage (precision/nf4.h) against hand-checked blocks, against the
// independent Python reference tests/reference/nf4.py (bit for bit), against
// its error bounds, and the frozen NF4 linear layer against dense fp64 math.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "scaletrain/observe/memory.h"
#include "scaletrain/precision/nf4.h"

namespace scaletrain::precision {
namespace nf4_test {

namespace fs = std::filesystem;

NF4Options no_double_quant() {
  NF4Options o;
  o.double_quant = false;
  return o;
}

// The 4-bit code of every value, unpacked from the bytes (high nibble first).
std::vector<int> codes_of(const NF4Weight& w) {
  std::vector<int> out;
  const at::Tensor p = w.packed.cpu();
  for (int64_t i = 0; i < p.numel(); ++i) {
    const int byte = p[i].item<int>();
    out.push_back(byte >> 4);
    out.push_back(byte & 0xF);
  }
  out.resize(w.numel());
  return out;
}

std::vector<int> bytes_of(const NF4Weight& w) {
  std::vector<int> out;
  for (int64_t i = 0; i < w.packed.numel(); ++i) out.push_back(w.packed[i].item<int>());
  return out;
}

at::Tensor f32(std::vector<float> v) { return at::tensor(v); }

// Largest distance from a point of [-1, 1] to its nearest value of `code`.
double max_half_gap(const at::Tensor& code) {
  const auto c = code.to(at::kDouble);
  double g = std::max(c[0].item<double>() + 1.0, 1.0 - c[-1].item<double>());
  for (int64_t i = 0; i + 1 < c.numel(); ++i) g = std::max(g, (c[i + 1] - c[i]).item<double>() / 2);
  return g;
}

TEST(NF4Code, IsTheQloraCodeBook) {
  const std::array<float, 16> expected = {-1.0f,
                                          -0.6961928009986877f,
                                          -0.5250730514526367f,
                                          -0.39491748809814453f,
                                          -0.28444138169288635f,
                                          -0.18477343022823334f,
                                          -0.09105003625154495f,
                                          0.0f,
                                          0.07958029955625534f,
                                          0.16093020141124725f,
                                          0.24611230194568634f,
                                          0.33791524171829224f,
                                          0.44070982933044434f,
                                          0.5626170039176941f,
                                          0.7229568362236023f,
                                          1.0f};
  EXPECT_EQ(nf4_code_values(), expected);
  EXPECT_TRUE(at::equal(nf4_code(), at::tensor(std::vector<float>(expected.begin(), expected.end()))));
}

TEST(NF4Code, DynamicMapStructure) {
  const at::Tensor m = dynamic_map();
  ASSERT_EQ(m.numel(), 256);
  EXPECT_EQ(m.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::all(m.slice(0, 1) > m.slice(0, 0, 255)).item<bool>()) << "ascending and distinct";
  EXPECT_EQ(m[127].item<float>(), 0.0f);
  EXPECT_EQ(m[255].item<float>(), 1.0f);
  for (int k = 1; k < 128; ++k) ASSERT_EQ(m[127 - k].item<float>(), -m[127 + k].item<float>()) << k;
  // 10^-6 * (0.1 + 1) / 2 is the smallest positive; (0.9859375 + 1) / 2 the largest below 1.
  EXPECT_NEAR(m[128].item<double>(), 0.55e-6, 1e-12);
  EXPECT_NEAR(m[254].item<double>(), 0.99296875, 1e-7);
}

// One block [1, -1, 0.5, 0, 0...]: absmax 1, s = x. 0.5 lies between 0.4407
// (12) and 0.5626 (13), below their midpoint 0.5017: code 12. Bytes: 0xF0
// (15, 0), 0xC7 (12, 7), then 0x77.
TEST(NF4Quantize, HandBlockGivesKnownNibbles) {
  std::vector<float> v(64, 0.0f);
  v[0] = 1, v[1] = -1, v[2] = 0.5f;
  const NF4Weight w = nf4_quantize(f32(v), no_double_quant());
  ASSERT_EQ(w.packed.numel(), 32);
  EXPECT_EQ(w.packed.scalar_type(), at::kByte);
  const auto b = bytes_of(w);
  EXPECT_EQ(b[0], 0xF0);
  EXPECT_EQ(b[1], 0xC7);
  for (int i = 2; i < 32; ++i) EXPECT_EQ(b[i], 0x77) << i;
  ASSERT_EQ(w.absmax.numel(), 1);
  EXPECT_EQ(w.absmax[0].item<float>(), 1.0f);
  const at::Tensor d = nf4_dequantize(w);
  EXPECT_EQ(d[2].item<float>(), 0.44070982933044434f);
  EXPECT_EQ(d[1].item<float>(), -1.0f);

  // Scaled: absmax 4 -> s = [1, -0.5, 0, 0.25]: -0.5 is nearer -0.5251 (2)
  // than -0.3949 (3); 0.25 is nearer 0.2461 (10) than 0.3379 (11).
  const NF4Weight s = nf4_quantize(f32({4, -2, 0, 1}), no_double_quant());
  EXPECT_EQ(bytes_of(s), (std::vector<int>{0xF2, 0x7A}));
  EXPECT_EQ(s.absmax[0].item<float>(), 4.0f);
}

// A value exactly on the midpoint of two codes takes the lower code; the next
// fp32 value up takes the upper one (bitsandbytes' "x > threshold" tree).
TEST(NF4Quantize, ExactMidpointTakesLowerCode) {
  const auto& c = nf4_code_values();
  for (int i = 0; i + 1 < 16; ++i) {
    // The midpoint of two fp32 values is exact in double; round it once.
    const float mid = static_cast<float>((static_cast<double>(c[i]) + c[i + 1]) / 2);
    const float up = std::nextafter(mid, 2.0f);
    const auto codes = codes_of(nf4_quantize(f32({1.0f, mid, up}), no_double_quant()));
    EXPECT_EQ(codes[1], i) << "midpoint " << mid;
    EXPECT_EQ(codes[2], i + 1) << "just above midpoint " << mid;
  }
}

TEST(NF4Quantize, FirstValueInHighNibbleAndOddPadding) {
  EXPECT_EQ(bytes_of(nf4_quantize(f32({-1, 1}), no_double_quant())), (std::vector<int>{0x0F}));
  EXPECT_EQ(bytes_of(nf4_quantize(f32({1, -1}), no_double_quant())), (std::vector<int>{0xF0}));
  // Odd count: the last low nibble is the code of 0 (7).
  EXPECT_EQ(bytes_of(nf4_quantize(f32({1, -1, 1}), no_double_quant())), (std::vector<int>{0xF0, 0xF7}));
}

TEST(NF4Quantize, ShortLastBlockHasItsOwnAbsmax) {
  // The tail's values are below 1 so that padding the block with anything but
  // zeros would change its absmax.
  std::vector<float> v(67, 0.5f);
  v[64] = -0.3f, v[65] = 0.15f, v[66] = 0;
  const NF4Weight w = nf4_quantize(f32(v), no_double_quant());
  EXPECT_EQ(w.n_blocks(), 2);
  EXPECT_EQ(w.packed.numel(), 34);
  ASSERT_EQ(w.absmax.numel(), 2);
  EXPECT_EQ(w.absmax[0].item<float>(), 0.5f);
  EXPECT_EQ(w.absmax[1].item<float>(), 0.3f);
  const auto codes = codes_of(w);
  EXPECT_EQ(codes[63], 15);
  EXPECT_EQ((std::vector<int>(codes.begin() + 64, codes.end())), (std::vector<int>{0, 12, 7}));
  EXPECT_EQ(bytes_of(w).back(), 0x77);  // value 0 and the pad nibble
}

// Values are scaled by the fp32 reciprocal of absmax, as bitsandbytes'
// kernels do: with absmax 3, 0.11937045f / 3 rounds to the midpoint between
// codes 7 and 8 (-> 7) but 0.11937045f * fp32(1/3) lands one ulp above it
// (-> 8); -1.8318986f likewise gives 1, not 2.
TEST(NF4Quantize, ScalesByTheFp32Reciprocal) {
  const auto codes = codes_of(nf4_quantize(f32({3.0f, 0.11937045305967331f, -1.83189857006073f}), no_double_quant()));
  EXPECT_EQ(codes[1], 8);
  EXPECT_EQ(codes[2], 1);
}

TEST(NF4Quantize, ZeroBlockStoresZeroCodes) {
  std::vector<float> v(128, 0.0f);
  v[100] = 2;
  const NF4Weight w = nf4_quantize(f32(v));
  const auto codes = codes_of(w);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(codes[i], 7) << i;
  const at::Tensor d = nf4_dequantize(w);
  EXPECT_EQ(at::count_nonzero(d).item<int64_t>(), 1);
  EXPECT_FLOAT_EQ(d[100].item<float>(), 2.0f);
}

// Block absmax 1, 2, 3, 4 -> offset 2.5, centered [-1.5, -0.5, 0.5, 1.5],
// scale 1.5, s = [-1, -1/3, 1/3, 1]: -1 -> code 0 (-0.99296875, the map has
// no -1), 1 -> code 255 (1), 1/3 -> 0.1 + 0.0140625 * 16.5 = 0.33203125.
TEST(NF4DoubleQuant, HandAbsmax) {
  std::vector<float> v(256, 0.0f);
  for (int b = 0; b < 4; ++b) v[64 * b + 5] = (b % 2 ? -1.0f : 1.0f) * (b + 1);
  const NF4Weight w = nf4_quantize(f32(v));
  ASSERT_TRUE(w.double_quant());
  EXPECT_FALSE(w.absmax.defined());
  EXPECT_EQ(w.absmax_offset, 2.5f);
  ASSERT_EQ(w.absmax_scale.numel(), 1);
  EXPECT_EQ(w.absmax_scale[0].item<float>(), 1.5f);
  ASSERT_EQ(w.absmax_q.numel(), 4);
  EXPECT_EQ(w.absmax_q[0].item<int>(), 0);
  EXPECT_EQ(w.absmax_q[3].item<int>(), 255);
  EXPECT_EQ(w.absmax_q[1].item<int>() + w.absmax_q[2].item<int>(), 254);  // mirrored codes
  EXPECT_NEAR(dynamic_map()[w.absmax_q[2].item<int>()].item<double>(), 0.33203125, 1e-7);
  const at::Tensor a = nf4_block_absmax(w);
  EXPECT_EQ(a[3].item<float>(), 4.0f);  // 1 * 1.5 + 2.5, exact
  EXPECT_NEAR(a[0].item<double>(), 2.5 - 1.5 * 0.99296875, 1e-6);
  EXPECT_NEAR(a[2].item<double>(), 2.5 + 1.5 * 0.33203125, 1e-6);
}

// |absmax - absmax'| <= scale of its 256-block * max half-gap of the map.
TEST(NF4DoubleQuant, AbsmaxRoundTripWithinBound) {
  torch::manual_seed(3);
  // 700 blocks (3 absmax blocks, the last short) with absmax spread over 2 decades.
  const at::Tensor x = at::randn({700, 64}) * at::exp(at::randn({700, 1}) * 1.5);
  const NF4Weight dq = nf4_quantize(x);
  const NF4Weight plain = nf4_quantize(x, no_double_quant());
  ASSERT_EQ(dq.absmax_scale.numel(), 3);
  const at::Tensor a = plain.absmax.to(at::kDouble);
  const at::Tensor a2 = nf4_block_absmax(dq).to(at::kDouble);
  const at::Tensor scale = dq.absmax_scale.to(at::kDouble).repeat_interleave(256).slice(0, 0, 700);
  const at::Tensor bound = scale * max_half_gap(dynamic_map()) * (1 + 1e-6) + 1e-7 * a;
  EXPECT_TRUE(at::all((a - a2).abs() <= bound).item<bool>()) << ((a - a2).abs() - bound).max().item<double>();
  // The bound is not vacuous: the error is a visible fraction of it.
  EXPECT_GT(((a - a2).abs() / bound).max().item<double>(), 0.3);
}

// |w - deq(q(w))| <= absmax * max half-gap of the NF4 code + |absmax - absmax'|.
TEST(NF4Quantize, RoundTripWithinBound) {
  torch::manual_seed(4);
  for (bool dqon : {false, true}) {
    for (auto shape : {std::vector<int64_t>{37, 129}, std::vector<int64_t>{64, 64}, std::vector<int64_t>{4097}}) {
      const at::Tensor w = at::randn(shape) * 0.02;
      NF4Options o;
      o.double_quant = dqon;
      const NF4Weight q = nf4_quantize(w, o);
      const NF4Weight plain = nf4_quantize(w, no_double_quant());
      const int64_t n = w.numel();
      const at::Tensor a = plain.absmax.to(at::kDouble).repeat_interleave(64).slice(0, 0, n);
      const at::Tensor a2 = nf4_block_absmax(q).to(at::kDouble).repeat_interleave(64).slice(0, 0, n);
      const at::Tensor err = (w.reshape(-1).to(at::kDouble) - nf4_dequantize(q, at::kDouble).reshape(-1)).abs();
      const at::Tensor bound = a * max_half_gap(nf4_code()) + (a - a2).abs() + 1e-6 * a;
      EXPECT_TRUE(at::all(err <= bound).item<bool>()) << "double quant " << dqon << " n " << n;
      EXPECT_EQ(nf4_dequantize(q).sizes(), w.sizes());
    }
  }
}

TEST(NF4Dequantize, Dtypes) {
  torch::manual_seed(5);
  const NF4Weight q = nf4_quantize(at::randn({16, 100}));
  const at::Tensor f = nf4_dequantize(q, at::kFloat);
  const at::Tensor d = nf4_dequantize(q, at::kDouble);
  const at::Tensor b = nf4_dequantize(q, at::kBFloat16);
  EXPECT_EQ(d.scalar_type(), at::kDouble);
  EXPECT_EQ(b.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(b, f.to(at::kBFloat16))) << "bf16 = the fp32 product rounded";
  EXPECT_TRUE(at::equal(d.to(at::kFloat), f)) << "fp32 = the exact product rounded";
  // fp64 is the exact product code * absmax of the two fp32 factors.
  const auto codes = codes_of(q);
  const at::Tensor a = nf4_block_absmax(q).to(at::kDouble);
  for (int64_t i : {0, 63, 64, 777, 1599})
    EXPECT_EQ(d.reshape(-1)[i].item<double>(),
              static_cast<double>(nf4_code_values()[codes[i]]) * a[i / 64].item<double>());
  EXPECT_THROW(nf4_dequantize(q, at::kInt), std::invalid_argument);
}

TEST(NF4Weight, ByteCount) {
  const at::Tensor w = at::randn({256, 256});
  const NF4Weight dq = nf4_quantize(w);
  const NF4Weight plain = nf4_quantize(w, no_double_quant());
  // 65536 values: 32768 bytes of codes, 1024 blocks.
  EXPECT_EQ(plain.nbytes(), 32768 + 1024 * 4);
  EXPECT_EQ(dq.nbytes(), 32768 + 1024 + 4 * 4 + 4);
  EXPECT_EQ(dq.nbytes(), dq.packed.nbytes() + dq.absmax_q.nbytes() + dq.absmax_scale.nbytes() + 4);
  EXPECT_EQ(dq.shape, (std::vector<int64_t>{256, 256}));
  EXPECT_EQ(dq.block_size, 64);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no std::invalid_argument)";
}

TEST(NF4Quantize, RefusesBadInput) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<std::function<void()>, std::string>> cases = {
      {[] { nf4_quantize(at::empty({0, 4})); }, "empty"},
      {[] { nf4_quantize(at::Tensor()); }, "empty"},
      {[] { nf4_quantize(at::ones({4}, at::kInt)); }, "floating point"},
      {[] { nf4_quantize(at::ones({4}, at::kBool)); }, "floating point"},
      {[] { nf4_quantize(f32({1, NAN, 2})); }, "1 non-finite"},
      {[inf] { nf4_quantize(f32({inf, -inf, 2})); }, "2 non-finite"},
      {[] { nf4_quantize(at::full({3}, 1e300, at::kDouble)); }, "beyond the fp32 range"},
      {[] {
         NF4Options o;
         o.block_size = 63;
         nf4_quantize(at::ones({4}), o);
       },
       "block_size"},
  };
  for (const auto& [f, expect] : cases) {
    const std::string msg = error_of(f);
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_NE(msg.find("nf4_quantize"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // bf16 and fp64 inputs are accepted (read as fp32).
  EXPECT_NO_THROW(nf4_quantize(at::ones({8}, at::kBFloat16)));
  EXPECT_NO_THROW(nf4_quantize(at::ones({8}, at::kDouble)));
}

// ---- agreement with tests/reference/nf4.py

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("st_nf4_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<double> as_doubles(const at::Tensor& t) {
  const at::Tensor c = t.reshape(-1).to(at::kDouble).contiguous().cpu();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

std::vector<int> as_ints(const at::Tensor& t) {
  const at::Tensor c = t.reshape(-1).to(at::kInt).contiguous().cpu();
  return std::vector<int>(c.data_ptr<int>(), c.data_ptr<int>() + c.numel());
}

TEST(NF4Reference, AgreesBitForBit) {
  if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0)
    GTEST_SKIP() << "needs Debian's python3-torch (scripts/install-deps.sh)";
  struct Case {
    at::Tensor values;
    NF4Options options;
  };
  torch::manual_seed(7);
  std::vector<Case> cases;
  auto add = [&](at::Tensor v, int64_t block, bool dq) {
    NF4Options o;
    o.block_size = block;
    o.double_quant = dq;
    cases.push_back({v.to(at::kFloat), o});
  };
  // Sizes: one block, several, a non-multiple of 64 (odd), more than 256
  // blocks (two absmax blocks, the last short); normal and heavy-tailed.
  for (bool dq : {true, false}) {
    add(at::randn({64}), 64, dq);
    add(at::randn({1000}) * 0.02, 64, dq);
    add(at::randn({4097}).pow(3), 64, dq);
    add(at::randn({64 * 300 + 7}) * at::rand({64 * 300 + 7}), 64, dq);
  }
  add(at::randn({1000}), 128, true);
  add(at::randn({130}), 2, false);

  const fs::path dir = scratch_dir("reference");
  nlohmann::json in;
  for (const auto& c : cases)
    in["cases"].push_back({{"values", as_doubles(c.values)},
                           {"block_size", c.options.block_size},
                           {"double_quant", c.options.double_quant}});
  std::ofstream(dir / "in.json") << in.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/nf4.py batch " +
                          (dir / "in.json").string() + " " + (dir / "out.json").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  nlohmann::json out;
  std::ifstream(dir / "out.json") >> out;

  EXPECT_EQ(out["dynamic_map"].get<std::vector<double>>(), as_doubles(dynamic_map()));
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE("case " + std::to_string(k) + ", n " + std::to_string(cases[k].values.numel()));
    const auto& r = out["results"][k];
    const NF4Weight w = nf4_quantize(cases[k].values, cases[k].options);
    EXPECT_EQ(r["packed"].get<std::vector<int>>(), as_ints(w.packed));
    EXPECT_EQ(r["codes"].get<std::vector<int>>(), codes_of(w));
    if (w.double_quant()) {
      EXPECT_EQ(r["offset"].get<double>(), w.absmax_offset);
      EXPECT_EQ(r["absmax_q"].get<std::vector<int>>(), as_ints(w.absmax_q));
      EXPECT_EQ(r["absmax_scale"].get<std::vector<double>>(), as_doubles(w.absmax_scale));
    } else {
      EXPECT_EQ(r["absmax"].get<std::vector<double>>(), as_doubles(w.absmax));
    }
    EXPECT_EQ(r["absmax_dequant"].get<std::vector<double>>(), as_doubles(nf4_block_absmax(w)));
    EXPECT_EQ(r["dequant"].get<std::vector<double>>(), as_doubles(nf4_dequantize(w)));
  }
  fs::remove_all(dir);
}

// ---- nf4_linear

TEST(NF4Linear, ForwardIsXTimesDequantizedWeight) {
  torch::manual_seed(8);
  const NF4Weight q = nf4_quantize(at::randn({24, 80}) * 0.05);
  for (auto dtype : {at::kDouble, at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor x = at::randn({2, 3, 80}).to(dtype);
    const at::Tensor b = at::randn({24}).to(dtype);
    const at::Tensor W = nf4_dequantize(q, dtype);
    EXPECT_TRUE(at::equal(nf4_linear(x, q, b), at::linear(x, W, b)));
    EXPECT_TRUE(at::equal(nf4_linear(x, q), at::linear(x, W)));
    EXPECT_EQ(nf4_linear(x, q).sizes(), (std::vector<int64_t>{2, 3, 24}));
  }
  // fp64 against the product written out.
  const at::Tensor x = at::randn({5, 80}, at::kDouble);
  const at::Tensor W = nf4_dequantize(q, at::kDouble);
  EXPECT_TRUE(at::allclose(nf4_linear(x, q), (x.unsqueeze(1) * W.unsqueeze(0)).sum(-1), 1e-12, 1e-12));
}

TEST(NF4Linear, BackwardGivesDxAndBiasGradOnly) {
  torch::manual_seed(9);
  const NF4Weight q = nf4_quantize(at::randn({24, 80}) * 0.05);
  const at::Tensor x = at::randn({2, 3, 80}, at::kDouble).requires_grad_();
  const at::Tensor b = at::randn({24}, at::kDouble).requires_grad_();
  const at::Tensor g = at::randn({2, 3, 24}, at::kDouble);
  (nf4_linear(x, q, b) * g).sum().backward();

  // Dense reference: the same weight as an fp64 leaf that needs no gradient.
  const at::Tensor W = nf4_dequantize(q, at::kDouble);
  const at::Tensor xr = x.detach().clone().requires_grad_();
  const at::Tensor br = b.detach().clone().requires_grad_();
  (at::matmul(xr, W.t()).add(br) * g).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(at::allclose(x.grad(), xr.grad(), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(x.grad(), at::matmul(g, W), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(b.grad(), g.reshape({-1, 24}).sum(0), 1e-12, 1e-12));
  // The quantized weight's tensors are plain data: no gradient anywhere.
  for (const at::Tensor& t : {q.packed, q.absmax_q, q.absmax_scale}) {
    EXPECT_FALSE(t.requires_grad());
    EXPECT_FALSE(t.grad().defined());
  }

  // A bias without requires_grad gets none; x alone works without a bias.
  const at::Tensor x2 = x.detach().clone().requires_grad_();
  const at::Tensor b2 = b.detach().clone();
  (nf4_linear(x2, q, b2) * g).sum().backward();
  EXPECT_FALSE(b2.grad().defined());
  EXPECT_TRUE(at::allclose(x2.grad(), xr.grad(), 1e-12, 1e-12));
  const at::Tensor x3 = x.detach().clone().requires_grad_();
  (nf4_linear(x3, q) * g).sum().backward();
  EXPECT_TRUE(at::allclose(x3.grad(), xr.grad(), 1e-12, 1e-12));
}

// Between forward and backward the graph holds the quantized weight only: the
// dense weight (here 1 MiB of fp64) is freed when forward returns.
TEST(NF4Linear, DenseWeightDoesNotOutliveItsUse) {
  torch::manual_seed(10);
  const NF4Weight q = nf4_quantize(at::randn({256, 512}) * 0.05);
  const int64_t dense_bytes = 256 * 512 * 8;
  const at::Tensor x = at::randn({4, 512}, at::kDouble).requires_grad_();
  const at::Tensor b = at::randn({256}, at::kDouble).requires_grad_();
  ASSERT_TRUE(observe::TensorBytes::install()) << "libtorch kept another CPU allocator";
  const int64_t before = observe::TensorBytes::current();
  observe::TensorBytes::reset_peak();
  at::Tensor y = nf4_linear(x, q, b);
  const int64_t held = observe::TensorBytes::current() - before;
  EXPECT_GE(observe::TensorBytes::peak() - before, dense_bytes) << "the counter sees the dequantized weight";
  EXPECT_LT(held, dense_bytes / 4) << "bytes still held after forward: " << held;
  EXPECT_LE(held, static_cast<int64_t>(y.nbytes()) + 4096);
  observe::TensorBytes::reset_peak();
  y.sum().backward();
  EXPECT_GE(observe::TensorBytes::peak() - before, dense_bytes) << "backward dequantizes again";
  y = at::Tensor();
  EXPECT_LE(observe::TensorBytes::current() - before,
            static_cast<int64_t>(x.grad().nbytes() + b.grad().nbytes()) + 4096);
}

TEST(NF4Linear, RefusesMismatchedShapes) {
  const NF4Weight q = nf4_quantize(at::randn({8, 16}));
  const at::Tensor x = at::randn({3, 16});
  EXPECT_NE(error_of([&] { nf4_linear(at::randn({3, 15}), q); }).find("[..., 16]"), std::string::npos);
  EXPECT_NE(error_of([&] { nf4_linear(x, q, at::randn({7})); }).find("bias must be [8]"), std::string::npos);
  EXPECT_NE(error_of([&] { nf4_linear(x, q, at::randn({8}, at::kDouble)); }).find("bias"), std::string::npos);
  EXPECT_NE(error_of([&] { nf4_linear(x, nf4_quantize(at::randn({2, 4, 4}))); }).find("2-D"), std::string::npos);
  EXPECT_NE(error_of([&] { nf4_linear(x.to(at::kInt), q); }).find("nf4_linear"), std::string::npos);
}

}  // namespace nf4_test
}  // namespace scaletrain::precision

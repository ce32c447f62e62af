// Tests of the torch-free safetensors reader and writer: round trips, the
// byte-exact layout of the Rust implementation, and one crafted file per
// class of malformed input, each of which must be refused with
// SafetensorsError (and nothing else).
#include "scaletrain/checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace scaletrain::checkpoint;

namespace safetensors_test {

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("st_safetensors_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// u64 little-endian header length, the header, the data (no padding added).
std::string make_file(const std::string& header, const std::string& data = "", uint64_t n = UINT64_MAX) {
  if (n == UINT64_MAX) n = header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

SafetensorsView parse(const std::string& bytes) { return SafetensorsView::parse(bytes.data(), bytes.size(), "t"); }

// Expects `bytes` to be refused with a SafetensorsError whose message
// contains `needle`.
void expect_reject(const std::string& bytes, const std::string& needle) {
  try {
    parse(bytes);
    ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("safetensors t: ", 0), 0u) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

// A one-tensor header.
std::string one(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"a":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

std::vector<float> kFloats = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f};

// A file with several dtypes and metadata, for the sweeps.
std::string sample_file() {
  static const std::vector<int64_t> i64 = {-1, 7};
  static const std::vector<uint8_t> b = {1, 0, 1};
  static const std::vector<uint16_t> h = {0x3c00, 0x4000};
  return serialize_safetensors({{"w", Dtype::F32, {2, 3}, kFloats.data(), 24},
                                {"step", Dtype::I64, {2}, i64.data(), 16},
                                {"mask", Dtype::BOOL, {3}, b.data(), 3},
                                {"h", Dtype::F16, {2}, h.data(), 4},
                                {"empty", Dtype::F32, {0, 4}, nullptr, 0}},
                               {{"format", "pt"}, {"note", "x"}});
}

TEST(Safetensors, RoundTripThroughFile) {
  TempDir dir;
  const std::vector<int32_t> ints = {1, -2, 3};
  const std::vector<uint8_t> mask = {1, 0};
  const double scalar = 2.5;
  const std::string path = dir.file("m.safetensors");
  write_safetensors(path,
                    {{"z.ints", Dtype::I32, {3}, ints.data(), 12},
                     {"a.w", Dtype::F32, {2, 3}, kFloats.data(), 24},
                     {"mask", Dtype::BOOL, {2}, mask.data(), 2},
                     {"scalar", Dtype::F64, {}, &scalar, 8}},
                    {{"format", "pt"}, {"step", "10"}});
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 1) << "temp file left";

  SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.metadata(), (Metadata{{"format", "pt"}, {"step", "10"}}));
  const TensorView& w = f.at("a.w");
  EXPECT_EQ(w.dtype, Dtype::F32);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w.numel(), 6);
  EXPECT_EQ(std::vector<float>(w.as<float>(), w.as<float>() + 6), kFloats);
  EXPECT_EQ(std::vector<int32_t>(f.at("z.ints").as<int32_t>(), f.at("z.ints").as<int32_t>() + 3), ints);
  EXPECT_EQ(f.at("mask").as<uint8_t>()[0], 1);
  EXPECT_EQ(f.at("scalar").numel(), 1);
  EXPECT_EQ(*f.at("scalar").as<double>(), 2.5);
  EXPECT_THROW(f.at("missing"), SafetensorsError);
  EXPECT_THROW(w.as<int32_t>(), SafetensorsError);

  SafetensorsFile moved(std::move(f));  // views survive a move of the owner
  EXPECT_EQ(moved.at("a.w").as<float>()[5], 5.f);
}

// Byte-exact against the Rust implementation's own test vectors
// (safetensors/src/tensor.rs: test_serialization, test_empty,
// test_serialization_forced_alignement).
TEST(Safetensors, MatchesRustLayout) {
  const std::string data(reinterpret_cast<const char*>(kFloats.data()), 24);
  EXPECT_EQ(serialize_safetensors({{"attn.0", Dtype::F32, {1, 2, 3}, kFloats.data(), 24}}),
            make_file(R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})", data));
  EXPECT_EQ(serialize_safetensors({{"attn0", Dtype::F32, {1, 1, 2, 3}, kFloats.data(), 24}}),
            make_file(R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}       )", data));
  EXPECT_EQ(serialize_safetensors({}), make_file("{}      "));
  EXPECT_EQ(serialize_safetensors({}, {{"framework", "pt"}}), make_file(R"({"__metadata__":{"framework":"pt"}}     )"));
}

// The committed fuzz seeds were written by an independent Python script that
// follows the Rust layout; the writer must reproduce them byte for byte.
TEST(Safetensors, SeedCorpusIsCanonical) {
  int seen = 0;
  const fs::path corpus = fs::path(SCALETRAIN_SOURCE_DIR) / "fuzz" / "corpus" / "safetensors";
  for (const auto& entry : fs::directory_iterator(corpus)) {
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const SafetensorsView v = parse(bytes);
    std::vector<TensorRef> refs;
    for (const TensorView& t : v.tensors()) refs.push_back({t.name, t.dtype, t.shape, t.data, t.nbytes});
    EXPECT_EQ(serialize_safetensors(refs, v.metadata()), bytes) << entry.path();
    ++seen;
  }
  EXPECT_GE(seen, 5);
}

TEST(Safetensors, WriteOrderIsDtypeThenNameAndDeterministic) {
  const uint8_t u8 = 1;
  const int64_t i64 = 2;
  const float f32[2] = {3, 4};
  const std::vector<TensorRef> a = {{"b", Dtype::U8, {1}, &u8, 1},
                                    {"c", Dtype::F32, {2}, f32, 8},
                                    {"a", Dtype::F32, {1}, f32, 4},
                                    {"d", Dtype::I64, {1}, &i64, 8}};
  const std::vector<TensorRef> b = {a[3], a[1], a[0], a[2]};
  const std::string bytes = serialize_safetensors(a, {{"k", "v"}});
  EXPECT_EQ(bytes, serialize_safetensors(b, {{"k", "v"}}));
  const SafetensorsView v = parse(bytes);
  std::vector<std::string> names;
  for (const TensorView& t : v.tensors()) {
    names.push_back(t.name);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype), 0u) << t.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"d", "a", "c", "b"}));
  EXPECT_EQ(bytes.size() % 8, (8 + 8 + 4 + 8 + 1) % 8);  // header padded to 8
}

TEST(Safetensors, AcceptsEdgeCases) {
  EXPECT_TRUE(parse(make_file("{}")).tensors().empty());
  EXPECT_TRUE(parse(make_file(R"({"__metadata__":null})")).metadata().empty());
  const auto v = parse(make_file(R"( {"a":{"extra":[{"x":[1]}],"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                                 R"("b":{"dtype":"U8","shape":[],"data_offsets":[0,1]}} )",
                                 "x"));
  EXPECT_EQ(v.at("a").nbytes, 0u);
  EXPECT_NE(v.at("a").data, nullptr);
  EXPECT_EQ(v.at("b").as<uint8_t>()[0], 'x');
  EXPECT_EQ(parse(make_file(one("U8", "[1]", "[0,1]") + "\n", "y")).at("a").nbytes, 1u);
  // Tensors out of offset order in the header are fine.
  EXPECT_EQ(parse(make_file(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                            R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                            "AB"))
                .at("b")
                .data[0],
            'B');
}

TEST(Safetensors, MisalignedTypedAccessThrows) {
  const auto v = parse(make_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}}   )",
                                 std::string(5, '\0')));
  EXPECT_THROW(v.at("b").as<float>(), SafetensorsError);
}

// --- one test per rejection class ---

TEST(SafetensorsReject, FileShorterThan8Bytes) {
  expect_reject("", "too short");
  expect_reject(std::string(7, '\0'), "7 bytes, too short");
}

TEST(SafetensorsReject, HeaderLengthPastEndOfFile) { expect_reject(make_file("{}", "", 100), "runs past the end"); }

TEST(SafetensorsReject, HeaderLengthAboveLimit) {
  expect_reject(make_file("{}", "", 100'000'001), "exceeds the limit");
  expect_reject(make_file("{}", "", UINT64_MAX - 3), "exceeds the limit");  // n + 8 would wrap
}

TEST(SafetensorsReject, InvalidUtf8) {
  expect_reject(make_file("{\"\xff\":1}"), "not valid UTF-8 at byte 2");
  expect_reject(make_file("{\"\xc0\xaf\":1}"), "not valid UTF-8");          // overlong '/'
  expect_reject(make_file("{\"\xed\xa0\x80\":1}"), "not valid UTF-8");      // surrogate
  expect_reject(make_file("{\"\xf4\x90\x80\x80\":1}"), "not valid UTF-8");  // above U+10FFFF
  expect_reject(make_file("{\"\xe2\x82"), "not valid UTF-8");               // cut sequence
}

TEST(SafetensorsReject, InvalidJson) {
  expect_reject(make_file(R"({"a":)"), "not valid JSON");
  expect_reject(make_file(R"({} x)"), "not valid JSON");
  expect_reject(make_file(R"({"a" 1})"), "not valid JSON");
  expect_reject(make_file(""), "not valid JSON");
  // nlohmann alone would stop at a NUL byte and accept "{}\0junk".
  expect_reject(make_file(std::string("{}\0junk", 7)), "not valid JSON: NUL byte at byte 2");
}

TEST(SafetensorsReject, HeaderNotAnObject) {
  expect_reject(make_file("[]"), "not a JSON object");
  expect_reject(make_file("5"), "not a JSON object");
  expect_reject(make_file(R"("x")"), "not a JSON object");
  expect_reject(make_file(R"({"a":[1]})"), "tensor 'a': entry is an array");
  expect_reject(make_file(R"({"a":{"dtype":1,"shape":[],"data_offsets":[0,1]}})", "x"), "dtype is a number");
}

TEST(SafetensorsReject, UnknownDtype) {
  expect_reject(make_file(one("F33", "[1]", "[0,4]"), "xxxx"), "unknown dtype 'F33'");
  expect_reject(make_file(one("f32", "[1]", "[0,4]"), "xxxx"), "unknown dtype");
}

TEST(SafetensorsReject, NegativeOrNonIntegerShape) {
  expect_reject(make_file(one("U8", "[-1]", "[0,0]")), "negative dimension -1");
  expect_reject(make_file(one("U8", "[1.5]", "[0,0]")), "shape entry is a non-integer number");
  expect_reject(make_file(one("U8", "[1e2]", "[0,100]"), std::string(100, 'x')), "non-integer");
  expect_reject(make_file(one("U8", "2", "[0,2]"), "xx"), "shape is a number");
  expect_reject(make_file(one("U8", "[[1]]", "[0,1]"), "x"), "shape entry is an array");
}

TEST(SafetensorsReject, IntegerOverflow) {
  expect_reject(make_file(one("U8", "[4294967296,4294967296,2]", "[0,0]")), "overflows 64 bits");
  expect_reject(make_file(one("F64", "[2305843009213693952]", "[0,0]")), "overflows 64 bits");
  expect_reject(make_file(one("U8", "[9223372036854775808,0]", "[0,0]")), "overflows int64");
  expect_reject(make_file(one("U8", "[1]", "[0,18446744073709551616]")), "non-integer");  // > u64: parsed as float
}

TEST(SafetensorsReject, ShapeDoesNotMatchByteSpan) {
  expect_reject(make_file(one("F32", "[2]", "[0,4]"), "xxxx"), "needs 8 bytes but data_offsets span 4");
  expect_reject(make_file(one("F32", "[1]", "[4,0]"), "xxxx"), "end before they begin");
}

TEST(SafetensorsReject, OffsetsOverlap) {
  expect_reject(make_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                          "xxxxxx"),
                "tensor 'b': data overlaps tensor 'a'");
  expect_reject(make_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                          "xxxx"),
                "overlaps");
}

TEST(SafetensorsReject, OffsetsLeaveGap) {
  expect_reject(make_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[5,9]}})",
                          "xxxxxxxxx"),
                "gap of 1 bytes after tensor 'a'");
}

TEST(SafetensorsReject, OffsetsDoNotStartAtZero) {
  expect_reject(make_file(one("U8", "[4]", "[4,8]"), "xxxxxxxx"), "does not start at offset 0");
}

TEST(SafetensorsReject, TrailingBytesOrShortData) {
  expect_reject(make_file(one("U8", "[4]", "[0,4]"), "xxxxx"), "1 trailing bytes");
  expect_reject(make_file("{}", "x"), "1 trailing bytes");
  expect_reject(make_file(one("U8", "[4]", "[0,4]"), "xxx"), "data section is only 3 bytes");
}

TEST(SafetensorsReject, DuplicateNames) {
  expect_reject(make_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                          "xx"),
                "duplicate key 'a'");
  expect_reject(make_file(R"({"__metadata__":{},"__metadata__":{}})"), "duplicate key '__metadata__'");
  expect_reject(make_file(R"({"__metadata__":{"k":"1","k":"2"}})"), "duplicate __metadata__ key 'k'");
  expect_reject(make_file(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "x"),
                "duplicate field 'dtype'");
}

TEST(SafetensorsReject, NonStringMetadata) {
  expect_reject(make_file(R"({"__metadata__":{"k":1}})"), "__metadata__ value of 'k' is a number, not a string");
  expect_reject(make_file(R"({"__metadata__":{"k":{"x":"y"}}})"), "is an object, not a string");
  expect_reject(make_file(R"({"__metadata__":{"k":null}})"), "is null, not a string");
  expect_reject(make_file(R"({"__metadata__":["k"]})"), "__metadata__ is an array, not an object");
}

TEST(SafetensorsReject, MalformedTensorEntry) {
  expect_reject(make_file(R"({"a":{"dtype":"U8","shape":[1]}})"), "missing field \"data_offsets\"");
  expect_reject(make_file(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "x"), "missing field \"dtype\"");
  expect_reject(make_file(one("U8", "[1]", "[0,1,2]"), "x"), "data_offsets must have 2 entries");
  expect_reject(make_file(one("U8", "[1]", "[1]"), "x"), "data_offsets must have 2 entries, got 1");
  expect_reject(make_file(one("U8", "[0]", "[-1,0]")), "negative data offset");
}

TEST(SafetensorsReject, TruncatedAtEveryOffset) {
  const std::string full = sample_file();
  ASSERT_NO_THROW(parse(full));
  for (std::size_t len = 0; len < full.size(); ++len) {
    const std::vector<char> prefix(full.begin(), full.begin() + len);  // exact-size buffer
    EXPECT_THROW(SafetensorsView::parse(prefix.data(), prefix.size(), "t"), SafetensorsError) << "length " << len;
  }
}

TEST(SafetensorsReject, CorruptedBytesOnlyEverGiveSafetensorsError) {
  const std::string full = sample_file();
  for (std::size_t i = 0; i < full.size(); ++i) {
    for (const unsigned char mask : {0x01, 0x20, 0x80, 0xff}) {
      std::string bad = full;
      bad[i] = static_cast<char>(bad[i] ^ mask);
      try {
        const SafetensorsView v = parse(bad);
        for (const TensorView& t : v.tensors()) ASSERT_EQ(t.nbytes, t.numel() * dtype_size(t.dtype));
      } catch (const SafetensorsError&) {
      }
    }
  }
}

TEST(SafetensorsFile, OpenErrorsNameThePath) {
  TempDir dir;
  try {
    SafetensorsFile f(dir.file("missing.safetensors"));
    ADD_FAILURE();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors: no such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SafetensorsFile f(dir.path().string()), SafetensorsError);
  std::ofstream(dir.file("short")) << "abc";
  try {
    SafetensorsFile f(dir.file("short"));
    ADD_FAILURE();
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("short: file is 3 bytes, too short"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsWriter, RejectsBadRequestsAndLeavesNoFile) {
  TempDir dir;
  const float x[2] = {1, 2};
  const std::string path = dir.file("bad.safetensors");
  auto expect_bad = [&](const std::vector<TensorRef>& ts, const Metadata& md, const std::string& needle) {
    try {
      write_safetensors(path, ts, md);
      ADD_FAILURE() << "accepted; expected " << needle;
    } catch (const SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(path));
  };
  expect_bad({{"a", Dtype::F32, {2}, x, 8}, {"a", Dtype::F32, {2}, x, 8}}, {}, "duplicate tensor name 'a'");
  expect_bad({{"a", Dtype::F32, {3}, x, 8}}, {}, "needs 12 bytes, got 8");
  expect_bad({{"a", Dtype::F32, {-2}, x, 8}}, {}, "negative dimension");
  expect_bad({{"__metadata__", Dtype::F32, {2}, x, 8}}, {}, "reserved");
  expect_bad({{"\xff", Dtype::F32, {2}, x, 8}}, {}, "not valid UTF-8");
  expect_bad({}, {{"k", "\xc3"}}, "not valid UTF-8");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 0);
}

TEST(SafetensorsWriter, EscapesNamesAndRoundTripsUnicode) {
  const uint8_t b = 7;
  const std::string name = "q\"uote\\ \xc3\xa9 \n";
  const auto v = parse(serialize_safetensors({{name, Dtype::U8, {1}, &b, 1}}, {{"\xe2\x82\xac", "\t"}}));
  EXPECT_EQ(v.at(name).as<uint8_t>()[0], 7);
  EXPECT_EQ(v.metadata().at("\xe2\x82\xac"), "\t");
}

}  // namespace safetensors_test

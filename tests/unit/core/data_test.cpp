// Tests of the torch-free data pipeline (tokenizer, token file, dataset,
// sampler) and the metrics plot.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/data/token_file.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/plot.h"  // apps/scaletrain/plot.h: the CLI's pictures
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using namespace scaletrain;
using namespace scaletrain::data;

namespace data_test {

// A fresh directory per test, removed afterwards (RAII, like the code under test).
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("st_data_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Expects a UsageError whose message contains every string in `needles`.
template <typename F>
void expect_usage_error(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "expected UsageError";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
}

std::vector<uint16_t> iota_tokens(std::size_t n, uint32_t vocab) {
  std::vector<uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i % vocab);
  return t;
}


// ---------------------------------------------------------------- tokenizer

TEST(TokenizerTest, RoundTripsAllBytes) {
  ByteTokenizer tok;
  std::string text = "hello, world\n";
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "\xE2\x82\xAC";  // UTF-8 euro sign: three high bytes
  const auto ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'h');
  EXPECT_EQ(ids[ids.size() - 3], 0xE2);  // no sign extension
  for (auto id : ids) EXPECT_LT(id, ByteTokenizer::kVocabSize);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.vocab_size(), 256u);
}

TEST(TokenizerTest, OutOfVocabIdsDecodeAsPlaceholder) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.decode(std::vector<uint16_t>{'a', 256, 'b', 65535}), "a?b?");
  EXPECT_TRUE(tok.encode("").empty());
}

// --------------------------------------------------------------- token file

TEST(TokenFileTest, RoundTrip) {
  TempDir dir;
  const auto path = dir.file("t.bin");
  const auto tokens = iota_tokens(1000, 300);
  write_token_file(path, tokens, 300);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));
  EXPECT_EQ(fs::file_size(path), kTokenFileHeaderBytes + 2 * tokens.size());
  const std::string raw = read_raw(path);
  EXPECT_EQ(raw.substr(0, 8), "STTOKENS");

  TokenFile f(path);
  EXPECT_EQ(f.size(), tokens.size());
  EXPECT_EQ(f.vocab(), 300u);
  EXPECT_TRUE(std::equal(tokens.begin(), tokens.end(), f.data()));

  TokenFile moved(std::move(f));  // the mapping moves with the object
  EXPECT_EQ(moved.size(), tokens.size());
  EXPECT_EQ(moved.data()[999], tokens[999]);
}

TEST(TokenFileTest, EmptyFileRoundTrips) {
  TempDir dir;
  write_token_file(dir.file("e.bin"), std::vector<uint16_t>{}, 256);
  TokenFile f(dir.file("e.bin"));
  EXPECT_EQ(f.size(), 0u);
  EXPECT_NE(f.data(), nullptr);
}

TEST(TokenFileTest, WriteRejectsBadVocabAndTokens) {
  TempDir dir;
  const auto path = dir.file("w.bin");
  expect_usage_error([&] { write_token_file(path, std::vector<uint16_t>{1, 2}, 0); },
                     {path, "vocab"});
  expect_usage_error([&] { write_token_file(path, std::vector<uint16_t>{1, 256}, 256); },
                     {path, "256", "position 1"});
  EXPECT_FALSE(fs::exists(path));
}

// A token file truncated while a run has it mapped: reading past the new end
// would be SIGBUS (the process dies without a word). The dataset checks the
// file before each sample and stops with one line instead.
TEST(TokenFileTest, TruncationWhileMappedIsAnErrorNotSigbus) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  write_token_file(path, iota_tokens(200000, 256), 256);  // ~400 KB: many pages
  TokenDataset ds(path, DatasetOptions{64});
  std::vector<int64_t> x(64), y(64);
  const int64_t last = ds.num_samples() - 1;
  ds.copy_sample(last, x.data(), y.data());
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  expect_usage_error([&] { ds.copy_sample(last, x.data(), y.data()); }, {path, "truncated to 4096 bytes while in use"});
}

TEST(TokenFileTest, RejectsMissingFile) {
  TempDir dir;
  const auto path = dir.file("nope.bin");
  expect_usage_error([&] { TokenFile f(path); }, {path, "no such file"});
}

TEST(TokenFileTest, RejectsBadMagic) {
  TempDir dir;
  const auto path = dir.file("m.bin");
  write_token_file(path, iota_tokens(10, 256), 256);
  std::string raw = read_raw(path);
  raw[0] = 'X';
  write_raw(path, raw);
  expect_usage_error([&] { TokenFile f(path); }, {path, "magic"});
}

TEST(TokenFileTest, RejectsBadVersion) {
  TempDir dir;
  const auto path = dir.file("v.bin");
  write_token_file(path, iota_tokens(10, 256), 256);
  std::string raw = read_raw(path);
  raw[8] = 2;  // version u32 little-endian at offset 8
  write_raw(path, raw);
  expect_usage_error([&] { TokenFile f(path); }, {path, "version 2"});
}

TEST(TokenFileTest, RejectsBadDtype) {
  TempDir dir;
  const auto path = dir.file("d.bin");
  write_token_file(path, iota_tokens(10, 256), 256);
  std::string raw = read_raw(path);
  raw[12] = 7;
  write_raw(path, raw);
  expect_usage_error([&] { TokenFile f(path); }, {path, "dtype"});
}

TEST(TokenFileTest, RejectsTruncatedData) {
  TempDir dir;
  const auto path = dir.file("t.bin");
  write_token_file(path, iota_tokens(100, 256), 256);
  fs::resize_file(path, kTokenFileHeaderBytes + 2 * 60);
  expect_usage_error([&] { TokenFile f(path); }, {path, "truncated", "100 tokens"});
}

TEST(TokenFileTest, RejectsTruncatedHeader) {
  TempDir dir;
  const auto path = dir.file("h.bin");
  write_raw(path, "STTOK");
  expect_usage_error([&] { TokenFile f(path); }, {path, "truncated header"});
  write_raw(path, "");
  expect_usage_error([&] { TokenFile f(path); }, {path, "truncated header"});
}

TEST(TokenFileTest, RejectsTrailingBytes) {
  TempDir dir;
  const auto path = dir.file("s.bin");
  write_token_file(path, iota_tokens(10, 256), 256);
  write_raw(path, read_raw(path) + "x");
  expect_usage_error([&] { TokenFile f(path); }, {path, "size mismatch"});
}

// ------------------------------------------------------------------ dataset

TEST(DatasetTest, SamplesAreShiftedWindows) {
  TempDir dir;
  const auto path = dir.file("ds.bin");
  const auto tokens = iota_tokens(103, 1000);  // token i has value i
  write_token_file(path, tokens, 1000);
  TokenDataset ds(path, DatasetOptions{10});
  EXPECT_EQ(ds.num_samples(), (103 - 1) / 10);
  EXPECT_EQ(ds.block_size(), 10);
  EXPECT_EQ(ds.vocab(), 1000u);

  std::vector<int64_t> in(10), tg(10);
  for (int64_t i = 0; i < ds.num_samples(); ++i) {
    ds.copy_sample(i, in.data(), tg.data());
    for (int64_t j = 0; j < 10; ++j) {
      EXPECT_EQ(in[j], i * 10 + j);
      EXPECT_EQ(tg[j], i * 10 + j + 1);
    }
  }
  EXPECT_THROW(ds.copy_sample(ds.num_samples(), in.data(), tg.data()), std::out_of_range);
  EXPECT_THROW(ds.copy_sample(-1, in.data(), tg.data()), std::out_of_range);

  // copy_batch lays samples out as rows.
  std::vector<int64_t> bin(30), btg(30);
  ds.copy_batch({7, 0, 3}, bin.data(), btg.data());
  EXPECT_EQ(bin[0], 70);
  EXPECT_EQ(bin[10], 0);
  EXPECT_EQ(btg[29], 40);
}

TEST(DatasetTest, ExactFitUsesEveryToken) {
  TempDir dir;
  write_token_file(dir.file("x.bin"), iota_tokens(4 * 8 + 1, 256), 256);
  TokenDataset ds(dir.file("x.bin"), DatasetOptions{8});
  EXPECT_EQ(ds.num_samples(), 4);
  std::vector<int64_t> tg(8);
  ds.copy_sample(3, nullptr, tg.data());
  EXPECT_EQ(tg[7], 32);
}

TEST(DatasetTest, RejectsTooSmallFileAndBadBlock) {
  TempDir dir;
  const auto path = dir.file("small.bin");
  write_token_file(path, iota_tokens(10, 256), 256);
  expect_usage_error([&] { TokenDataset ds(path, DatasetOptions{10}); }, {path, "block_size 10"});
  expect_usage_error([&] { TokenDataset ds(path, DatasetOptions{0}); }, {path, "block_size"});
  TokenDataset ok(path, DatasetOptions{9});
  EXPECT_EQ(ok.num_samples(), 1);
}

TEST(DatasetTest, RejectsTokenOutsideVocabOnRead) {
  TempDir dir;
  const auto path = dir.file("oov.bin");
  write_token_file(path, iota_tokens(20, 256), 256);
  std::string raw = read_raw(path);
  raw[kTokenFileHeaderBytes + 2 * 5 + 1] = 1;  // token 5 becomes 5 + 256
  write_raw(path, raw);
  TokenDataset ds(path, DatasetOptions{4});
  std::vector<int64_t> in(4), tg(4);
  ds.copy_sample(0, in.data(), tg.data());  // tokens 0..4: fine
  expect_usage_error([&] { ds.copy_sample(1, in.data(), tg.data()); }, {path, "261"});
}

// ------------------------------------------------------------------ sampler


// Everything ranks 0..D-1 train on in step s, rank by rank, micro-batch by
// micro-batch: this must equal the global batch (Note [Sampler invariant]).
std::vector<int64_t> assembled(const DistributedSampler& s, int64_t step, int dp, int micro) {
  std::vector<int64_t> out;
  const int64_t micros = s.micro_batches_per_step(dp, micro);
  for (int r = 0; r < dp; ++r) {
    for (int k = 0; k < micros; ++k) {
      const auto part = s.indices(step, r, dp, k, micro);
      EXPECT_EQ(part.size(), static_cast<std::size_t>(micro));
      out.insert(out.end(), part.begin(), part.end());
    }
  }
  return out;
}


TEST(SamplerTest, GlobalOrderIndependentOfWorldAndMicroSize) {
  // 37 samples, G = 16: batches straddle epoch boundaries (37 is prime).
  const DistributedSampler s(37, SamplerOptions{1234, 16});
  for (int64_t step = 0; step < 12; ++step) {
    const auto reference = s.global_batch(step);
    ASSERT_EQ(reference.size(), 16u);
    for (int dp : {1, 2, 4}) {
      for (int micro : {1, 2, 4}) {
        EXPECT_EQ(assembled(s, step, dp, micro), reference) << "dp=" << dp << " m=" << micro;
      }
    }
  }
  // A second sampler object (a resumed run on another world size) agrees,
  // starting cold at an arbitrary step.
  const DistributedSampler resumed(37, SamplerOptions{1234, 16});
  EXPECT_EQ(assembled(resumed, 13, 4, 1), s.global_batch(13));
}

TEST(SamplerTest, StreamIsConcatenationOfEpochs) {
  const int64_t n = 37, g = 8;
  const DistributedSampler s(n, SamplerOptions{7, g});
  std::vector<int64_t> stream;
  for (int64_t e = 0; e < 4; ++e) {
    const auto p = s.epoch_order(e);
    stream.insert(stream.end(), p.begin(), p.end());
  }
  for (int64_t step = 0; step * g + g <= static_cast<int64_t>(stream.size()); ++step) {
    const std::vector<int64_t> expect(stream.begin() + step * g, stream.begin() + step * g + g);
    EXPECT_EQ(s.global_batch(step), expect) << "step " << step;
    EXPECT_EQ(s.epoch_of_step(step), step * g / n);
  }
}

TEST(SamplerTest, EachEpochCoversEverySampleOnce) {
  const int64_t n = 64;
  const DistributedSampler s(n, SamplerOptions{99, 16});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> seen;
    for (int64_t step = epoch * 4; step < epoch * 4 + 4; ++step) {
      const auto b = s.global_batch(step);
      seen.insert(seen.end(), b.begin(), b.end());
    }
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(n);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all) << "epoch " << epoch;
    EXPECT_NE(seen, all) << "epoch " << epoch << " was not shuffled";
  }
  EXPECT_NE(s.epoch_order(0), s.epoch_order(1));  // reshuffled every epoch
}

TEST(SamplerTest, SeedChangesOrderAndIsDeterministic) {
  const DistributedSampler a(100, SamplerOptions{1, 10});
  const DistributedSampler b(100, SamplerOptions{2, 10});
  const DistributedSampler a2(100, SamplerOptions{1, 10});
  EXPECT_NE(a.epoch_order(0), b.epoch_order(0));
  EXPECT_EQ(a.epoch_order(0), a2.epoch_order(0));
  EXPECT_EQ(a.global_batch(25), a2.global_batch(25));
  // (seed, epoch) are mixed, not added: seed 1 epoch 0 != seed 0 epoch 1.
  const DistributedSampler z(100, SamplerOptions{0, 10});
  EXPECT_NE(a.epoch_order(0), z.epoch_order(1));
}

TEST(SamplerTest, NoShuffleIsIdentity) {
  SamplerOptions o;
  o.global_batch = 4;
  o.shuffle = false;
  const DistributedSampler s(10, o);
  EXPECT_EQ(s.global_batch(2), (std::vector<int64_t>{8, 9, 0, 1}));
  EXPECT_EQ(s.indices(2, 1, 2, 0, 2), (std::vector<int64_t>{0, 1}));
}

TEST(SamplerTest, RejectsIndivisibleSizes) {
  const DistributedSampler s(100, SamplerOptions{0, 12});
  expect_usage_error([&] { s.indices(0, 0, 5, 0, 1); }, {"G=12", "D=5", "m=1"});
  expect_usage_error([&] { s.indices(0, 0, 4, 0, 2); }, {"G=12", "D=4", "m=2"});
  expect_usage_error([&] { s.validate_layout(0, 1); }, {"D=0"});
  EXPECT_NO_THROW(s.validate_layout(4, 3));
  EXPECT_EQ(s.micro_batches_per_step(2, 3), 2);
  expect_usage_error([&] { s.indices(0, 4, 4, 0, 3); }, {"rank 4"});
  expect_usage_error([&] { s.indices(0, 0, 4, 1, 3); }, {"micro-batch index 1"});
  expect_usage_error([&] { s.global_batch(-1); }, {"step -1"});
  expect_usage_error([&] { DistributedSampler bad(0, SamplerOptions{}); }, {"samples"});
  expect_usage_error([&] { DistributedSampler bad(10, SamplerOptions{0, 0}); }, {"global batch"});
}

TEST(SamplerTest, ShuffleIsRoughlyUniform) {
  // Where sample 0 lands over many epochs: each of 8 slots should get about
  // 1/8 of 4000 epochs. A biased bounded draw would skew this visibly.
  const DistributedSampler s(8, SamplerOptions{5, 8});
  std::vector<int> hits(8, 0);
  for (int64_t e = 0; e < 4000; ++e) {
    const auto p = s.epoch_order(e);
    hits[std::find(p.begin(), p.end(), 0) - p.begin()]++;
  }
  for (int h : hits) {
    EXPECT_GT(h, 400);
    EXPECT_LT(h, 600);
  }
}

// --------------------------------------------------------------------- plot

TEST(PlotTest, WritesSvgWithTwoCurves) {
  TempDir dir;
  const auto metrics = dir.file("m.jsonl");
  std::ofstream out(metrics);
  // Records that are not steps (the trainer's memory report) are skipped.
  out << "{\"record\":\"memory\",\"phase\":\"setup\",\"predicted_mib\":{\"total\":1.0}}\n";
  for (int s = 1; s <= 50; ++s) {
    out << "{\"step\":" << s << ",\"loss\":" << 5.0 / s << ",\"lr\":0.001,\"step_ms\":12.5,"
        << "\"tokens_per_s\":" << 120000 + 100 * s
        << ",\"mfu\":0.4,\"peak_rss_mb\":900,\"comm_wait_ms\":1.5}\n";
  }
  out << "\n";  // blank lines are skipped
  out.close();

  const auto records = cli::read_metrics(metrics);
  ASSERT_EQ(records.size(), 50u);
  EXPECT_EQ(records[9].step, 10);
  EXPECT_DOUBLE_EQ(records[9].loss, 0.5);
  EXPECT_DOUBLE_EQ(records[9].mfu, 0.4);

  const auto svg_path = dir.file("curves.svg");
  cli::PlotOptions opts;
  opts.title = "run <a&b>";
  cli::plot_metrics(metrics, svg_path, opts);
  const std::string svg = read_raw(svg_path);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  std::size_t polylines = 0;
  for (auto p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) {
    ++polylines;
  }
  EXPECT_EQ(polylines, 2u);
  EXPECT_NE(svg.find("Loss"), std::string::npos);
  EXPECT_NE(svg.find("tokens/s"), std::string::npos);
  EXPECT_NE(svg.find("run &lt;a&amp;b&gt;"), std::string::npos);  // escaped title
  EXPECT_NE(svg.find(">step<"), std::string::npos);
  EXPECT_NE(svg.find("k</text>"), std::string::npos);  // 120k-style tick labels
}

// A user's module's metrics (ModuleTrainer) count samples, not tokens: the
// throughput panel draws samples/s, alone and compared; a line with neither
// key is refused.
TEST(PlotTest, ARunWithoutTokensIsDrawnInSamples) {
  TempDir dir;
  const auto metrics = dir.file("m.jsonl");
  std::ofstream out(metrics);
  for (int s = 1; s <= 5; ++s)
    out << "{\"step\":" << s << ",\"loss\":" << 2.0 / s << ",\"samples_per_s\":" << 300 + s << "}\n";
  out.close();
  const auto records = cli::read_metrics(metrics);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_DOUBLE_EQ(records[2].samples_per_s, 303);
  EXPECT_TRUE(std::isnan(records[2].tokens_per_s));
  const auto svg_path = dir.file("curves.svg");
  cli::plot_metrics(metrics, svg_path, cli::PlotOptions{});
  const std::string svg = read_raw(svg_path);
  EXPECT_NE(svg.find("Throughput (samples/s)"), std::string::npos);
  EXPECT_EQ(svg.find("tokens/s"), std::string::npos);
  const auto compare_path = dir.file("compare.svg");
  cli::plot_runs({metrics, metrics}, {"a", "b"}, compare_path);
  const std::string compare = read_raw(compare_path);
  EXPECT_NE(compare.find("Throughput (samples/s)"), std::string::npos);
  EXPECT_EQ(compare.find("tokens/s"), std::string::npos);
  write_raw(metrics, "{\"step\":1,\"loss\":2.0}\n");
  expect_usage_error([&] { cli::read_metrics(metrics); }, {"line 1", "\"tokens_per_s\""});
}

TEST(PlotTest, NullLossIsAGapAndDuplicateStepsKeepTheLast) {
  std::vector<cli::MetricsRecord> r(6);
  for (int i = 0; i < 6; ++i) {
    r[i].step = i;
    r[i].loss = 3.0 - 0.1 * i;
    r[i].tokens_per_s = 1000;
  }
  r[3].loss = std::numeric_limits<double>::quiet_NaN();
  // A resumed run re-logs step 2; its (null) throughput replaces the first.
  cli::MetricsRecord again = r[2];
  again.tokens_per_s = std::numeric_limits<double>::quiet_NaN();
  r.push_back(again);
  const std::string svg = cli::render_svg(r, {});
  // Loss splits into steps [0..2] and [4..5]; so does throughput, at step 2
  // into [0..1] and [3..5].
  std::size_t polylines = 0;
  for (auto p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) {
    ++polylines;
  }
  EXPECT_EQ(polylines, 4u);
  EXPECT_NE(cli::render_svg({}, {}).find("no data"), std::string::npos);
}

// A restarted run's log: steps 1-4, a restart record resuming from step 2,
// steps 3-5 again. The plot keeps the last of each step and marks the
// restart in both panels.
TEST(PlotTest, RestartsAreMarkedAndReRunStepsKeepTheLast) {
  TempDir dir;
  const auto path = dir.file("restarted.jsonl");
  std::string log;
  auto step = [](int s, double loss) {
    return "{\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(loss) + ",\"tokens_per_s\":100}\n";
  };
  for (int s = 1; s <= 4; ++s) log += step(s, 9.0);
  log += "{\"record\":\"restart\",\"attempt\":1,\"resumed_from_step\":2,\"reason\":\"attempt 0: rank 1 exited\"}\n";
  for (int s = 3; s <= 5; ++s) log += step(s, 1.0);
  write_raw(path, log);
  const auto records = cli::read_metrics(path);
  ASSERT_EQ(records.size(), 8u);
  EXPECT_EQ(records[4].restart, 1);
  EXPECT_EQ(records[4].step, 2);
  const std::string svg = cli::render_svg(records, {});
  std::size_t marks = 0;
  for (auto p = svg.find(">restart</text>"); p != std::string::npos; p = svg.find(">restart</text>", p + 1)) ++marks;
  EXPECT_EQ(marks, 2u);  // loss and throughput
  // Steps 3 and 4 plot the second attempt's loss (1.0), not the first's (9.0):
  // the same picture as a log holding only the last of each step.
  std::vector<cli::MetricsRecord> last{records[0], records[1], records[4], records[5], records[6], records[7]};
  EXPECT_EQ(svg, cli::render_svg(last, {}));
  std::vector<cli::MetricsRecord> first{records[0], records[1], records[2], records[3], records[4], records[7]};
  EXPECT_NE(svg, cli::render_svg(first, {}));
  EXPECT_EQ(cli::render_svg({records.begin(), records.begin() + 4}, {}).find(">restart</text>"), std::string::npos);
}

// An MoE run's log gets a third panel: one curve per expert of its share of
// the step's slots, and the uniform share as a dashed line.
TEST(PlotTest, MoeRunsGetTheirExpertsShares) {
  TempDir dir;
  const auto path = dir.file("moe.jsonl");
  std::string log;
  for (int s = 1; s <= 5; ++s)
    log += "{\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(3.0 - 0.1 * s) +
           ",\"tokens_per_s\":100,\"moe_tokens_per_expert\":[" + std::to_string(10 + s) + ",20,30," +
           std::to_string(40 - s) + "]}\n";
  write_raw(path, log);
  const auto records = cli::read_metrics(path);
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0].moe_tokens_per_expert, (std::vector<double>{11, 20, 30, 39}));
  const std::string svg = cli::render_svg(records, {});
  std::size_t polylines = 0;
  for (auto p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) ++polylines;
  EXPECT_EQ(polylines, 2u + 4u);  // loss, throughput, 4 experts
  EXPECT_NE(svg.find("Share of slots per expert (4 experts"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  // A dense run's log keeps two panels.
  std::vector<cli::MetricsRecord> dense = records;
  for (auto& r : dense) r.moe_tokens_per_expert.clear();
  EXPECT_EQ(cli::render_svg(dense, {}).find("Share of slots"), std::string::npos);
}

// Two runs on one picture: seven panels, one curve per run in each, a legend
// naming both; Debian's SVG renderer (rsvg-convert, librsvg2-bin) parses it.
TEST(PlotTest, ComparesRunsOnOnePictureWithALegend) {
  TempDir dir;
  auto log = [&](const std::string& name, double loss0, double scale) {
    std::string text;
    for (int s = 1; s <= 20; ++s)
      text += "{\"step\":" + std::to_string(s) + ",\"loss\":" + std::to_string(loss0 / s) +
              ",\"lr\":0.001,\"tokens_per_s\":" + std::to_string(1000 + 10 * s) +
              ",\"mfu\":0.3,\"peak_rss_mb\":512,\"grad_norm\":" + std::to_string(2.0 / s) +
              ",\"loss_scale\":" + std::to_string(scale) + "}\n";
    const auto path = dir.file(name);
    write_raw(path, text);
    return path;
  };
  const auto fp32 = log("fp32.jsonl", 5.0, 1.0), bf16 = log("bf16.jsonl", 5.2, 65536.0);
  const auto svg_path = dir.file("compare.svg");
  cli::plot_runs({fp32, bf16}, {"fp32", "bf16 <mixed>"}, svg_path);
  const std::string svg = read_raw(svg_path);
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (auto p = svg.find(needle); p != std::string::npos; p = svg.find(needle, p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("<polyline"), 14u);  // 7 panels x 2 runs
  EXPECT_EQ(count("<polyline fill=\"none\" stroke=\"#1f77b4\""), 7u);
  EXPECT_EQ(count("<polyline fill=\"none\" stroke=\"#d62728\""), 7u);
  EXPECT_EQ(count("class=\"legend\""), 2u);
  EXPECT_NE(svg.find(">bf16 &lt;mixed&gt;</text>"), std::string::npos);
  for (const char* panel : {"Loss", "Learning rate", "Throughput (tokens/s)", "MFU", "Peak RSS (MiB)",
                            "Gradient norm", "Loss scale"})
    EXPECT_NE(svg.find(std::string(">") + panel + "</text>"), std::string::npos) << panel;
  const auto png = dir.file("compare.png");
  const int rc = std::system(("rsvg-convert -o " + png + " " + svg_path + " 2>&1").c_str());
  ASSERT_EQ(rc, 0) << "rsvg-convert could not render the SVG (is librsvg2-bin installed?)";
  EXPECT_EQ(read_raw(png).substr(1, 3), "PNG");
  // Default labels are the file names; labels that do not match are refused.
  cli::plot_runs({fp32, bf16}, {}, svg_path);
  EXPECT_NE(read_raw(svg_path).find(">fp32.jsonl</text>"), std::string::npos);
  EXPECT_THROW(cli::plot_runs({fp32, bf16}, {"only one"}, svg_path), UsageError);
}

TEST(PlotTest, RejectsMalformedLines) {
  TempDir dir;
  const auto path = dir.file("bad.jsonl");
  const std::string good = "{\"step\":1,\"loss\":2.0,\"tokens_per_s\":10}\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"step\":2,\"loss\":", "invalid JSON"},
      {"[1,2,3]", "JSON object"},
      {"{\"loss\":1.0,\"tokens_per_s\":1}", "\"step\""},
      {"{\"step\":2,\"tokens_per_s\":1}", "\"loss\""},
      {"{\"step\":2,\"loss\":\"high\",\"tokens_per_s\":1}", "not a number"},
      {"{\"step\":2.5,\"loss\":1,\"tokens_per_s\":1}", "not an integer"},
      {"{\"step\":2,\"loss\":1,\"tokens_per_s\":1,\"mfu\":true}", "\"mfu\""},
      {"{\"step\":2,\"loss\":1,\"tokens_per_s\":1,\"moe_tokens_per_expert\":3}", "not an array"},
      {"{\"step\":2,\"loss\":1,\"tokens_per_s\":1,\"moe_tokens_per_expert\":[1,\"x\"]}", "non-number"},
  };
  for (const auto& [line, problem] : cases) {
    write_raw(path, good + "\n" + line + "\n");
    expect_usage_error([&] { cli::read_metrics(path); }, {path, "line 3", problem});
  }
  expect_usage_error([&] { cli::read_metrics(dir.file("missing.jsonl")); }, {"missing.jsonl"});
  write_raw(path, "\n");
  expect_usage_error([&] { cli::plot_metrics(path, dir.file("o.svg")); }, {path, "no records"});
}

// Note [Document segments]: where each window's documents are, from a file's
// document index, worked out by hand for documents of 3, 5, 2 and 6 tokens.
TEST(DatasetTest, DocumentSegmentsFromTheIndex) {
  TempDir dir;
  TokenRecords r;
  uint32_t next = 1;
  for (int n : {3, 5, 2, 6}) {
    std::vector<uint32_t> ids;
    for (int j = 0; j < n; ++j) ids.push_back(next++);
    r.add(ids, std::vector<uint8_t>(ids.size(), 1));
  }
  write_token_file(dir.file("docs.bin"), r, 64);
  DatasetOptions o;
  o.block_size = 4;
  o.documents = true;
  TokenDataset ds(dir.file("docs.bin"), o);
  ASSERT_EQ(ds.num_samples(), 3);
  std::vector<int64_t> in(12), tgt(12), seg(12), pos(12);
  ds.copy_batch({0, 1, 2}, in.data(), tgt.data());
  ds.copy_layout({0, 1, 2}, seg.data(), pos.data());
  const int64_t X = kIgnoreIndex;
  // Stream positions 0-4 | 4-8 | 8-12 (ids are position + 1); documents
  // start at 0, 3, 8 and 10.
  EXPECT_EQ(in, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(tgt, (std::vector<int64_t>{2, 3, X, 5, 6, 7, 8, X, 10, X, 12, 13}));
  EXPECT_EQ(seg, (std::vector<int64_t>{0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(pos, (std::vector<int64_t>{0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 0, 1}));
  EXPECT_EQ(ds.count_targets({0, 1, 2}), 9);
  EXPECT_EQ(ds.count_targets({1}), 3);
}

// A file of text: a document ends at each separator id (here 0).
TEST(DatasetTest, DocumentSegmentsAfterSeparators) {
  TempDir dir;
  write_token_file(dir.file("text.bin"), std::vector<uint16_t>{5, 6, 0, 7, 8, 9, 0, 4, 3}, 16);
  DatasetOptions o;
  o.block_size = 4;
  o.documents = true;
  o.separator = 0;
  TokenDataset ds(dir.file("text.bin"), o);
  ASSERT_EQ(ds.num_samples(), 2);
  std::vector<int64_t> in(8), tgt(8), seg(8), pos(8);
  ds.copy_batch({0, 1}, in.data(), tgt.data());
  ds.copy_layout({0, 1}, seg.data(), pos.data());
  const int64_t X = kIgnoreIndex;
  EXPECT_EQ(in, (std::vector<int64_t>{5, 6, 0, 7, 8, 9, 0, 4}));
  EXPECT_EQ(tgt, (std::vector<int64_t>{6, 0, X, 8, 9, 0, X, 3}));
  EXPECT_EQ(seg, (std::vector<int64_t>{0, 0, 0, 1, 0, 0, 0, 1}));
  EXPECT_EQ(pos, (std::vector<int64_t>{0, 1, 2, 0, 0, 1, 2, 0}));
  EXPECT_EQ(ds.count_targets({0, 1}), 6);
}

TEST(DatasetTest, DocumentSegmentsRefuseWhatTheyCannotRead) {
  TempDir dir;
  write_token_file(dir.file("text.bin"), iota_tokens(40, 16), 16);
  TokenRecords r;
  r.add({1, 2, 3, 4, 5, 6}, std::vector<uint8_t>(6, 1));
  write_token_file(dir.file("docs.bin"), r, 16);
  DatasetOptions o;
  o.block_size = 4;
  o.documents = true;
  expect_usage_error([&] { TokenDataset(dir.file("text.bin"), o); }, {"data.document_separator"});
  o.separator = -5;
  expect_usage_error([&] { TokenDataset(dir.file("text.bin"), o); }, {"document_separator=-5", "not a token id"});
  o.separator = 16;
  expect_usage_error([&] { TokenDataset(dir.file("text.bin"), o); }, {"document_separator=16", "vocab size 16"});
  o.separator = 3;
  expect_usage_error([&] { TokenDataset(dir.file("docs.bin"), o); }, {"document index", "document_separator=3"});
  o.separator = -1;
  o.packing = false;
  expect_usage_error([&] { TokenDataset(dir.file("docs.bin"), o); }, {"data.packing=true"});
}
}  // namespace data_test

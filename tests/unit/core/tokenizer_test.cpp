// Unit tests of the tokenizer.json tokenizers on small files written here:
// the merge engine (against a plain implementation of the classic loop),
// byte-level and SentencePiece-style models, added tokens, the
// post-processor, decoding, GPT-2's encoder.json + vocab.bpe, the u32 token
// files a large vocabulary needs, and a one-line UsageError for each kind of
// bad input. The real vocabularies are checked against references in
// tokenizer_reference_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "scaletrain/data/bpe.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/hf_tokenizer.h"
#include "scaletrain/data/text_pipeline.h"
#include "scaletrain/data/token_file.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace scaletrain;
using namespace scaletrain::data;
using Ids = std::vector<uint32_t>;

namespace tokenizer_test {

class Dir {
 public:
  Dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / ("st_tok_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~Dir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const auto p = path_ / name;
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

template <typename F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << "not one line: " << m;
    return m;
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

// A byte-level tokenizer.json: ids 0..255 are the bytes (in the byte-level
// alphabet), then `extra` tokens (plain ASCII words) from 256 on.
json byte_level_json(const std::vector<std::string>& extra, const json& merges) {
  json vocab = json::object();
  for (unsigned b = 0; b < 256; ++b) vocab[byte_level_char(static_cast<unsigned char>(b))] = b;
  for (std::size_t i = 0; i < extra.size(); ++i) {
    std::string spelled;
    for (unsigned char c : extra[i]) spelled += byte_level_char(c);
    vocab[spelled] = 256 + i;
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", kGpt2Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

// A SentencePiece-style file: <unk> <s> </s>, the 256 byte tokens, then `pieces`.
json sentencepiece_json(const std::vector<std::string>& pieces, const json& merges) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (unsigned b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  for (std::size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = 259 + i;
  auto added = [](int id, const char* s) {
    return json{{"id", id},        {"content", s},        {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  return {{"added_tokens", {added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "\u2581"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single",
             {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"fuse_unk", true},
            {"byte_fallback", true},
            {"vocab", vocab},
            {"merges", merges}}}};
}

std::unique_ptr<HfTokenizer> load(const Dir& d, const json& j, const std::string& name = "tokenizer.json") {
  return HfTokenizer::load(d.write(name, j.dump()));
}

// The classic BPE loop (GPT-2's encoder.py): merge every occurrence of the
// lowest-ranked pair, left to right, until none is left.
std::vector<std::string> classic_bpe(const std::string& word,
                                     const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> parts;
  for (char c : word) parts.emplace_back(1, c);
  while (parts.size() > 1) {
    int best = -1;
    std::pair<std::string, std::string> pair;
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = ranks.find({parts[i], parts[i + 1]});
      if (it != ranks.end() && (best < 0 || it->second < best)) best = it->second, pair = it->first;
    }
    if (best < 0) break;
    std::vector<std::string> next;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (i + 1 < parts.size() && parts[i] == pair.first && parts[i + 1] == pair.second) {
        next.push_back(pair.first + pair.second);
        ++i;
      } else {
        next.push_back(parts[i]);
      }
    }
    parts.swap(next);
  }
  return parts;
}


// Note [BPE merge order]: the heap engine equals the classic loop, on random
// vocabularies "learned" the way BPE training does (each merge joins two
// existing tokens) and on random words, cached and uncached.
TEST(Bpe, MatchesTheClassicLoopOnRandomVocabularies) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::string> tokens = {"a", "b", "c", "d"};
    std::unordered_map<std::string, uint32_t> vocab;
    for (uint32_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
    std::vector<std::pair<std::string, std::string>> merges;
    std::map<std::pair<std::string, std::string>, int> ranks;
    while (merges.size() < 60) {
      const auto& a = tokens[rng() % tokens.size()];
      const auto& b = tokens[rng() % tokens.size()];
      if (ranks.count({a, b}) || a.size() + b.size() > 8) continue;
      ranks[{a, b}] = static_cast<int>(merges.size());
      merges.emplace_back(a, b);
      if (!vocab.count(a + b)) {
        vocab[a + b] = static_cast<uint32_t>(tokens.size());
        tokens.push_back(a + b);
      }
    }
    for (std::size_t cache : {std::size_t{0}, std::size_t{1000}}) {
      BpeOptions o;
      o.byte_level = true;
      o.cache_words = cache;
      BpeModel model(vocab, merges, o, "test");
      for (int w = 0; w < 200; ++w) {
        std::string word;
        const int len = 1 + static_cast<int>(rng() % 24);
        for (int k = 0; k < len; ++k) word.push_back(static_cast<char>('a' + rng() % 4));
        Ids want;
        for (const auto& p : classic_bpe(word, ranks)) want.push_back(vocab.at(p));
        Ids got;
        model.encode(word, got);
        ASSERT_EQ(got, want) << word;
        got.clear();
        model.encode(word, got);  // again, from the cache when there is one
        ASSERT_EQ(got, want) << word;
      }
    }
  }
}

TEST(ByteLevel, MergesInRankOrderAndDecodes) {
  Dir d;
  // "l l" first, then "h e", "ll o", "he llo": hello = 256+3.
  const json merges = {"l l", "h e", "ll o", "he llo", "\xC4\xA0 hello"};  // "Ġ hello": space + hello
  auto t = load(d, byte_level_json({"ll", "he", "llo", "hello", " hello"}, merges));
  EXPECT_EQ(t->vocab_size(), 261u);
  EXPECT_EQ(t->encode("hello"), (Ids{259}));
  EXPECT_EQ(t->encode("hello hello"), (Ids{259, 260}));
  EXPECT_EQ(t->encode("help"), (Ids{257, 'l', 'p'}));
  EXPECT_EQ(t->encode("hell"), (Ids{257, 256}));
  // Not in the vocabulary as a whole: bytes.
  EXPECT_EQ(t->encode("\n\xC3\xA9"), (Ids{'\n', 0xC3, 0xA9}));
  for (const std::string s : {"hello world\n\t  x", "caf\xC3\xA9 \xF0\x9F\x99\x82", ""})
    EXPECT_EQ(t->decode(t->encode(s)), s);
  // Merges as [a, b] pairs mean the same.
  json pairs = json::array();
  for (const auto& m : merges) {
    const std::string s = m.get<std::string>();
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  EXPECT_EQ(
      load(d, byte_level_json({"ll", "he", "llo", "hello", " hello"}, pairs), "pairs.json")->encode("hello hello"),
      (Ids{259, 260}));
}

TEST(ByteLevel, IgnoreMergesTakesWholeWords) {
  Dir d;
  json j = byte_level_json({"ab", "abc"}, {"a b"});  // no merge builds "abc"
  EXPECT_EQ(load(d, j)->encode("abc"), (Ids{256, 'c'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(d, j, "ignore.json")->encode("abc"), (Ids{257}));
}

TEST(ByteLevel, RefusesInvalidUtf8) {
  Dir d;
  auto t = load(d, byte_level_json({}, json::array()));
  const std::string m = usage_error([&] { t->encode(std::string("ok \xC3(", 5)); });
  EXPECT_NE(m.find("not valid UTF-8 (at byte 3)"), std::string::npos) << m;
}

TEST(SentencePiece, PrependReplaceByteFallbackAndTemplate) {
  Dir d;
  // pieces: ▁ = 259, a = 260, b = 261, ▁a = 262, ab = 263, ▁ab = 264
  auto t =
      load(d, sentencepiece_json({"\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"}, {"\u2581 a", "a b", "\u2581a b"}));
  EXPECT_EQ(t->encode("ab"), (Ids{264}));
  EXPECT_EQ(t->encode("a b"), (Ids{262, 259, 261}));
  // "\n" and "é" are not pieces: their UTF-8 bytes as <0xXX> tokens (3 + byte).
  EXPECT_EQ(t->encode("a\n\xC3\xA9"), (Ids{262, 3 + 0x0A, 3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(t->encode("ab", true), (Ids{1, 264}));  // BOS from the template
  for (const std::string s : {"a b", "ab\nba  b", " a", "caf\xC3\xA9"}) {
    EXPECT_EQ(t->decode(t->encode(s)), s);
    EXPECT_EQ(t->decode(t->encode(s, true), true), s);  // BOS skipped as special
  }
  EXPECT_EQ(t->decode(t->encode("ab", true)), "<s> ab");  // kept, and the space after it is not stripped
  // A lone byte that is not UTF-8 decodes as U+FFFD.
  EXPECT_EQ(t->decode(Ids{3 + 0xC3}), "\xEF\xBF\xBD");
  // Special tokens are split out before the normalizer sees the text.
  EXPECT_EQ(t->encode("a<s>b"), (Ids{262, 1, 259, 261}));
}

TEST(SentencePiece, MetaspacePreTokenizerMatchesTheNormalizerForm) {
  Dir d;
  json j = sentencepiece_json({"\u2581", "a", "b", "\u2581a", "ab", "\u2581ab"}, {"\u2581 a", "a b", "\u2581a b"});
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}};
  j["decoder"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}};
  auto t = load(d, j);
  EXPECT_EQ(t->encode("ab"), (Ids{264}));
  EXPECT_EQ(t->encode("a b"), (Ids{262, 259, 261}));
  EXPECT_EQ(t->decode(t->encode("ab a")), "ab a");
  // "first": only the start of the input gets the prefix, not text after a special token.
  EXPECT_EQ(t->encode("ab<s>ab"), (Ids{264, 1, 263}));
}

TEST(AddedTokens, LongestMatchStripAndNormalized) {
  Dir d;
  json j = byte_level_json({"x"}, json::array());
  auto add = [&](int id, const std::string& s, bool special, bool lstrip, bool rstrip, bool normalized) {
    j["added_tokens"].push_back({{"id", id},
                                 {"content", s},
                                 {"single_word", false},
                                 {"lstrip", lstrip},
                                 {"rstrip", rstrip},
                                 {"normalized", normalized},
                                 {"special", special}});
  };
  add(300, "<|a|>", true, false, false, false);
  add(301, "<|a|>b", true, false, false, false);  // longer, same start: wins where it matches
  add(302, "[L]", false, true, false, false);     // swallows whitespace on its left
  add(303, "[R]", false, false, true, false);     // and on its right
  auto t = load(d, j);
  EXPECT_EQ(t->vocab_size(), 304u);
  EXPECT_EQ(t->encode("<|a|>c"), (Ids{300, 'c'}));
  EXPECT_EQ(t->encode("<|a|>b"), (Ids{301}));
  EXPECT_EQ(t->encode("c <|a|"), (Ids{'c', ' ', '<', '|', 'a', '|'}));  // incomplete: plain text
  EXPECT_EQ(t->encode("c \t[L] c"), (Ids{'c', 302, ' ', 'c'}));
  EXPECT_EQ(t->encode("c [R] \n c"), (Ids{'c', ' ', 303, 'c'}));
  // decode: specials kept or skipped; non-special added tokens always kept.
  EXPECT_EQ(t->decode(Ids{'c', 300, 302, 'c'}), "c<|a|>[L]c");
  EXPECT_EQ(t->decode(Ids{'c', 300, 302, 'c'}, true), "c[L]c");
  // Ids beyond the vocabulary (a padded embedding) are skipped.
  EXPECT_EQ(t->decode(Ids{'c', 5000}), "c");
}

TEST(AddedTokens, NormalizedTokensMatchTheNormalizedText) {
  Dir d;
  json j = byte_level_json({}, json::array());
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", "Q"}}}, {"content", "q"}};
  j["added_tokens"].push_back({{"id", 300}, {"content", "<Q>"}, {"special", false}, {"normalized", true}});
  j["added_tokens"].push_back({{"id", 301}, {"content", "<Z>"}, {"special", false}, {"normalized", false}});
  auto t = load(d, j);
  // The normalized token is "<q>" after normalization, and matches "<Q>" and "<q>" in the text.
  EXPECT_EQ(t->encode("a<Q>b<q>"), (Ids{'a', 300, 'b', 300}));
  EXPECT_EQ(t->encode("<Z>"), (Ids{301}));
}

TEST(PostProcessor, SequenceOfByteLevelAndTemplateAddsBosAndEos) {
  Dir d;
  json j = byte_level_json({}, json::array());
  j["added_tokens"] = {{{"id", 256}, {"content", "<bos>"}, {"special", true}},
                       {{"id", 257}, {"content", "<eos>"}, {"special", true}}};
  j["post_processor"] = json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<eos>", "type_id": 0}}],
       "special_tokens": {"<bos>": {"id": "<bos>", "ids": [256], "tokens": ["<bos>"]},
                          "<eos>": {"id": "<eos>", "ids": [257], "tokens": ["<eos>"]}}}]})");
  auto t = load(d, j);
  EXPECT_EQ(t->encode("hi", true), (Ids{256, 'h', 'i', 257}));
  EXPECT_EQ(t->encode("hi", false), (Ids{'h', 'i'}));
  EXPECT_EQ(t->decode(t->encode("hi", true), true), "hi");
}

TEST(Gpt2Files, EncoderJsonAndVocabBpeDirectory) {
  Dir d;
  json vocab = json::object();
  for (unsigned b = 0; b < 256; ++b) vocab[byte_level_char(static_cast<unsigned char>(b))] = b;
  vocab["\xC4\xA0t"] = 256;      // "Ġt"
  vocab["\xC4\xA0th"] = 257;     // "Ġth"
  vocab["<|endoftext|>"] = 258;  // text here, as in GPT-2's own encoder
  d.write("encoder.json", vocab.dump());
  d.write("vocab.bpe", "#version: 0.2\n\xC4\xA0 t\n\xC4\xA0t h\n");
  Tokenizer t(d.path());
  EXPECT_EQ(t.vocab_size(), 259u);
  EXPECT_EQ(t.encode("a th"), (Ids{'a', 257}));
  EXPECT_EQ(t.encode("'s thx"), (Ids{'\'', 's', 257, 'x'}));
  EXPECT_EQ(t.decode(t.encode("a th\n\n")), "a th\n\n");
}

TEST(ByteTokenizerWrapper, IsTheDefault) {
  Tokenizer t;
  EXPECT_EQ(t.vocab_size(), 256u);
  EXPECT_EQ(t.describe(), "byte");
  EXPECT_EQ(t.encode("\xFF"
                     "a"),
            (Ids{255, 'a'}));
  EXPECT_EQ(t.decode(Ids{'a', 300}), "a?");
}

// -------------------------------------------------------------- bad input

TEST(BadInput, EveryProblemIsOneLineNamingTheFile) {
  Dir d;
  const json good = byte_level_json({"ab"}, {"a b"});
  auto refused = [&](const std::string& name, const json& j, const std::string& needle) {
    const std::string path = d.write(name, j.dump());
    const std::string m = usage_error([&] { HfTokenizer::load(path); });
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m;
  };
  json j = good;
  j["model"]["type"] = "WordPiece";
  refused("wordpiece.json", j, "unsupported model type WordPiece");
  j = good;
  j["model"]["type"] = "Unigram";
  refused("unigram.json", j, "unsupported model type Unigram");
  j = good;
  j["normalizer"] = {{"type", "Lowercase"}};
  refused("lowercase.json", j, "unsupported normalizer type Lowercase");
  j = good;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  refused("whitespace.json", j, "unsupported pre_tokenizer type Whitespace");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Contiguous";
  refused("contiguous.json", j, "unsupported Split behavior Contiguous");
  j = good;
  j["decoder"] = {{"type", "WordPiece"}};
  refused("decoder.json", j, "unsupported decoder type WordPiece");
  j = good;
  j["post_processor"] = {{"type", "BertProcessing"}};
  refused("bert.json", j, "unsupported post_processor type BertProcessing");
  j = good;
  j["truncation"] = {{"max_length", 8}};
  refused("truncation.json", j, "truncation");
  j = good;
  j["model"]["merges"] = {"a z"};
  refused("merge.json", j, "merge 0 needs the token");
  j = good;
  j["model"]["dropout"] = 0.1;
  refused("dropout.json", j, "dropout");
  j = good;
  j["added_tokens"] = {{{"id", 300}, {"content", "<x>"}, {"single_word", true}}};
  refused("single_word.json", j, "single_word");
  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  refused("regex.json", j, "regular expression does not compile");
  j = good;
  j["model"]["vocab"]["a"] = "not a number";
  refused("type.json", j, "token 'a' has id \"not a number\"");
  j = good;
  j["model"]["merges"] = json::parse("[[1, 2]]");
  refused("merge_type.json", j, "malformed");
  refused("empty_object.json", json::object(), "no \"model\"");
  j = good;
  j["model"]["vocab"]["huge"] = 4000000000u;
  refused("huge_id.json", j, "token 'huge' has id 4000000000");
  j = good;
  j["model"]["vocab"]["negative"] = -1;
  refused("negative_id.json", j, "token 'negative' has id -1");
  j = good;
  j["post_processor"] = json::parse(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>"}}],
                                        "special_tokens": {"<x>": {"ids": [9999]}}})");
  refused("template_id.json", j, "post_processor token '<x>' has id 9999, which is not in the vocabulary");

  const std::string broken = d.write("broken.json", "{\"model\": {\"type\": \"BPE\", ");
  std::string m = usage_error([&] { HfTokenizer::load(broken); });
  EXPECT_NE(m.find(broken + ": not valid JSON"), std::string::npos) << m;
  // Binary garbage is shown escaped, with its offset, never echoed raw (Note [Strict JSON]).
  const std::string binary = d.write("binary.json", std::string("{\"model\": \x80\x81\x00\x1b[2J", 15));
  m = usage_error([&] { HfTokenizer::load(binary); });
  EXPECT_NE(m.find("not valid JSON at byte 10"), std::string::npos) << m;
  EXPECT_NE(m.find("\\x80\\x81"), std::string::npos) << m;
  for (char c : m) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "unprintable byte in: " << m;
  const std::string twice = d.write("twice.json", R"({"model": {"type": "BPE"}, "model": {"type": "BPE"}})");
  m = usage_error([&] { HfTokenizer::load(twice); });
  EXPECT_NE(m.find("key 'model' appears twice"), std::string::npos) << m;

  const std::string missing = d.path() + "/nope/tokenizer.json";
  m = usage_error([&] { HfTokenizer::load(missing); });
  EXPECT_NE(m.find(missing), std::string::npos) << m;
  EXPECT_NE(m.find("No such file"), std::string::npos) << m;

  fs::create_directories(d.path() + "/empty");
  m = usage_error([&] { Tokenizer t(d.path() + "/empty"); });
  EXPECT_NE(m.find("has no tokenizer.json"), std::string::npos) << m;
}

// ------------------------------------------------------------ token files

TEST(TokenFile32, LargeVocabulariesUseU32AndSmallOnesStayU16) {
  Dir d;
  const Ids big = {0, 70000, 128255, 5, 128000, 1, 2, 3, 4};
  const std::string p32 = d.path() + "/big.tok";
  write_token_file(p32, big, 128256);
  EXPECT_EQ(fs::file_size(p32), kTokenFileHeaderBytes + 4 * big.size());
  TokenFile f(p32);
  EXPECT_EQ(f.dtype(), kDtypeUint32);
  EXPECT_EQ(f.vocab(), 128256u);
  EXPECT_EQ(f.data(), nullptr);
  for (std::size_t i = 0; i < big.size(); ++i) EXPECT_EQ(f.at(i), big[i]);

  TokenDataset ds(p32, DatasetOptions{4});
  ASSERT_EQ(ds.num_samples(), 2);
  std::vector<int64_t> in(4), tg(4);
  ds.copy_sample(0, in.data(), tg.data());
  EXPECT_EQ(in, (std::vector<int64_t>{0, 70000, 128255, 5}));
  EXPECT_EQ(tg, (std::vector<int64_t>{70000, 128255, 5, 128000}));

  // 32-bit ids of a small vocabulary: the u16 layout, byte for byte what the
  // u16 writer produces.
  const Ids small = {1, 2, 65535, 0};
  const std::string a = d.path() + "/a.tok", b = d.path() + "/b.tok";
  write_token_file(a, small, 65536);
  write_token_file(b, std::vector<uint16_t>(small.begin(), small.end()), 65536);
  std::ifstream fa(a, std::ios::binary), fb(b, std::ios::binary);
  const std::string ca((std::istreambuf_iterator<char>(fa)), {}), cb((std::istreambuf_iterator<char>(fb)), {});
  EXPECT_EQ(ca, cb);
  EXPECT_EQ(TokenFile(a).dtype(), kDtypeUint16);

  const std::string m = usage_error([&] { write_token_file(d.path() + "/bad.tok", Ids{1, 128256}, 128256); });
  EXPECT_NE(m.find("128256 at position 1"), std::string::npos) << m;
}

TEST(TokenFile32, CorruptU32TokenIsRefusedOnRead) {
  Dir d;
  const std::string p = d.path() + "/c.tok";
  write_token_file(p, Ids{1, 2, 3, 70000, 5}, 70001);
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(kTokenFileHeaderBytes + 4 * 3));
    const uint32_t bad = 90000;
    f.write(reinterpret_cast<const char*>(&bad), 4);
  }
  TokenDataset ds(p, DatasetOptions{4});
  std::vector<int64_t> in(4);
  const std::string m = usage_error([&] { ds.copy_sample(0, in.data(), nullptr); });
  EXPECT_NE(m.find("token 90000 at position 3"), std::string::npos) << m;
}
}  // namespace tokenizer_test

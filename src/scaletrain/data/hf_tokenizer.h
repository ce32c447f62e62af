#pragma once
// Hugging Face `tokenizer.json` tokenizers with a BPE model: byte-level BPE
// behind a regex pre-tokenizer (GPT-2, Llama 3, SmolLM2, Qwen) and
// SentencePiece-style BPE with byte fallback behind the "▁" normalizer or the
// Metaspace pre-tokenizer (Llama 2, TinyLlama, Mistral). Also GPT-2's
// original files (encoder.json + vocab.bpe, or vocab.json + merges.txt).
//
// Encoding follows the reference pipeline:
//   1. added tokens (`added_tokens`, e.g. "<|begin_of_text|>") are found in
//      the raw text first, leftmost-longest; their lstrip/rstrip flags swallow
//      the whitespace beside them. Tokens with "normalized": true are searched
//      in the normalized text instead (step 2), as the reference does;
//   2. each stretch of text between them is normalized, pre-tokenized into
//      words, and each word is encoded by the BPE model (data/bpe.h);
//   3. with add_special_tokens, the post-processor's template adds BOS/EOS.
// The stages and the kinds they support: data/text_pipeline.h. Anything else
// in the file is refused with a one-line UsageError naming the file.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace scaletrain::data {

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool special = false;     // removed by decode(skip_special_tokens)
  bool lstrip = false;      // also consumes the whitespace on its left
  bool rstrip = false;      // also consumes the whitespace on its right
  bool normalized = false;  // matched in the normalized text, not the raw text
};

// Not thread-safe (the BPE word cache): use one object per thread.
class HfTokenizer {
 public:
  // `path`: a tokenizer.json file, or a directory holding tokenizer.json, or
  // encoder.json + vocab.bpe (or vocab.json + merges.txt). A missing file,
  // malformed JSON or an unsupported kind throws UsageError "tokenizer FILE: ...".
  static std::unique_ptr<HfTokenizer> load(const std::string& path);
  ~HfTokenizer();

  // One more than the largest id of the vocabulary and the added tokens.
  uint32_t vocab_size() const { return static_cast<uint32_t>(tokens_.size()); }

  // Appends the ids of `text` (UTF-8; anything else is a UsageError naming
  // the byte offset) to `out`; add_special_tokens applies the post-processor.
  void encode(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens = false);
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = false) {
    std::vector<uint32_t> out;
    encode(text, out, add_special_tokens);
    return out;
  }

  // Text of `ids` through the decoder. Ids outside the vocabulary are
  // skipped (a model's embedding can be larger than its tokenizer's vocabulary).
  std::string decode(const uint32_t* ids, std::size_t count, bool skip_special_tokens = false) const;
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special_tokens = false) const {
    return decode(ids.data(), ids.size(), skip_special_tokens);
  }

  // The file the tokenizer was read from.
  const std::string& file() const { return file_; }
  // Vocabulary spelling of `id` ("" if none), and the id of a spelling.
  const std::string& token(uint32_t id) const;
  std::optional<uint32_t> id_of(const std::string& token) const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }

  // Internal: the parts of the pipeline (defined in hf_tokenizer.cpp).
  struct Impl;

 private:
  explicit HfTokenizer(std::string file);
  void encode_segment(std::string_view text, bool at_start, std::vector<uint32_t>& out);

  std::string file_;
  std::vector<std::string> tokens_;  // id -> vocabulary spelling
  std::vector<bool> special_;        // id -> is a special added token
  std::vector<AddedToken> added_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace scaletrain::data

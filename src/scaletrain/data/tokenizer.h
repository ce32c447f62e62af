#pragma once
// Byte-level tokenizer: every byte of the input is one token, so the vocabulary
// is exactly 256 ids (0..255) and any byte string round-trips losslessly.
//
// Why bytes: the data pipeline has to work before anyone has trained a BPE
// model, and byte tokens make every test corpus (including binary garbage)
// encodable with no unknown-token handling. A learned tokenizer can replace this
// later behind the same encode/decode shape; the token file stores the vocab
// size, so the dataset never assumes 256.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace scaletrain::data {

class ByteTokenizer {
 public:
  // Number of distinct token ids this tokenizer produces.
  static constexpr uint32_t kVocabSize = 256;

  // Replacement byte that decode() writes for an id outside the vocabulary.
  static constexpr char kInvalidChar = '?';

  uint32_t vocab_size() const { return kVocabSize; }

  // One token per byte, in order; the byte value (as unsigned) is the id.
  std::vector<uint16_t> encode(std::string_view text) const;

  // Appends the encoding of `text` to `out` (lets `prepare` stream many files
  // into one buffer without an intermediate vector per file).
  void encode_append(std::string_view text, std::vector<uint16_t>& out) const;

  // Inverse of encode(). Ids >= 256 cannot come from this tokenizer (they can
  // appear when a model with a larger vocabulary samples them); each one is
  // rendered as kInvalidChar rather than dropped, so the output keeps one
  // character per id and positions stay aligned with the id sequence.
  std::string decode(const std::vector<uint16_t>& ids) const;
  std::string decode(const uint16_t* ids, std::size_t count) const;
};

class HfTokenizer;

// The tokenizer a run uses, chosen by a path: "" is the byte tokenizer above,
// anything else a Hugging Face tokenizer.json (or a directory holding one, or
// GPT-2's encoder.json + vocab.bpe), data/hf_tokenizer.h. `prepare` and the
// trainer's text sample go through this, so a token file and the sample of a
// model trained on it agree. Not thread-safe (the BPE word cache).
class Tokenizer {
 public:
  // Throws UsageError "tokenizer PATH: ..." for a file that cannot be used.
  explicit Tokenizer(const std::string& path = "");
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Ids are < vocab_size() (256 for bytes).
  uint32_t vocab_size() const;
  // Appends the ids of `text`; add_special_tokens adds the post-processor's
  // BOS/EOS (no effect on bytes). Invalid UTF-8 is a UsageError for
  // tokenizer.json tokenizers (bytes take anything).
  void encode_append(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens = false);
  std::vector<uint32_t> encode(std::string_view text, bool add_special_tokens = false);
  // Text of `ids`; skip_special_tokens drops the special added tokens.
  std::string decode(const std::vector<uint32_t>& ids, bool skip_special_tokens = false) const;
  // "byte" or the tokenizer file, for log lines.
  std::string describe() const;

 private:
  std::unique_ptr<HfTokenizer> hf_;  // null: bytes
};

}  // namespace scaletrain::data

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

}  // namespace scaletrain::data

#include "scaletrain/data/tokenizer.h"

namespace scaletrain::data {

std::vector<uint16_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<uint16_t> out;
  encode_append(text, out);
  return out;
}

void ByteTokenizer::encode_append(std::string_view text, std::vector<uint16_t>& out) const {
  out.reserve(out.size() + text.size());
  for (char c : text) {
    // Go through unsigned char: plain char is signed on x86, and byte 0xE2
    // must become id 226, not a sign-extended 65506.
    out.push_back(static_cast<uint16_t>(static_cast<unsigned char>(c)));
  }
}

std::string ByteTokenizer::decode(const std::vector<uint16_t>& ids) const {
  return decode(ids.data(), ids.size());
}

std::string ByteTokenizer::decode(const uint16_t* ids, std::size_t count) const {
  std::string out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const uint16_t id = ids[i];
    out.push_back(id < kVocabSize ? static_cast<char>(static_cast<unsigned char>(id)) : kInvalidChar);
  }
  return out;
}

}  // namespace scaletrain::data

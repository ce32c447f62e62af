#include "scaletrain/data/tokenizer.h"

#include "scaletrain/data/hf_tokenizer.h"

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

Tokenizer::Tokenizer(const std::string& path) {
  if (!path.empty()) hf_ = HfTokenizer::load(path);
}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

uint32_t Tokenizer::vocab_size() const { return hf_ ? hf_->vocab_size() : ByteTokenizer::kVocabSize; }

void Tokenizer::encode_append(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens) {
  if (hf_) {
    hf_->encode(text, out, add_special_tokens);
    return;
  }
  out.reserve(out.size() + text.size());
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) {
  std::vector<uint32_t> out;
  encode_append(text, out, add_special_tokens);
  return out;
}

std::string Tokenizer::decode(const std::vector<uint32_t>& ids, bool skip_special_tokens) const {
  if (hf_) return hf_->decode(ids, skip_special_tokens);
  std::string out;
  out.reserve(ids.size());
  for (uint32_t id : ids)
    out.push_back(id < ByteTokenizer::kVocabSize ? static_cast<char>(id) : ByteTokenizer::kInvalidChar);
  return out;
}

std::string Tokenizer::describe() const { return hf_ ? hf_->file() : std::string("byte"); }

}  // namespace scaletrain::data

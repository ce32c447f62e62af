#pragma once
// The text stages of a tokenizer.json tokenizer around the BPE model:
// normalizer (text -> text), pre-tokenizer (text -> words) and decoder
// (token strings -> text), each built from its JSON object. Every kind we do
// not implement is refused when the file is read (UsageError naming the file
// and the kind), never approximated: a tokenizer that splits differently from
// the one a model was trained with silently damages every run.
//
// Supported kinds (Hugging Face tokenizers' names):
//   normalizer:    Sequence, Prepend, Replace (String pattern), NFC, NFD, NFKC, NFKD
//   pre_tokenizer: Sequence, Split (Regex or String pattern, behaviors Isolated,
//                  Removed, MergedWithPrevious, MergedWithNext; invert), ByteLevel,
//                  Metaspace
//   decoder:       Sequence, ByteLevel, Replace (String pattern), ByteFallback, Fuse,
//                  Strip, Metaspace
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace scaletrain::data {

// A compiled PCRE2 pattern (UTF + Unicode properties, JIT-compiled when the
// library supports it). Owns its code and match data (RAII, move-only).
class Regex {
 public:
  // `literal`: the pattern is a plain string, not a regular expression.
  // Throws UsageError "<source>: ..." if the pattern does not compile.
  Regex(const std::string& pattern, bool literal, const std::string& source);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) = delete;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls on_match(begin, end) for each non-overlapping match, left to right
  // (an empty match advances one character). `text` must be valid UTF-8.
  template <typename F>
  void for_each_match(std::string_view text, F&& on_match) const {
    std::size_t at = 0, begin = 0, end = 0;
    while (next_match(text, at, begin, end)) {
      on_match(begin, end);
      at = end > begin ? end : end + 1;
      while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
    }
  }

 private:
  bool next_match(std::string_view text, std::size_t at, std::size_t& begin, std::size_t& end) const;
  void* code_ = nullptr;        // pcre2_code_8*
  void* match_data_ = nullptr;  // pcre2_match_data_8*
  bool jit_ = false;
};

// The GPT-2 pre-tokenizer pattern (ByteLevel with use_regex, and encoder.json/vocab.bpe).
extern const char* const kGpt2Pattern;

class Normalizer {
 public:
  // Null JSON = no normalizer.
  Normalizer(const nlohmann::json& j, const std::string& source);
  ~Normalizer();
  Normalizer(Normalizer&&) noexcept;

  bool empty() const { return steps_.empty(); }
  // Writes the normalized form of `text` to `out`.
  void apply(std::string_view text, std::string& out) const;

  struct Step;

 private:
  std::vector<std::unique_ptr<Step>> steps_;
};

class PreTokenizer {
 public:
  PreTokenizer(const nlohmann::json& j, const std::string& source);
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;

  // Whether a ByteLevel step is present (the model's vocabulary is then in
  // the byte-level alphabet, Note [Byte-level vocabularies] in bpe.h).
  bool byte_level() const { return byte_level_; }

  // Splits `text` into words (views into `text` or into `storage`, which
  // holds the words a step rewrote). `at_start`: `text` begins the input
  // (Metaspace's prepend_scheme "first" acts only there).
  void apply(std::string_view text, bool at_start, std::vector<std::string_view>& words,
             std::deque<std::string>& storage) const;

  struct Step;

 private:
  std::vector<std::unique_ptr<Step>> steps_;
  bool byte_level_ = false;
  mutable std::vector<std::string_view> scratch_;
};

class Decoder {
 public:
  Decoder(const nlohmann::json& j, const std::string& source);
  ~Decoder();
  Decoder(Decoder&&) noexcept;

  // Turns token strings (vocabulary spelling) into text. Without steps the
  // tokens are joined with spaces, as the reference does.
  std::string apply(std::vector<std::string> tokens) const;

  struct Step;

 private:
  std::vector<std::unique_ptr<Step>> steps_;
};

// GPT-2's byte -> printable character map, and its inverse (-1: not in the alphabet).
const std::string& byte_level_char(unsigned char byte);
int byte_level_byte(uint32_t code_point);

}  // namespace scaletrain::data

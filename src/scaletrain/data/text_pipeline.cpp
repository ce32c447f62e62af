#include "scaletrain/data/text_pipeline.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <array>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <utility>

#include "scaletrain/data/utf8.h"
#include "scaletrain/util/error.h"

namespace scaletrain::data {

using nlohmann::json;

const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {

[[noreturn]] void unsupported(const std::string& source, const std::string& what) {
  throw UsageError(source + ": unsupported " + what);
}

std::string type_of(const json& j, const std::string& source, const char* stage) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw UsageError(source + ": " + stage + " without a \"type\"");
  return j["type"].get<std::string>();
}

// The String form of a {"String": ...} / {"Regex": ...} pattern; sets `regex`.
std::string pattern_of(const json& j, bool& regex, const std::string& source, const std::string& where) {
  const json& p = j.at("pattern");
  if (p.contains("String")) {
    regex = false;
    return p["String"].get<std::string>();
  }
  if (p.contains("Regex")) {
    regex = true;
    return p["Regex"].get<std::string>();
  }
  throw UsageError(source + ": " + where + " pattern is neither String nor Regex");
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  std::size_t at = 0;
  for (std::size_t hit; (hit = s.find(from, at)) != std::string::npos; at = hit + from.size()) {
    out.append(s, at, hit - at);
    out.append(to);
  }
  if (at == 0) return;
  out.append(s, at, std::string::npos);
  s.swap(out);
}

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

// How a Split step joins delimiters to their neighbours (Hugging Face's
// SplitDelimiterBehavior, minus Contiguous).
enum class Behavior { Isolated, Removed, MergedWithPrevious, MergedWithNext };

struct Span {
  std::size_t begin, end;
  bool delimiter;
};

// Turns the spans of one word into words, as `behavior` says.
void emit(std::string_view text, const std::vector<Span>& spans, Behavior behavior,
          std::vector<std::string_view>& out) {
  auto piece = [&](std::size_t b, std::size_t e) {
    if (e > b) out.push_back(text.substr(b, e - b));
  };
  switch (behavior) {
    case Behavior::Isolated:
      for (const Span& s : spans) piece(s.begin, s.end);
      return;
    case Behavior::Removed:
      for (const Span& s : spans)
        if (!s.delimiter) piece(s.begin, s.end);
      return;
    case Behavior::MergedWithPrevious: {
      // A delimiter extends the piece before it, unless that piece is itself a delimiter.
      std::vector<Span> merged;
      bool previous_delimiter = false;
      for (const Span& s : spans) {
        if (s.delimiter && !previous_delimiter && !merged.empty())
          merged.back().end = s.end;
        else
          merged.push_back(s);
        previous_delimiter = s.delimiter;
      }
      for (const Span& s : merged) piece(s.begin, s.end);
      return;
    }
    case Behavior::MergedWithNext: {
      // Mirror image: walk right to left.
      std::vector<Span> merged;
      bool next_delimiter = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->delimiter && !next_delimiter && !merged.empty())
          merged.back().begin = it->begin;
        else
          merged.push_back(*it);
        next_delimiter = it->delimiter;
      }
      for (auto it = merged.rbegin(); it != merged.rend(); ++it) piece(it->begin, it->end);
      return;
    }
  }
}

// Spans of `text`: the matches of `re` (delimiters) and the gaps between them.
void spans_of(const Regex& re, std::string_view text, bool invert, std::vector<Span>& spans) {
  spans.clear();
  std::size_t last = 0;
  re.for_each_match(text, [&](std::size_t b, std::size_t e) {
    if (b > last) spans.push_back({last, b, invert});
    if (e > b) spans.push_back({b, e, !invert});
    last = e;
  });
  if (last < text.size()) spans.push_back({last, text.size(), invert});
}

}  // namespace

// ---------------------------------------------------------------------- Regex

Regex::Regex(const std::string& pattern, bool literal, const std::string& source) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  const uint32_t flags = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), flags, &err, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    throw UsageError(source + ": regular expression does not compile at offset " + std::to_string(offset) + ": " +
                     reinterpret_cast<const char*>(msg));
  }
  code_ = code;
  // JIT is an optimisation: where the platform lacks it the interpreter gives the same matches.
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  match_data_ = pcre2_match_data_create_from_pattern(code, nullptr);
}

Regex::~Regex() {
  if (match_data_ != nullptr) pcre2_match_data_free(static_cast<pcre2_match_data*>(match_data_));
  if (code_ != nullptr) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

Regex::Regex(Regex&& o) noexcept
    : code_(std::exchange(o.code_, nullptr)), match_data_(std::exchange(o.match_data_, nullptr)), jit_(o.jit_) {}

bool Regex::next_match(std::string_view text, std::size_t at, std::size_t& begin, std::size_t& end) const {
  if (at > text.size()) return false;
  auto* code = static_cast<pcre2_code*>(code_);
  auto* md = static_cast<pcre2_match_data*>(match_data_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // The input was validated once (HfTokenizer::encode); skip PCRE2's own
  // check, which would otherwise rescan the rest of the text on every call.
  const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr)
                      : pcre2_match(code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof(msg));
    throw UsageError(std::string("regular expression match failed: ") + reinterpret_cast<const char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  begin = ov[0];
  end = ov[1];
  return true;
}

// --------------------------------------------------------------- byte level

namespace {
struct ByteLevelTables {
  std::array<std::string, 256> chars;
  std::array<int, 512> bytes;  // every code point of the alphabet is < 512
  ByteLevelTables() {
    bytes.fill(-1);
    uint32_t next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? b : next++;
      utf8::append(chars[b], cp);
      bytes[cp] = static_cast<int>(b);
    }
  }
};
const ByteLevelTables& tables() {
  static const ByteLevelTables t;
  return t;
}
}  // namespace

const std::string& byte_level_char(unsigned char byte) { return tables().chars[byte]; }
int byte_level_byte(uint32_t cp) { return cp < 512 ? tables().bytes[cp] : -1; }

// ----------------------------------------------------------------- Normalizer

struct Normalizer::Step {
  virtual ~Step() = default;
  virtual void apply(std::string& text) const = 0;
};

namespace {
struct Prepend : Normalizer::Step {
  std::string prefix;
  void apply(std::string& t) const override {
    if (!t.empty()) t.insert(0, prefix);
  }
};
struct ReplaceText : Normalizer::Step {
  std::string from, to;
  void apply(std::string& t) const override { replace_all(t, from, to); }
};
struct UnicodeForm : Normalizer::Step {
  int options = 0;
  void apply(std::string& t) const override {
    if (is_ascii(t)) return;  // ASCII is invariant under every normalization form
    utf8proc_uint8_t* out = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(t.data()),
                                static_cast<utf8proc_ssize_t>(t.size()), &out, static_cast<utf8proc_option_t>(options));
    if (n < 0) throw UsageError(std::string("unicode normalization failed: ") + utf8proc_errmsg(n));
    t.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
    std::free(out);
  }
};

void add_normalizer(const json& j, const std::string& source, std::vector<std::unique_ptr<Normalizer::Step>>& steps) {
  const std::string type = type_of(j, source, "normalizer");
  if (type == "Sequence") {
    for (const json& s : j.at("normalizers")) add_normalizer(s, source, steps);
  } else if (type == "Prepend") {
    auto s = std::make_unique<Prepend>();
    s->prefix = j.at("prepend").get<std::string>();
    steps.push_back(std::move(s));
  } else if (type == "Replace") {
    bool regex = false;
    auto s = std::make_unique<ReplaceText>();
    s->from = pattern_of(j, regex, source, "normalizer Replace");
    if (regex) unsupported(source, "normalizer Replace with a Regex pattern");
    s->to = j.at("content").get<std::string>();
    steps.push_back(std::move(s));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    auto s = std::make_unique<UnicodeForm>();
    s->options = UTF8PROC_STABLE | (type[type.size() - 1] == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
                 (type.size() == 4 ? UTF8PROC_COMPAT : 0);
    steps.push_back(std::move(s));
  } else {
    unsupported(source, "normalizer type " + type);
  }
}
}  // namespace

Normalizer::Normalizer(const json& j, const std::string& source) {
  if (!j.is_null()) add_normalizer(j, source, steps_);
}
Normalizer::~Normalizer() = default;
Normalizer::Normalizer(Normalizer&&) noexcept = default;

void Normalizer::apply(std::string_view text, std::string& out) const {
  out.assign(text.data(), text.size());
  for (const auto& s : steps_) s->apply(out);
}

// --------------------------------------------------------------- PreTokenizer

struct PreTokenizer::Step {
  virtual ~Step() = default;
  virtual void split(std::string_view word, bool at_start, std::vector<std::string_view>& out,
                     std::deque<std::string>& storage) const = 0;
};

namespace {
struct SplitStep : PreTokenizer::Step {
  SplitStep(Regex r, Behavior b, bool inv) : re(std::move(r)), behavior(b), invert(inv) {}
  Regex re;
  Behavior behavior;
  bool invert;
  mutable std::vector<Span> spans;
  void split(std::string_view word, bool, std::vector<std::string_view>& out, std::deque<std::string>&) const override {
    if (behavior == Behavior::Isolated) {  // the common case, without the span list
      std::size_t last = 0;
      re.for_each_match(word, [&](std::size_t b, std::size_t e) {
        if (b > last) out.push_back(word.substr(last, b - last));
        if (e > b) out.push_back(word.substr(b, e - b));
        last = e;
      });
      if (last < word.size()) out.push_back(word.substr(last));
      return;
    }
    spans_of(re, word, invert, spans);
    emit(word, spans, behavior, out);
  }
};

struct ByteLevelStep : PreTokenizer::Step {
  bool add_prefix_space = false;
  std::unique_ptr<SplitStep> regex;  // GPT-2's pattern when use_regex
  void split(std::string_view word, bool at_start, std::vector<std::string_view>& out,
             std::deque<std::string>& storage) const override {
    if (add_prefix_space && (word.empty() || word[0] != ' ')) {
      storage.push_back(" " + std::string(word));
      word = storage.back();
    }
    // The alphabet mapping itself is a no-op here: the vocabulary was decoded
    // to raw bytes instead (Note [Byte-level vocabularies] in bpe.h).
    if (regex) {
      regex->split(word, at_start, out, storage);
    } else if (!word.empty()) {
      out.push_back(word);
    }
  }
};

struct MetaspaceStep : PreTokenizer::Step {
  std::string replacement;
  std::string scheme = "always";  // always | first | never
  bool split_words = true;
  void split(std::string_view word, bool at_start, std::vector<std::string_view>& out,
             std::deque<std::string>& storage) const override {
    std::string s(word);
    replace_all(s, " ", replacement);
    const bool prepend = scheme == "always" || (scheme == "first" && at_start);
    if (prepend && s.compare(0, replacement.size(), replacement) != 0) s.insert(0, replacement);
    storage.push_back(std::move(s));
    const std::string_view t = storage.back();
    if (!split_words) {
      if (!t.empty()) out.push_back(t);
      return;
    }
    std::vector<Span> spans;
    std::size_t last = 0;
    for (std::size_t hit; (hit = t.find(replacement, last)) != std::string_view::npos;
         last = hit + replacement.size()) {
      if (hit > last) spans.push_back({last, hit, false});
      spans.push_back({hit, hit + replacement.size(), true});
    }
    if (last < t.size()) spans.push_back({last, t.size(), false});
    emit(t, spans, Behavior::MergedWithNext, out);
  }
};

Behavior behavior_of(const json& j, const std::string& source) {
  const std::string b = j.value("behavior", std::string("Isolated"));
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "Removed") return Behavior::Removed;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  unsupported(source, "Split behavior " + b);
}

void add_pre_tokenizer(const json& j, const std::string& source,
                       std::vector<std::unique_ptr<PreTokenizer::Step>>& steps, bool& byte_level) {
  const std::string type = type_of(j, source, "pre_tokenizer");
  if (type == "Sequence") {
    for (const json& s : j.at("pretokenizers")) add_pre_tokenizer(s, source, steps, byte_level);
  } else if (type == "Split") {
    bool regex = false;
    const std::string pattern = pattern_of(j, regex, source, "pre_tokenizer Split");
    steps.push_back(
        std::make_unique<SplitStep>(Regex(pattern, !regex, source), behavior_of(j, source), j.value("invert", false)));
  } else if (type == "ByteLevel") {
    auto s = std::make_unique<ByteLevelStep>();
    s->add_prefix_space = j.value("add_prefix_space", true);
    if (j.value("use_regex", true))
      s->regex = std::make_unique<SplitStep>(Regex(kGpt2Pattern, false, source), Behavior::Isolated, false);
    steps.push_back(std::move(s));
    byte_level = true;
  } else if (type == "Metaspace") {
    auto s = std::make_unique<MetaspaceStep>();
    s->replacement = j.value("replacement", std::string("\u2581"));
    if (j.contains("prepend_scheme")) {
      s->scheme = j["prepend_scheme"].get<std::string>();
      if (s->scheme != "always" && s->scheme != "first" && s->scheme != "never")
        unsupported(source, "Metaspace prepend_scheme " + s->scheme);
    } else {
      s->scheme = j.value("add_prefix_space", true) ? "always" : "never";  // older files
    }
    s->split_words = j.value("split", true);
    steps.push_back(std::move(s));
  } else {
    unsupported(source, "pre_tokenizer type " + type);
  }
}
}  // namespace

PreTokenizer::PreTokenizer(const json& j, const std::string& source) {
  if (!j.is_null()) add_pre_tokenizer(j, source, steps_, byte_level_);
}
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;

void PreTokenizer::apply(std::string_view text, bool at_start, std::vector<std::string_view>& words,
                         std::deque<std::string>& storage) const {
  words.clear();
  if (text.empty()) return;
  words.push_back(text);
  for (const auto& step : steps_) {
    scratch_.clear();
    for (std::size_t i = 0; i < words.size(); ++i) step->split(words[i], at_start && i == 0, scratch_, storage);
    words.swap(scratch_);
  }
}

// -------------------------------------------------------------------- Decoder

struct Decoder::Step {
  virtual ~Step() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};

namespace {
struct ByteLevelDecode : Decoder::Step {
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      // A token outside the alphabet (an added token such as "<|x|>" spelled
      // with other characters) keeps its own bytes.
      std::string mapped;
      bool ok = true;
      for (std::size_t i = 0, len = 0; i < t.size() && ok; i += len) {
        const int b = byte_level_byte(utf8::decode(t, i, len));
        ok = b >= 0;
        mapped.push_back(static_cast<char>(b));
      }
      bytes += ok ? mapped : t;
    }
    tokens.assign(1, utf8::lossy(bytes));
  }
};
struct ReplaceDecode : Decoder::Step {
  std::string from, to;
  void apply(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) replace_all(t, from, to);
  }
};
struct ByteFallbackDecode : Decoder::Step {
  static int byte_of(const std::string& t) {
    if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
    char* end = nullptr;
    const long v = std::strtol(t.substr(3, 2).c_str(), &end, 16);
    return end != nullptr && *end == '\0' ? static_cast<int>(v) : -1;
  }
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (utf8::invalid_at(pending) == std::string::npos) {
        out.push_back(pending);
      } else {
        for (std::size_t i = 0; i < pending.size(); ++i) out.emplace_back("\xEF\xBF\xBD");  // one U+FFFD per byte
      }
      pending.clear();
    };
    for (auto& t : tokens) {
      const int b = byte_of(t);
      if (b >= 0) {
        pending.push_back(static_cast<char>(b));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens.swap(out);
  }
};
struct FuseDecode : Decoder::Step {
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, all);
  }
};
struct StripDecode : Decoder::Step {
  std::string content;
  std::size_t start = 0, stop = 0;
  void apply(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      std::size_t b = 0, e = t.size();
      for (std::size_t k = 0; k < start && t.compare(b, content.size(), content) == 0; ++k) b += content.size();
      for (std::size_t k = 0;
           k < stop && e >= b + content.size() && t.compare(e - content.size(), content.size(), content) == 0; ++k)
        e -= content.size();
      t = t.substr(b, e - b);
    }
  }
};
struct MetaspaceDecode : Decoder::Step {
  std::string replacement;
  bool strip_first = true;
  void apply(std::vector<std::string>& tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i == 0 && strip_first && tokens[i].compare(0, replacement.size(), replacement) == 0)
        tokens[i].erase(0, replacement.size());
      replace_all(tokens[i], replacement, " ");
    }
  }
};

void add_decoder(const json& j, const std::string& source, std::vector<std::unique_ptr<Decoder::Step>>& steps) {
  const std::string type = type_of(j, source, "decoder");
  if (type == "Sequence") {
    for (const json& s : j.at("decoders")) add_decoder(s, source, steps);
  } else if (type == "ByteLevel") {
    steps.push_back(std::make_unique<ByteLevelDecode>());
  } else if (type == "Replace") {
    bool regex = false;
    auto s = std::make_unique<ReplaceDecode>();
    s->from = pattern_of(j, regex, source, "decoder Replace");
    if (regex) unsupported(source, "decoder Replace with a Regex pattern");
    s->to = j.at("content").get<std::string>();
    steps.push_back(std::move(s));
  } else if (type == "ByteFallback") {
    steps.push_back(std::make_unique<ByteFallbackDecode>());
  } else if (type == "Fuse") {
    steps.push_back(std::make_unique<FuseDecode>());
  } else if (type == "Strip") {
    auto s = std::make_unique<StripDecode>();
    s->content = j.at("content").get<std::string>();
    s->start = j.value("start", std::size_t{0});
    s->stop = j.value("stop", std::size_t{0});
    steps.push_back(std::move(s));
  } else if (type == "Metaspace") {
    auto s = std::make_unique<MetaspaceDecode>();
    s->replacement = j.value("replacement", std::string("\u2581"));
    s->strip_first = j.contains("prepend_scheme") ? j["prepend_scheme"] != "never" : j.value("add_prefix_space", true);
    steps.push_back(std::move(s));
  } else {
    unsupported(source, "decoder type " + type);
  }
}
}  // namespace

Decoder::Decoder(const json& j, const std::string& source) {
  if (!j.is_null()) add_decoder(j, source, steps_);
}
Decoder::~Decoder() = default;
Decoder::Decoder(Decoder&&) noexcept = default;

std::string Decoder::apply(std::vector<std::string> tokens) const {
  std::string out;
  if (steps_.empty()) {
    for (std::size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const auto& s : steps_) s->apply(tokens);
  for (const auto& t : tokens) out += t;
  return out;
}

}  // namespace scaletrain::data

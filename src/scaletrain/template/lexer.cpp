// The template lexer: text, {{ }}, {% %}, {# #} and {% raw %}, with Jinja's
// whitespace control, and the tokens inside tags (names, numbers, strings
// with Python escapes, operators).
//
// Note [Whitespace]: Jinja 3.1's rules, which transformers renders with
// (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False):
//  - "\r\n" and "\r" read as "\n", and one trailing newline of the source is
//    dropped;
//  - `{%-`, `{{-`, `{#-` strip all whitespace before the tag, `-%}`, `-}}`,
//    `-#}` all whitespace after it (Python's \s: Unicode whitespace too);
//  - lstrip_blocks: before a block or comment tag (not `{{`, not `{%+`), the
//    spaces and tabs between the start of its line and the tag are dropped,
//    provided nothing else is on the line before the tag; "start of line"
//    includes the start of the text right after a tag that ended with a
//    newline it consumed;
//  - trim_blocks: one "\n" right after `%}` or `#}` is dropped (not after
//    `+%}`, nor after `}}`, nor after the `%}` of `{% raw %}` itself).
#include "scaletrain/template/lexer.h"

#include <utf8proc.h>

#include <cstring>

#include "scaletrain/template/text.h"
#include "scaletrain/util/error.h"

namespace scaletrain::tmpl {
namespace {

std::string normalize_newlines(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\r') {
      out += '\n';
      if (i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      out += s[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool all_space(const std::string& s) {
  for (char32_t c : text::decode(s))
    if (!text::is_space(c)) return false;
  return !s.empty();
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }

const char* const kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "*", "/", "%", "~", "[",
                                  "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};

class Lexer {
 public:
  Lexer(const std::string& source, const LexOptions& options, const std::string& name)
      : src_(normalize_newlines(source)), opt_(options), name_(name) {}

  std::vector<Token> run();

 private:
  [[noreturn]] void fail(int line, const std::string& what) const {
    throw UsageError(name_ + " line " + std::to_string(line) + ": " + what);
  }
  void advance_to(std::size_t p) {
    for (; pos_ < p; ++pos_)
      if (src_[pos_] == '\n') ++line_;
  }
  bool at(std::size_t p, const char* s) const { return p <= src_.size() && src_.compare(p, std::strlen(s), s) == 0; }
  std::size_t skip_space(std::size_t p) const;
  void push(Token::Type type, std::string value) { out_.push_back(Token{type, std::move(value), line_}); }
  void emit_text(std::string text) {
    if (!text.empty()) push(Token::Type::Text, std::move(text));
  }
  std::string strip_before(std::string text, char sign, bool variable) const;
  std::size_t end_of_tag(std::size_t p, char kind, std::size_t* end) const;
  bool raw_begin(std::size_t tag, std::size_t* end) const;
  void lex_raw(std::size_t begin_end);
  void lex_comment(std::size_t after);
  void lex_tag(char kind, std::size_t after);
  std::size_t lex_number(std::size_t p);
  std::size_t lex_string(std::size_t p);

  std::string src_;
  LexOptions opt_;
  const std::string& name_;
  std::vector<Token> out_;
  std::size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;  // the last tag ended with a newline it consumed (or nothing was read yet)
};

std::size_t Lexer::skip_space(std::size_t p) const {
  while (p < src_.size()) {
    utf8proc_int32_t c = 0;
    const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(src_.data() + p),
                                    static_cast<utf8proc_ssize_t>(src_.size() - p), &c);
    if (n <= 0 || !text::is_space(static_cast<char32_t>(c))) break;
    p += static_cast<std::size_t>(n);
  }
  return p;
}

std::string Lexer::strip_before(std::string text, char sign, bool variable) const {
  if (sign == '-') return text::rstrip_space(text);
  if (sign == '+' || variable || !opt_.lstrip_blocks) return text;
  const std::size_t nl = text.rfind('\n');
  const std::size_t line_start = nl == std::string::npos ? 0 : nl + 1;
  if ((line_start > 0 || line_starting_) && all_space(text.substr(line_start))) text.resize(line_start);
  return text;
}

// Where the tag closing at `p` ends (its whitespace control applied), or 0 when
// no closing delimiter of `kind` ('%' block, '{' variable, '#' comment) is at p.
std::size_t Lexer::end_of_tag(std::size_t p, char kind, std::size_t* end) const {
  const char* close = kind == '%' ? "%}" : (kind == '#' ? "#}" : "}}");
  if (at(p, "-") && at(p + 1, close)) return *end = skip_space(p + 3);
  if (kind != '{' && at(p, "+") && at(p + 1, close)) return *end = p + 3;
  if (!at(p, close)) return 0;
  *end = p + 2;
  if (kind != '{' && opt_.trim_blocks && *end < src_.size() && src_[*end] == '\n') ++*end;
  return *end;
}

bool Lexer::raw_begin(std::size_t tag, std::size_t* end) const {
  std::size_t p = tag + 2;
  if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
  p = skip_space(p);
  if (!at(p, "raw")) return false;
  p = skip_space(p + 3);
  if (at(p, "-%}")) return *end = skip_space(p + 3), true;
  if (at(p, "%}")) return *end = p + 2, true;
  return false;
}

void Lexer::lex_raw(std::size_t begin_end) {
  line_starting_ = src_[begin_end - 1] == '\n';
  advance_to(begin_end);
  for (std::size_t search = begin_end;;) {
    const std::size_t tag = src_.find("{%", search);
    if (tag == std::string::npos) fail(line_, "missing end of raw directive");
    std::size_t p = tag + 2;
    const char sign = p < src_.size() && (src_[p] == '-' || src_[p] == '+') ? src_[p] : 0;
    p = skip_space(p + (sign ? 1 : 0));
    std::size_t end = 0;
    if (at(p, "endraw") && end_of_tag(skip_space(p + 6), '%', &end)) {
      emit_text(strip_before(src_.substr(begin_end, tag - begin_end), sign, false));
      line_starting_ = src_[end - 1] == '\n';
      advance_to(end);
      return;
    }
    search = tag + 2;
  }
}

void Lexer::lex_comment(std::size_t after) {
  const std::size_t close = src_.find("#}", after);
  if (close == std::string::npos) fail(line_, "missing end of comment tag");
  std::size_t end = 0;
  if (close > after && (src_[close - 1] == '-' || src_[close - 1] == '+'))
    end_of_tag(close - 1, '#', &end);
  else
    end_of_tag(close, '#', &end);
  line_starting_ = src_[end - 1] == '\n';
  advance_to(end);
}

std::size_t Lexer::lex_number(std::size_t p) {
  const std::size_t start = p;
  auto digits = [&](std::size_t q) {
    while (q < src_.size() && (is_digit(src_[q]) || (src_[q] == '_' && q + 1 < src_.size() && is_digit(src_[q + 1]))))
      ++q;
    return q;
  };
  p = digits(p);
  bool is_float = false;
  const bool after_dot = start > 0 && src_[start - 1] == '.';  // `x.0.1` is x[0][1]
  if (!after_dot && p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
    p = digits(p + 1);
    is_float = true;
  }
  if (!after_dot && p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
    std::size_t q = p + 1;
    if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
    if (q < src_.size() && is_digit(src_[q])) {
      p = digits(q);
      is_float = true;
    }
  }
  std::string written;
  for (std::size_t i = start; i < p; ++i)
    if (src_[i] != '_') written += src_[i];
  push(is_float ? Token::Type::Float : Token::Type::Int, written);
  if (is_float)
    out_.back().float_value = std::strtod(written.c_str(), nullptr);
  else
    out_.back().int_value = std::strtoll(written.c_str(), nullptr, 10);
  return p;
}

// A string literal, its escapes decoded as Python's unicode-escape codec does
// (unknown escapes keep their backslash).
std::size_t Lexer::lex_string(std::size_t p) {
  const char quote = src_[p];
  std::string value;
  auto hex = [&](std::size_t q, int n) {
    uint32_t v = 0;
    for (int i = 0; i < n; ++i, ++q) {
      const char c = q < src_.size() ? src_[q] : '\0';
      const int d = is_digit(c)              ? c - '0'
                    : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                    : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                             : -1;
      if (d < 0) fail(line_, "truncated \\x, \\u or \\U escape in a string");
      v = v * 16 + static_cast<uint32_t>(d);
    }
    return v;
  };
  for (++p; p < src_.size() && src_[p] != quote; ++p) {
    if (src_[p] != '\\') {
      value += src_[p];
      continue;
    }
    if (++p >= src_.size()) break;
    const char c = src_[p];
    static const char* const kSimple = "\\\\''\"\"a\ab\bf\fn\nr\rt\tv\v";
    const char* simple = nullptr;
    for (const char* s = kSimple; *s; s += 2)
      if (*s == c) simple = s + 1;
    if (c == '\n') {
      // a backslash before a newline joins the lines
    } else if (simple != nullptr) {
      value += *simple;
    } else if (c >= '0' && c <= '7') {
      uint32_t v = 0;
      for (int i = 0; i < 3 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i, ++p)
        v = v * 8 + (src_[p] - '0');
      --p;
      text::append_utf8(value, v);
    } else if (c == 'x' || c == 'u' || c == 'U') {
      const int n = c == 'x' ? 2 : (c == 'u' ? 4 : 8);
      text::append_utf8(value, hex(p + 1, n));
      p += static_cast<std::size_t>(n);
    } else if (c == 'N') {
      fail(line_, "unsupported escape \\N{...} in a string");
    } else {
      value += '\\';
      value += c;
    }
  }
  if (p >= src_.size()) fail(line_, "unterminated string literal");
  push(Token::Type::String, std::move(value));
  return p + 1;
}

// The tokens of a {{ }} or {% %} tag, up to its closing delimiter (which only
// counts outside brackets, as in Jinja: `{{ {'a': {'b': 1}} }}`).
void Lexer::lex_tag(char kind, std::size_t after) {
  const int begin_line = line_;
  push(kind == '%' ? Token::Type::BlockBegin : Token::Type::VarBegin, kind == '%' ? "{%" : "{{");
  std::vector<char> brackets;
  for (std::size_t p = after;;) {
    std::size_t end = 0;
    if (brackets.empty() && end_of_tag(p, kind, &end)) {
      advance_to(p);
      push(kind == '%' ? Token::Type::BlockEnd : Token::Type::VarEnd, kind == '%' ? "%}" : "}}");
      line_starting_ = src_[end - 1] == '\n';
      advance_to(end);
      return;
    }
    if (p >= src_.size())
      fail(begin_line, std::string("unexpected end of template inside a ") + (kind == '%' ? "{% %} tag" : "{{ }} tag"));
    const std::size_t q = skip_space(p);
    if (q != p) {
      p = q;
      continue;
    }
    advance_to(p);
    const char c = src_[p];
    if (is_digit(c)) {
      p = lex_number(p);
    } else if (is_name_start(c)) {
      std::size_t e = p;
      while (e < src_.size() && (is_name_start(src_[e]) || is_digit(src_[e]))) ++e;
      push(Token::Type::Name, src_.substr(p, e - p));
      p = e;
    } else if (c == '\'' || c == '"') {
      p = lex_string(p);
    } else {
      const char* op = nullptr;
      for (const char* candidate : kOperators)
        if (at(p, candidate)) {
          op = candidate;
          break;
        }
      if (op == nullptr) fail(line_, std::string("unexpected character '") + c + "'");
      if (*op == '(' || *op == '[' || *op == '{') brackets.push_back(*op == '(' ? ')' : (*op == '[' ? ']' : '}'));
      if (*op == ')' || *op == ']' || *op == '}') {
        if (brackets.empty() || brackets.back() != *op) fail(line_, std::string("unexpected '") + op + "'");
        brackets.pop_back();
      }
      push(Token::Type::Op, op);
      p += std::strlen(op);
    }
  }
}

std::vector<Token> Lexer::run() {
  while (pos_ < src_.size()) {
    std::size_t tag = pos_;
    while ((tag = src_.find('{', tag)) != std::string::npos && tag + 1 < src_.size() &&
           (src_[tag + 1] == '\0' || std::strchr("{%#", src_[tag + 1]) == nullptr))
      ++tag;
    if (tag == std::string::npos || tag + 1 >= src_.size()) {
      emit_text(src_.substr(pos_));
      advance_to(src_.size());
      break;
    }
    const char kind = src_[tag + 1];
    const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
    std::size_t raw_end = 0;
    const bool raw = kind == '%' && raw_begin(tag, &raw_end);
    emit_text(strip_before(src_.substr(pos_, tag - pos_), sign, kind == '{'));
    advance_to(tag);
    const std::size_t after = tag + 2 + (sign ? 1 : 0);
    if (raw)
      lex_raw(raw_end);
    else if (kind == '#')
      lex_comment(after);
    else
      lex_tag(kind, after);
  }
  push(Token::Type::Eof, "");
  return std::move(out_);
}

}  // namespace

std::vector<Token> tokenize(const std::string& source, const LexOptions& options, const std::string& source_name) {
  return Lexer(source, options, source_name).run();
}

}  // namespace scaletrain::tmpl

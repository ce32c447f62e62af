// Python's str operations on UTF-8 text (code points, Unicode whitespace,
// case mapping through utf8proc); see text.h.
#include "scaletrain/template/text.h"

#include <utf8proc.h>

#include <algorithm>

namespace scaletrain::tmpl::text {

std::u32string decode(const std::string& s) {
  std::u32string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t c = 0;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &c);
    if (n <= 0) {  // an invalid byte: one replacement character, move on by one byte
      c = 0xFFFD;
      n = 1;
    }
    out.push_back(static_cast<char32_t>(c));
    p += n;
    left -= n;
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  utf8proc_uint8_t buf[4];
  const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

std::string encode(const std::u32string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

bool is_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_printable(char32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

std::string strip(const std::string& s, const std::optional<std::string>& chars, bool left, bool right) {
  const std::u32string u = decode(s);
  const std::u32string set = chars ? decode(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : is_space(c); };
  std::size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return encode(u.substr(b, e - b));
}

std::string rstrip_space(const std::string& s) { return strip(s, std::nullopt, false, true); }

namespace {

// split(None): runs of whitespace separate, leading and trailing ones vanish.
std::vector<std::u32string> split_space(const std::u32string& u, long maxsplit, bool from_right) {
  std::vector<std::u32string> parts;
  if (!from_right) {
    std::size_t i = 0;
    while (true) {
      while (i < u.size() && is_space(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<long>(parts.size()) == maxsplit) {
        parts.push_back(u.substr(i));
        break;
      }
      std::size_t j = i;
      while (j < u.size() && !is_space(u[j])) ++j;
      parts.push_back(u.substr(i, j - i));
      i = j;
    }
    return parts;
  }
  long i = static_cast<long>(u.size());
  while (true) {
    while (i > 0 && is_space(u[i - 1])) --i;
    if (i <= 0) break;
    if (maxsplit >= 0 && static_cast<long>(parts.size()) == maxsplit) {
      parts.push_back(u.substr(0, i));
      break;
    }
    long j = i;
    while (j > 0 && !is_space(u[j - 1])) --j;
    parts.push_back(u.substr(j, i - j));
    i = j;
  }
  std::reverse(parts.begin(), parts.end());
  return parts;
}

}  // namespace

std::vector<std::string> split(const std::string& s, const std::optional<std::string>& sep, long maxsplit,
                               bool from_right) {
  std::vector<std::string> out;
  if (!sep) {
    for (const auto& p : split_space(decode(s), maxsplit, from_right)) out.push_back(encode(p));
    return out;
  }
  // UTF-8 is self-synchronizing: splitting bytes at a separator splits code points.
  if (!from_right) {
    std::size_t start = 0;
    for (std::size_t at; (maxsplit < 0 || static_cast<long>(out.size()) < maxsplit) &&
                         (at = s.find(*sep, start)) != std::string::npos;) {
      out.push_back(s.substr(start, at - start));
      start = at + sep->size();
    }
    out.push_back(s.substr(start));
    return out;
  }
  std::size_t end = s.size();
  while (maxsplit < 0 || static_cast<long>(out.size()) < maxsplit) {
    if (end < sep->size()) break;
    const std::size_t at = s.rfind(*sep, end - sep->size());
    if (at == std::string::npos) break;
    out.push_back(s.substr(at + sep->size(), end - at - sep->size()));
    end = at;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> splitlines(const std::string& s, bool keepends) {
  const std::u32string u = decode(s);
  std::vector<std::string> out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < u.size(); ++i) {
    const char32_t c = u[i];
    const bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                     c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    std::size_t end = i;
    if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
    out.push_back(encode(u.substr(start, (keepends ? i + 1 : end) - start)));
    start = i + 1;
  }
  if (start < u.size()) out.push_back(encode(u.substr(start)));
  return out;
}

std::string replace(const std::string& s, const std::string& old, const std::string& with, long count) {
  std::string out;
  if (old.empty()) {  // Python inserts `with` between code points, and at both ends
    const std::u32string u = decode(s);
    long done = 0;
    for (std::size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < u.size()) append_utf8(out, u[i]);
    }
    return out;
  }
  std::size_t start = 0;
  long done = 0;
  for (std::size_t at; (count < 0 || done < count) && (at = s.find(old, start)) != std::string::npos; ++done) {
    out.append(s, start, at - start);
    out += with;
    start = at + old.size();
  }
  out.append(s, start, std::string::npos);
  return out;
}

long count(const std::string& s, const std::string& sub) {
  if (sub.empty()) return static_cast<long>(decode(s).size()) + 1;
  long n = 0;
  for (std::size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
  return n;
}

namespace {

// Python maps case with Unicode's full mappings, where a few characters become
// several (ß -> SS); utf8proc has the one-to-one mappings for the rest.
struct Special {
  char32_t c;
  const char32_t* upper;
  const char32_t* title;
  const char32_t* lower;
};
const Special kSpecial[] = {
    {0x00DF, U"SS", U"Ss", nullptr},           {0xFB00, U"FF", U"Ff", nullptr},
    {0xFB01, U"FI", U"Fi", nullptr},           {0xFB02, U"FL", U"Fl", nullptr},
    {0xFB03, U"FFI", U"Ffi", nullptr},         {0xFB04, U"FFL", U"Ffl", nullptr},
    {0xFB05, U"ST", U"St", nullptr},           {0xFB06, U"ST", U"St", nullptr},
    {0x0149, U"\u02BCN", U"\u02BCN", nullptr}, {0x0130, nullptr, nullptr, U"i\u0307"},
};

enum class Case { Upper, Title, Lower };

void map_case(std::u32string& out, char32_t c, Case to) {
  for (const auto& s : kSpecial) {
    const char32_t* m = to == Case::Upper ? s.upper : (to == Case::Title ? s.title : s.lower);
    if (s.c == c && m != nullptr) {
      out += m;
      return;
    }
  }
  const auto cp = static_cast<utf8proc_int32_t>(c);
  out += static_cast<char32_t>(to == Case::Upper   ? utf8proc_toupper(cp)
                               : to == Case::Title ? utf8proc_totitle(cp)
                                                   : utf8proc_tolower(cp));
}

std::string map_all(const std::string& s, Case to) {
  std::u32string out;
  for (char32_t c : decode(s)) map_case(out, c, to);
  return encode(out);
}

bool is_cased(char32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

}  // namespace

std::string upper(const std::string& s) { return map_all(s, Case::Upper); }
std::string lower(const std::string& s) { return map_all(s, Case::Lower); }

std::string capitalize(const std::string& s) {
  std::u32string out;
  bool first = true;
  for (char32_t c : decode(s)) {
    map_case(out, c, first ? Case::Title : Case::Lower);
    first = false;
  }
  return encode(out);
}

std::string title(const std::string& s) {
  std::u32string out;
  bool previous_cased = false;
  for (char32_t c : decode(s)) {
    map_case(out, c, previous_cased ? Case::Lower : Case::Title);
    previous_cased = is_cased(c);
  }
  return encode(out);
}

// Jinja's title filter: each word's first character upper-cased, the rest lower-cased.
std::string jinja_title(const std::string& s) {
  auto separator = [](char32_t c) { return is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<'; };
  std::u32string out;
  bool word_start = true;
  for (char32_t c : decode(s)) {
    if (separator(c)) {
      out += c;
      word_start = true;
      continue;
    }
    map_case(out, c, word_start ? Case::Upper : Case::Lower);
    word_start = false;
  }
  return encode(out);
}

std::string center(const std::string& s, long width) {
  const std::u32string u = decode(s);
  const long n = static_cast<long>(u.size());
  if (width <= n) return s;
  const long pad = width - n;
  const long left = pad / 2 + (pad & width & 1);  // CPython's rule for odd padding
  return std::string(static_cast<std::size_t>(left), ' ') + s + std::string(static_cast<std::size_t>(pad - left), ' ');
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace scaletrain::tmpl::text

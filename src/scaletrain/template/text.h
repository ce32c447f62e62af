#pragma once
// Python's str operations on UTF-8 text, as chat templates use them.
//
// Python strings are sequences of code points, so len, indexing, slicing and
// reversing work on code points, not bytes; strip() and split() without
// arguments use Python's Unicode whitespace (U+3000 and U+00A0 included);
// upper/lower/title map case through utf8proc (simple case mapping).
#include <optional>
#include <string>
#include <vector>

namespace scaletrain::tmpl::text {

std::u32string decode(const std::string& s);  // invalid bytes pass through as U+FFFD
std::string encode(const std::u32string& s);
void append_utf8(std::string& out, char32_t c);

bool is_space(char32_t c);      // str.isspace
bool is_printable(char32_t c);  // str.isprintable (repr escapes the others)

// str.strip / lstrip / rstrip; `chars` absent means whitespace.
std::string strip(const std::string& s, const std::optional<std::string>& chars, bool left, bool right);
std::string rstrip_space(const std::string& s);  // the lexer's `{%-` strip
// str.split / rsplit: `sep` absent splits on runs of whitespace.
std::vector<std::string> split(const std::string& s, const std::optional<std::string>& sep, long maxsplit,
                               bool from_right);
std::vector<std::string> splitlines(const std::string& s, bool keepends);
std::string replace(const std::string& s, const std::string& old, const std::string& with, long count);
long count(const std::string& s, const std::string& sub);

std::string upper(const std::string& s);
std::string lower(const std::string& s);
std::string capitalize(const std::string& s);   // str.capitalize
std::string title(const std::string& s);        // str.title
std::string jinja_title(const std::string& s);  // Jinja's title filter (words split at spaces, -, ( { [ <)
std::string center(const std::string& s, long width);
std::string html_escape(const std::string& s);  // markupsafe.escape

}  // namespace scaletrain::tmpl::text

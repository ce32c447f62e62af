#pragma once
// Splits a template into text and the tokens of its tags, applying Jinja's
// whitespace rules on the way (see lexer.cpp's Note [Whitespace]).
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::tmpl {

struct Token {
  enum class Type { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };
  Type type;
  std::string value;  // the text, name, decoded string, operator, or number as written
  int line;           // 1-based line of the source where the token starts
  int64_t int_value = 0;
  double float_value = 0;
};

struct LexOptions {
  bool trim_blocks = true;    // drop the first newline after a block or comment tag
  bool lstrip_blocks = true;  // drop spaces and tabs between a line's start and a block or comment tag
};

// Throws UsageError "<source_name> line N: <problem>" on a malformed tag.
std::vector<Token> tokenize(const std::string& source, const LexOptions& options, const std::string& source_name);

}  // namespace scaletrain::tmpl

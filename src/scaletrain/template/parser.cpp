// The template parser, statements: the template body, {% if %}, {% for %},
// {% set %}, {% macro %}, {% with %}, {% filter %}, {% generation %}, loop
// controls, and the tags it refuses (extends, include, import, call, ...).
// Expressions are in parser_expr.cpp.
#include "scaletrain/template/parser.h"

#include <algorithm>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/parser_impl.h"

namespace scaletrain::tmpl {
namespace detail {

Body Parser::parse_body(const std::vector<std::string>& end_tags) {
  Body body;
  while (true) {
    const Token& t = cur();
    if (t.type == T::Eof) {
      if (end_tags.empty()) return body;
      std::string want;
      for (const auto& tag : end_tags) want += (want.empty() ? "'" : " or '") + tag + "'";
      fail(t.line, "unexpected end of template, expected " + want);
    }
    if (t.type == T::Text) {
      auto s = std::make_unique<Stmt>();
      s->kind = Stmt::Kind::Text;
      s->line = t.line;
      s->text = next().value;
      body.push_back(std::move(s));
    } else if (t.type == T::VarBegin) {
      auto s = std::make_unique<Stmt>();
      s->kind = Stmt::Kind::Output;
      s->line = next().line;
      s->expr = parse_tuple(true);
      if (cur().type != T::VarEnd) fail(cur().line, "expected end of print statement, got " + describe(cur()));
      next();
      body.push_back(std::move(s));
    } else if (t.type == T::BlockBegin) {
      if (peek().type == T::Name && std::find(end_tags.begin(), end_tags.end(), peek().value) != end_tags.end())
        return body;  // the caller consumes its end tag
      next();
      body.push_back(parse_statement());
    } else {
      unexpected();
    }
  }
}

void Parser::expect_end_tag(const std::string& tag) {
  next();  // BlockBegin (parse_body stopped on it)
  if (cur().value != tag) fail(cur().line, "expected '" + tag + "', got " + describe(cur()));
  next();
  expect_block_end();
}

std::unique_ptr<Stmt> Parser::parse_statement() {
  const Token& t = cur();
  const int line = t.line;
  if (t.type != T::Name) fail(line, "tag name expected, got " + describe(t));
  const std::string tag = next().value;
  if (tag == "if") return parse_if(line);
  if (tag == "for") return parse_for(line);
  if (tag == "set") return parse_set(line);
  if (tag == "macro") return parse_macro(line);
  if (tag == "with") return parse_with(line);
  auto s = std::make_unique<Stmt>();
  s->line = line;
  if (tag == "break" || tag == "continue") {
    if (loop_depth_ == 0) fail(line, "'" + tag + "' outside of a for loop");
    s->kind = tag == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
    expect_block_end();
    return s;
  }
  if (tag == "filter" || tag == "generation") {
    s->kind = tag == "filter" ? Stmt::Kind::FilterBlock : Stmt::Kind::Block;
    if (tag == "filter") {
      do s->exprs.push_back(parse_filter(nullptr));
      while (skip_op("|"));
    }
    expect_block_end();
    s->body = parse_body({"end" + tag});
    expect_end_tag("end" + tag);
    return s;
  }
  static const char* const kRefused[] = {"extends", "block", "include",    "import", "from",
                                         "call",    "do",    "autoescape", "trans",  "raw"};
  for (const char* refused : kRefused)
    if (tag == refused) fail(line, "unsupported tag '" + tag + "'");
  if (tag.rfind("end", 0) == 0 || tag == "else" || tag == "elif") fail(line, "unexpected tag '" + tag + "'");
  fail(line, "unknown tag '" + tag + "'");
}

std::unique_ptr<Stmt> Parser::parse_if(int line) {
  auto s = std::make_unique<Stmt>();
  s->kind = Stmt::Kind::If;
  s->line = line;
  while (true) {
    ExprPtr cond = parse_tuple(false);
    expect_block_end();
    Body body = parse_body({"elif", "else", "endif"});
    s->branches.emplace_back(std::move(cond), std::move(body));
    next();  // BlockBegin
    const std::string tag = next().value;
    if (tag == "elif") continue;
    if (tag == "else") {
      expect_block_end();
      s->else_body = parse_body({"endif"});
      expect_end_tag("endif");
    } else {
      expect_block_end();
    }
    return s;
  }
}

void Parser::parse_targets(Stmt& s) {
  const bool parens = skip_op("(");
  do {
    if (parens && is_op(")")) break;
    s.targets.push_back(expect_name());
    if (is_op(",")) s.unpack = true;
  } while (skip_op(","));
  if (parens) {
    expect_op(")");
    s.unpack = true;
  }
}

std::unique_ptr<Stmt> Parser::parse_for(int line) {
  auto s = std::make_unique<Stmt>();
  s->kind = Stmt::Kind::For;
  s->line = line;
  parse_targets(*s);
  if (!skip_name("in")) fail(cur().line, "expected 'in', got " + describe(cur()));
  s->expr = parse_tuple(false, "recursive");
  if (skip_name("if")) s->cond = parse_expression();
  if (is_name("recursive")) fail(cur().line, "unsupported loop modifier 'recursive'");
  expect_block_end();
  ++loop_depth_;
  s->body = parse_body({"endfor", "else"});
  --loop_depth_;
  next();
  if (next().value == "else") {
    expect_block_end();
    s->else_body = parse_body({"endfor"});
    expect_end_tag("endfor");
  } else {
    expect_block_end();
  }
  return s;
}

std::unique_ptr<Stmt> Parser::parse_set(int line) {
  auto s = std::make_unique<Stmt>();
  s->line = line;
  if (cur().type == T::Name && peek().type == T::Op && peek().value == ".") {
    s->kind = Stmt::Kind::SetAttr;
    s->text = next().value;
    next();
    s->attr = expect_name();
    expect_op("=");
    s->expr = parse_tuple(true);
    expect_block_end();
    return s;
  }
  parse_targets(*s);
  if (skip_op("=")) {
    s->kind = Stmt::Kind::Set;
    s->expr = parse_tuple(true);
    expect_block_end();
    return s;
  }
  s->kind = Stmt::Kind::SetBlock;
  while (skip_op("|")) s->exprs.push_back(parse_filter(nullptr));
  expect_block_end();
  s->body = parse_body({"endset"});
  expect_end_tag("endset");
  return s;
}

std::unique_ptr<Stmt> Parser::parse_macro(int line) {
  auto s = std::make_unique<Stmt>();
  s->kind = Stmt::Kind::Macro;
  s->line = line;
  s->text = expect_name();
  expect_op("(");
  while (!is_op(")")) {
    if (!s->targets.empty()) expect_op(",");
    if (is_op(")")) break;
    s->targets.push_back(expect_name());
    if (skip_op("="))
      s->exprs.push_back(parse_expression());
    else if (!s->exprs.empty() && s->exprs.back())
      fail(cur().line, "non-default argument follows default argument");
    else
      s->exprs.push_back(nullptr);
  }
  expect_op(")");
  expect_block_end();
  const int saved_depth = loop_depth_;
  loop_depth_ = 0;
  s->body = parse_body({"endmacro"});
  loop_depth_ = saved_depth;
  expect_end_tag("endmacro");
  return s;
}

std::unique_ptr<Stmt> Parser::parse_with(int line) {
  auto s = std::make_unique<Stmt>();
  s->kind = Stmt::Kind::With;
  s->line = line;
  while (cur().type != T::BlockEnd) {
    if (!s->targets.empty()) expect_op(",");
    s->targets.push_back(expect_name());
    expect_op("=");
    s->exprs.push_back(parse_expression());
  }
  expect_block_end();
  s->body = parse_body({"endwith"});
  expect_end_tag("endwith");
  return s;
}

}  // namespace detail

Body parse(std::vector<Token> tokens, const std::string& source_name) {
  return detail::Parser(std::move(tokens), source_name).parse_template();
}

}  // namespace scaletrain::tmpl

#pragma once
// The parser's class, shared by parser.cpp (statements) and
// parser_expr.cpp (expressions); not part of the API.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/template/ast.h"
#include "scaletrain/template/lexer.h"
#include "scaletrain/util/error.h"

namespace scaletrain::tmpl::detail {

using T = Token::Type;

// Recursive descent over the lexer's tokens; throws UsageError "<source> line N: ...".
class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& name) : toks_(std::move(tokens)), name_(name) {}

  Body parse_template() { return parse_body({}); }

 private:
  // --- token stream ---
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(std::size_t n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  const Token& next() { return toks_[pos_ < toks_.size() - 1 ? pos_++ : pos_]; }
  bool is_op(const char* op) const { return cur().type == T::Op && cur().value == op; }
  bool is_name(const char* n) const { return cur().type == T::Name && cur().value == n; }
  bool skip_op(const char* op) { return is_op(op) ? (next(), true) : false; }
  bool skip_name(const char* n) { return is_name(n) ? (next(), true) : false; }
  [[noreturn]] void fail(int line, const std::string& what) const {
    throw UsageError(name_ + " line " + std::to_string(line) + ": " + what);
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case T::Eof:
        return "end of template";
      case T::BlockEnd:
        return "end of statement block";
      case T::VarEnd:
        return "end of print statement";
      case T::String:
        return "string";
      default:
        return "'" + t.value + "'";
    }
  }
  [[noreturn]] void unexpected() const { fail(cur().line, "unexpected " + describe(cur())); }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(cur().line, std::string("expected '") + op + "', got " + describe(cur()));
  }
  std::string expect_name() {
    if (cur().type != T::Name) fail(cur().line, "expected a name, got " + describe(cur()));
    return next().value;
  }
  void expect_block_end() {
    if (cur().type != T::BlockEnd) fail(cur().line, "expected end of statement block, got " + describe(cur()));
    next();
  }
  static ExprPtr node(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // --- statements ---
  Body parse_body(const std::vector<std::string>& end_tags);
  void expect_end_tag(const std::string& tag);
  std::unique_ptr<Stmt> parse_statement();
  std::unique_ptr<Stmt> parse_if(int line);
  std::unique_ptr<Stmt> parse_for(int line);
  std::unique_ptr<Stmt> parse_set(int line);
  std::unique_ptr<Stmt> parse_macro(int line);
  std::unique_ptr<Stmt> parse_with(int line);
  void parse_targets(Stmt& s);

  // --- expressions ---
  ExprPtr parse_tuple(bool with_condexpr, const char* extra_end = nullptr, bool explicit_parens = false);
  ExprPtr parse_expression(bool with_condexpr = true) { return with_condexpr ? parse_condexpr() : parse_or(); }
  ExprPtr parse_condexpr();
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_math1();
  ExprPtr parse_concat();
  ExprPtr parse_math2();
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter);
  ExprPtr parse_primary();
  ExprPtr parse_collection(const char* close, Expr::Kind kind);
  ExprPtr parse_postfix(ExprPtr e);
  ExprPtr parse_filter_expr(ExprPtr e);
  ExprPtr parse_subscript(ExprPtr e);
  void parse_call_args(Expr& e);
  ExprPtr parse_filter(ExprPtr input);
  ExprPtr parse_test(ExprPtr input);

  std::vector<Token> toks_;
  std::size_t pos_ = 0;
  const std::string& name_;
  int loop_depth_ = 0;  // break/continue are only allowed inside a for body
};

}  // namespace scaletrain::tmpl::detail

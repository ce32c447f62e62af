// The template parser, expressions: Jinja's grammar, recursive descent
// (statements are in parser.cpp). Precedence, loosest first (as jinja2/parser.py has it):
//   x if c else y  <  or  <  and  <  not  <  comparisons, in, not in
//   <  + -  <  ~  <  * / // %  <  **  <  unary - +  <  | filter, is test, call
//   <  .attr, [item], [a:b:c], (call)  <  literals, names, ( ), [ ], { }
// so `'a' + x | trim` filters x alone and `not x is none` negates the test.
#include "scaletrain/template/builtins.h"
#include "scaletrain/template/parser_impl.h"

namespace scaletrain::tmpl::detail {

// --- expressions -------------------------------------------------------------------
ExprPtr Parser::parse_tuple(bool with_condexpr, const char* extra_end, bool explicit_parens) {
  const int line = cur().line;
  std::vector<ExprPtr> items;
  bool is_tuple = false;
  while (true) {
    if (!items.empty()) expect_op(",");
    const bool end = cur().type == T::VarEnd || cur().type == T::BlockEnd || is_op(")") ||
                     (extra_end != nullptr && is_name(extra_end));
    if (end) break;
    items.push_back(parse_expression(with_condexpr));
    if (!is_op(",")) break;
    is_tuple = true;
  }
  if (!is_tuple) {
    if (items.size() == 1) return std::move(items[0]);
    if (!explicit_parens) fail(cur().line, "expected an expression, got " + describe(cur()));
  }
  ExprPtr e = node(Expr::Kind::Tuple, line);
  e->args = std::move(items);
  return e;
}

ExprPtr Parser::parse_condexpr() {
  ExprPtr e = parse_or();
  while (is_name("if")) {
    const int line = next().line;
    ExprPtr c = node(Expr::Kind::Cond, line);
    ExprPtr test = parse_or();
    ExprPtr otherwise = skip_name("else") ? parse_condexpr() : nullptr;
    c->args.push_back(std::move(test));
    c->args.push_back(std::move(e));
    c->args.push_back(std::move(otherwise));
    e = std::move(c);
  }
  return e;
}

ExprPtr Parser::parse_or() {
  ExprPtr e = parse_and();
  while (is_name("or")) {
    ExprPtr o = node(Expr::Kind::Or, next().line);
    o->args.push_back(std::move(e));
    o->args.push_back(parse_and());
    e = std::move(o);
  }
  return e;
}

ExprPtr Parser::parse_and() {
  ExprPtr e = parse_not();
  while (is_name("and")) {
    ExprPtr a = node(Expr::Kind::And, next().line);
    a->args.push_back(std::move(e));
    a->args.push_back(parse_not());
    e = std::move(a);
  }
  return e;
}

ExprPtr Parser::parse_not() {
  if (!is_name("not")) return parse_compare();
  ExprPtr n = node(Expr::Kind::Not, next().line);
  n->args.push_back(parse_not());
  return n;
}

ExprPtr Parser::parse_compare() {
  const int line = cur().line;
  ExprPtr first = parse_math1();
  std::vector<std::string> ops;
  std::vector<ExprPtr> operands;
  while (true) {
    if (cur().type == T::Op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
      ops.push_back(next().value);
    } else if (is_name("in")) {
      next();
      ops.push_back("in");
    } else if (is_name("not") && peek().type == T::Name && peek().value == "in") {
      next();
      next();
      ops.push_back("not in");
    } else {
      break;
    }
    operands.push_back(parse_math1());
  }
  if (ops.empty()) return first;
  ExprPtr c = node(Expr::Kind::Compare, line);
  c->args.push_back(std::move(first));
  for (auto& o : operands) c->args.push_back(std::move(o));
  c->ops = std::move(ops);
  return c;
}

ExprPtr Parser::parse_math1() {
  ExprPtr e = parse_concat();
  while (is_op("+") || is_op("-")) {
    ExprPtr b = node(Expr::Kind::Binary, cur().line);
    b->name = next().value;
    b->args.push_back(std::move(e));
    b->args.push_back(parse_concat());
    e = std::move(b);
  }
  return e;
}

ExprPtr Parser::parse_concat() {
  const int line = cur().line;
  ExprPtr e = parse_math2();
  if (!is_op("~")) return e;
  ExprPtr c = node(Expr::Kind::Concat, line);
  c->args.push_back(std::move(e));
  while (skip_op("~")) c->args.push_back(parse_math2());
  return c;
}

ExprPtr Parser::parse_math2() {
  ExprPtr e = parse_pow();
  while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
    ExprPtr b = node(Expr::Kind::Binary, cur().line);
    b->name = next().value;
    b->args.push_back(std::move(e));
    b->args.push_back(parse_pow());
    e = std::move(b);
  }
  return e;
}

ExprPtr Parser::parse_pow() {
  ExprPtr e = parse_unary(true);
  while (is_op("**")) {
    ExprPtr b = node(Expr::Kind::Binary, cur().line);
    b->name = next().value;
    b->args.push_back(std::move(e));
    b->args.push_back(parse_unary(true));
    e = std::move(b);
  }
  return e;
}

ExprPtr Parser::parse_unary(bool with_filter) {
  ExprPtr e;
  if (is_op("-") || is_op("+")) {
    const Expr::Kind kind = is_op("-") ? Expr::Kind::Neg : Expr::Kind::Pos;
    e = node(kind, next().line);
    e->args.push_back(parse_unary(false));
  } else {
    e = parse_primary();
  }
  e = parse_postfix(std::move(e));
  return with_filter ? parse_filter_expr(std::move(e)) : std::move(e);
}

ExprPtr Parser::parse_primary() {
  const Token& t = cur();
  ExprPtr e = node(Expr::Kind::Literal, t.line);
  switch (t.type) {
    case T::Name:
      if (t.value == "true" || t.value == "True" || t.value == "false" || t.value == "False") {
        e->literal = Value::boolean(t.value[0] == 't' || t.value[0] == 'T');
      } else if (t.value == "none" || t.value == "None") {
        e->literal = Value::none();
      } else {
        e->kind = Expr::Kind::Name;
        e->name = t.value;
      }
      next();
      return e;
    case T::String: {
      std::string s;
      while (cur().type == T::String) s += next().value;  // adjacent literals join, as in Python
      e->literal = Value::string(std::move(s));
      return e;
    }
    case T::Int:
      e->literal = Value::integer(next().int_value);
      return e;
    case T::Float:
      e->literal = Value::number(next().float_value);
      return e;
    case T::Op:
      if (skip_op("(")) {
        e = parse_tuple(true, nullptr, true);
        expect_op(")");
        return e;
      }
      if (skip_op("[")) return parse_collection("]", Expr::Kind::List);
      if (skip_op("{")) return parse_collection("}", Expr::Kind::Dict);
      unexpected();
    default:
      unexpected();
  }
}

// After the opening bracket: items (or key: value pairs) up to `close`; a trailing comma is allowed.
ExprPtr Parser::parse_collection(const char* close, Expr::Kind kind) {
  ExprPtr e = node(kind, cur().line);
  while (!is_op(close)) {
    if (!e->args.empty()) {
      expect_op(",");
      if (is_op(close)) break;
    }
    e->args.push_back(parse_expression());
    if (kind == Expr::Kind::Dict) {
      expect_op(":");
      e->args.push_back(parse_expression());
    }
  }
  expect_op(close);
  return e;
}

ExprPtr Parser::parse_postfix(ExprPtr e) {
  while (true) {
    if (is_op(".") || is_op("[")) {
      e = parse_subscript(std::move(e));
    } else if (is_op("(")) {
      ExprPtr c = node(Expr::Kind::Call, cur().line);
      c->args.push_back(std::move(e));
      parse_call_args(*c);
      e = std::move(c);
    } else {
      return e;
    }
  }
}

ExprPtr Parser::parse_filter_expr(ExprPtr e) {
  while (true) {
    if (is_op("|")) {
      next();
      e = parse_filter(std::move(e));
    } else if (is_name("is")) {
      e = parse_test(std::move(e));
    } else if (is_op("(")) {
      ExprPtr c = node(Expr::Kind::Call, cur().line);
      c->args.push_back(std::move(e));
      parse_call_args(*c);
      e = std::move(c);
    } else {
      return e;
    }
  }
}

ExprPtr Parser::parse_subscript(ExprPtr e) {
  const Token& t = next();
  if (t.value == ".") {
    if (cur().type == T::Name) {
      ExprPtr a = node(Expr::Kind::Attr, t.line);
      a->name = next().value;
      a->args.push_back(std::move(e));
      return a;
    }
    if (cur().type != T::Int) fail(cur().line, "expected name or number after '.'");
    ExprPtr i = node(Expr::Kind::Item, t.line);  // `x.0` is x[0]
    i->args.push_back(std::move(e));
    i->args.push_back(parse_primary());
    return i;
  }
  // `[`: an index or a slice (a tuple of indexes is refused: no Python object here takes one).
  const int line = t.line;
  ExprPtr bounds[3];
  int colons = 0;
  while (!is_op("]")) {
    if (skip_op(":")) {
      if (++colons > 2) unexpected();
      continue;
    }
    if (bounds[colons]) unexpected();
    bounds[colons] = parse_expression();
  }
  expect_op("]");
  if (colons == 0) {
    if (!bounds[0]) fail(line, "expected an index inside [ ]");
    ExprPtr i = node(Expr::Kind::Item, line);
    i->args.push_back(std::move(e));
    i->args.push_back(std::move(bounds[0]));
    return i;
  }
  ExprPtr s = node(Expr::Kind::Slice, line);
  s->args.push_back(std::move(e));
  for (auto& b : bounds) s->args.push_back(std::move(b));
  return s;
}

void Parser::parse_call_args(Expr& e) {
  expect_op("(");
  bool first = true;
  while (!is_op(")")) {
    if (!first) {
      expect_op(",");
      if (is_op(")")) break;
    }
    first = false;
    if (is_op("*") || is_op("**")) fail(cur().line, "unsupported argument unpacking '" + cur().value + "'");
    if (cur().type == T::Name && peek().type == T::Op && peek().value == "=") {
      std::string key = next().value;
      next();
      e.kwargs.emplace_back(std::move(key), parse_expression());
    } else {
      if (!e.kwargs.empty()) fail(cur().line, "positional argument follows keyword argument");
      e.args.push_back(parse_expression());
    }
  }
  expect_op(")");
}

// After `|` (or at `{% filter`/`{% set x |`): name [(args)]; input null for block filters.
ExprPtr Parser::parse_filter(ExprPtr input) {
  ExprPtr f = node(Expr::Kind::Filter, cur().line);
  f->name = expect_name();
  f->filter = find_filter(f->name);
  if (f->filter == nullptr) fail(f->line, "unsupported filter '" + f->name + "'");
  f->args.push_back(std::move(input));
  if (is_op("(")) parse_call_args(*f);
  return f;
}

ExprPtr Parser::parse_test(ExprPtr input) {
  ExprPtr t = node(Expr::Kind::Test, next().line);  // `is`
  t->negated = skip_name("not");
  t->name = expect_name();
  t->test = find_test(t->name);
  if (t->test == nullptr) fail(t->line, "unsupported test '" + t->name + "'");
  t->args.push_back(std::move(input));
  if (is_op("(")) {
    parse_call_args(*t);
  } else if ((cur().type == T::Name || cur().type == T::String || cur().type == T::Int || cur().type == T::Float ||
              is_op("[") || is_op("{")) &&
             !is_name("else") && !is_name("or") && !is_name("and")) {
    if (is_name("is")) fail(cur().line, "tests cannot be chained with 'is'");
    t->args.push_back(parse_postfix(parse_primary()));  // `x is divisibleby 3`
  }
  return t;
}

}  // namespace scaletrain::tmpl::detail

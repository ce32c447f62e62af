#pragma once
// The parsed template: expression and statement nodes. Built once by the
// parser, read-only afterwards (rendering never changes it, so one Template
// renders on many threads at once).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/template/value.h"

namespace scaletrain::tmpl {

using FilterFn = Value (*)(const Value& input, CallArgs& args);
using TestFn = bool (*)(const Value& input, CallArgs& args);

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,  // literal
    Name,     // name
    List,     // args: items
    Tuple,    // args: items
    Dict,     // args: key0, value0, key1, value1, ...
    Attr,     // args[0].name
    Item,     // args[0][args[1]]
    Slice,    // args[0][args[1]:args[2]:args[3]], absent bounds null
    Call,     // args[0](args[1:], kwargs)
    Filter,   // args[0] | name(args[1:], kwargs); args[0] null in {% set x | f %} and {% filter %}
    Test,     // args[0] is [not] name(args[1:], kwargs)
    Neg,      // -args[0]
    Pos,      // +args[0]
    Not,      // not args[0]
    Binary,   // args[0] name args[1], name one of + - * / // % **
    Concat,   // args joined with ~
    Compare,  // args[0] ops[0] args[1] ops[1] args[2] ...
    And,      // args[0] and args[1]
    Or,       // args[0] or args[1]
    Cond,     // args[1] if args[0] else args[2] (args[2] null: Undefined)
  };
  Kind kind;
  int line;
  std::string name;
  Value literal;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  bool negated = false;       // Test: `is not`
  FilterFn filter = nullptr;  // Filter: resolved when parsed
  TestFn test = nullptr;      // Test: resolved when parsed
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class Kind {
    Text,         // text
    Output,       // {{ expr }}
    If,           // branches (condition, body), else_body
    For,          // for targets in expr [if cond]: body, else_body
    Set,          // set targets = expr
    SetAttr,      // set name.attr = expr (a namespace)
    SetBlock,     // set targets [| filters]: body endset
    Macro,        // macro name(targets = defaults): body
    Break,        // loopcontrols
    Continue,     // loopcontrols
    With,         // with targets = values: body
    FilterBlock,  // filter filters: body endfilter
    Block,        // body rendered in place ({% generation %})
  };
  Kind kind;
  int line;
  std::string text;                  // Text; SetAttr and Macro: the name
  std::string attr;                  // SetAttr: the attribute
  std::vector<std::string> targets;  // For, Set, SetBlock: names assigned; Macro: parameters; With: names
  bool unpack = false;               // targets were written as a tuple (`for k, v in ...`)
  ExprPtr expr;                      // Output, For (iterable), Set, SetAttr
  ExprPtr cond;                      // For: the `if` filter
  std::vector<ExprPtr> exprs;        // Macro: defaults (null: none); With: values; SetBlock, FilterBlock: filters
  std::vector<std::pair<ExprPtr, Body>> branches;  // If
  Body body, else_body;
};

}  // namespace scaletrain::tmpl

#pragma once
// What the evaluator calls on values: operators, attribute and item access
// (with the bound methods of str and dict), filters, tests and the global
// functions, each with Python's (and Jinja's) behaviour.
#include <cstdint>
#include <optional>
#include <string>

#include "scaletrain/template/ast.h"
#include "scaletrain/template/value.h"

namespace scaletrain::tmpl {

// ops.cpp
Value binary_op(const std::string& op, const Value& a, const Value& b);  // + - * / // % **
Value negate(const Value& v);
bool contains(const Value& container, const Value& item);  // `item in container`
// Jinja's getattr: a Python attribute (a method of str or dict) first, then the item.
Value get_attr(const Value& obj, const std::string& name);
// Jinja's getitem: the item first, then (for a string key) the attribute.
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// methods.cpp: a bound method of a str or dict, or Undefined.
std::optional<Value> method(const Value& obj, const std::string& name);

// filters.cpp: Python's `fmt % args` for the conversions templates use.
std::string printf_format(const std::string& fmt, const ValueList& args, bool may_leave_unused = false);
// filters.cpp, predicates.cpp; null when Jinja (as transformers configures it) has no such filter or test.
FilterFn find_filter(const std::string& name);
TestFn find_test(const std::string& name);

// methods.cpp: the raise_exception of a template, as the evaluator throws it.
class RaiseError : public EvalError {
 public:
  explicit RaiseError(const std::string& message) : EvalError(message) {}
};

// methods.cpp: range, dict, namespace, raise_exception, strftime_now (formatting `now`, Unix
// seconds in UTC, or the local time when absent).
std::vector<std::pair<std::string, Value>> global_functions(std::optional<int64_t> now);

}  // namespace scaletrain::tmpl

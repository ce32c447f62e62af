// Jinja's tests (`x is defined`, `x is string`, `n is divisibleby 3`), as
// jinja2/tests.py defines them on Python values. A name missing from the
// table is refused when the template is parsed.
#include <utf8proc.h>

#include <cmath>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/text.h"

namespace scaletrain::tmpl {
namespace {

using K = Value::Kind;

Value arg(CallArgs& a, const char* test) {
  a.check(test, 1, {});
  if (a.positional.empty()) throw EvalError(std::string("test '") + test + "' needs an argument");
  return a.positional[0];
}

bool t_defined(const Value& v, CallArgs&) { return !v.is_undefined(); }
bool t_undefined(const Value& v, CallArgs&) { return v.is_undefined(); }
bool t_none(const Value& v, CallArgs&) { return v.is_none(); }
bool t_boolean(const Value& v, CallArgs&) { return v.is(K::Bool); }
bool t_false(const Value& v, CallArgs&) { return v.is(K::Bool) && !v.as_bool(); }
bool t_true(const Value& v, CallArgs&) { return v.is(K::Bool) && v.as_bool(); }
bool t_integer(const Value& v, CallArgs&) { return v.is(K::Int); }
bool t_float(const Value& v, CallArgs&) { return v.is(K::Float); }
bool t_number(const Value& v, CallArgs&) { return v.is_number(); }  // Python's bool is a Number
bool t_string(const Value& v, CallArgs&) { return v.is_string(); }
bool t_mapping(const Value& v, CallArgs&) { return v.is_mapping(); }
// Jinja's Undefined iterates (as empty), has a length and an item getter.
bool t_iterable(const Value& v, CallArgs&) {
  return v.is_undefined() || v.is_string() || v.is_sequence() || v.is_mapping();
}
bool t_callable(const Value& v, CallArgs&) { return v.is(K::Callable) || v.is_undefined(); }
bool t_escaped(const Value&, CallArgs&) { return false; }

bool t_sameas(const Value& v, CallArgs& a) {
  const Value other = arg(a, "sameas");
  if (v.kind() != other.kind()) return false;
  switch (v.kind()) {
    case K::None:
    case K::Undefined:
      return true;
    case K::Bool:
      return v.as_bool() == other.as_bool();
    case K::Int:
      return v.as_int() == other.as_int() && v.as_int() >= -5 && v.as_int() <= 256;  // CPython's cached ints
    case K::List:
    case K::Tuple:
      return &v.items() == &other.items();
    default:
      return equals(v, other) && !v.is_string() && !v.is(K::Float);
  }
}

int64_t remainder(const Value& v, const Value& by, const char* test) {
  const Value r = binary_op("%", v, by);
  if (!r.is_number()) throw EvalError(std::string("test '") + test + "' needs a number");
  return r.as_double() == 0 ? 0 : 1;
}
bool t_odd(const Value& v, CallArgs&) { return remainder(v, Value::integer(2), "odd") != 0; }
bool t_even(const Value& v, CallArgs&) { return remainder(v, Value::integer(2), "even") == 0; }
bool t_divisibleby(const Value& v, CallArgs& a) { return remainder(v, arg(a, "divisibleby"), "divisibleby") == 0; }

bool t_eq(const Value& v, CallArgs& a) { return equals(v, arg(a, "eq")); }
bool t_ne(const Value& v, CallArgs& a) { return !equals(v, arg(a, "ne")); }
bool t_lt(const Value& v, CallArgs& a) { return compare(v, arg(a, "lt"), "<") < 0; }
bool t_le(const Value& v, CallArgs& a) { return compare(v, arg(a, "le"), "<=") <= 0; }
bool t_gt(const Value& v, CallArgs& a) { return compare(v, arg(a, "gt"), ">") > 0; }
bool t_ge(const Value& v, CallArgs& a) { return compare(v, arg(a, "ge"), ">=") >= 0; }
bool t_in(const Value& v, CallArgs& a) { return contains(arg(a, "in"), v); }

// str.islower / str.isupper: some cased character, and none of the other case.
bool cased_all(const Value& v, bool lower) {
  bool any = false;
  for (char32_t c : text::decode(to_str(v))) {
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
    if (cat == UTF8PROC_CATEGORY_LL) {
      if (!lower) return false;
      any = true;
    } else if (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT) {
      if (lower) return false;
      any = true;
    }
  }
  return any;
}
bool t_lower(const Value& v, CallArgs&) { return cased_all(v, true); }
bool t_upper(const Value& v, CallArgs&) { return cased_all(v, false); }

struct TestEntry {
  const char* name;
  TestFn fn;
};

const TestEntry kTests[] = {
    {"defined", t_defined},
    {"undefined", t_undefined},
    {"none", t_none},
    {"boolean", t_boolean},
    {"false", t_false},
    {"true", t_true},
    {"integer", t_integer},
    {"float", t_float},
    {"number", t_number},
    {"string", t_string},
    {"mapping", t_mapping},
    {"iterable", t_iterable},
    {"sequence", t_iterable},
    {"callable", t_callable},
    {"escaped", t_escaped},
    {"sameas", t_sameas},
    {"odd", t_odd},
    {"even", t_even},
    {"divisibleby", t_divisibleby},
    {"eq", t_eq},
    {"equalto", t_eq},
    {"==", t_eq},
    {"ne", t_ne},
    {"!=", t_ne},
    {"lt", t_lt},
    {"lessthan", t_lt},
    {"<", t_lt},
    {"le", t_le},
    {"<=", t_le},
    {"gt", t_gt},
    {"greaterthan", t_gt},
    {">", t_gt},
    {"ge", t_ge},
    {">=", t_ge},
    {"in", t_in},
    {"lower", t_lower},
    {"upper", t_upper},
};

}  // namespace

TestFn find_test(const std::string& name) {
  for (const auto& t : kTests)
    if (name == t.name) return t.fn;
  return nullptr;
}

}  // namespace scaletrain::tmpl

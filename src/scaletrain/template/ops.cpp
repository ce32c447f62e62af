// Operators and access on values with Python's semantics: arithmetic
// (floor division and modulo round toward minus infinity, / is always a
// float), `in`, Jinja's getattr/getitem (attribute first for `.x`, item first
// for `[x]`, a missing one gives Undefined), and slices.
#include <cmath>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/text.h"

namespace scaletrain::tmpl {
namespace {

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b) {
  throw EvalError("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

bool is_integral(const Value& v) { return v.is(Value::Kind::Int) || v.is(Value::Kind::Bool); }

Value repeat(const Value& seq, int64_t n) {
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return Value::string(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return seq.is(Value::Kind::Tuple) ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

Value add(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (is_integral(a) && is_integral(b)) return Value::integer(a.as_int() + b.as_int());
    return Value::number(a.as_double() + b.as_double());
  }
  if (a.is_string() && b.is_string()) return Value::string(a.str() + b.str());
  if (a.is_sequence() && a.kind() == b.kind()) {
    ValueList out = a.items();
    out.insert(out.end(), b.items().begin(), b.items().end());
    return a.is(Value::Kind::Tuple) ? Value::tuple(std::move(out)) : Value::list(std::move(out));
  }
  if (a.is_string() || a.is_sequence())
    throw EvalError("can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a));
  unsupported("+", a, b);
}

Value divide(const std::string& op, const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) unsupported(op, a, b);
  const bool ints = is_integral(a) && is_integral(b);
  if (ints ? b.as_int() == 0 : b.as_double() == 0.0)
    throw EvalError(op == "/" ? "division by zero"
                              : (op == "//" ? "integer division or modulo by zero" : "modulo by zero"));
  if (op == "/") return Value::number(a.as_double() / b.as_double());
  if (ints) {
    const int64_t x = a.as_int(), y = b.as_int();
    int64_t q = x / y, r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) {
      --q;
      r += y;
    }
    return Value::integer(op == "//" ? q : r);
  }
  // CPython's float divmod: the remainder takes the divisor's sign.
  const double x = a.as_double(), y = b.as_double();
  double mod = std::fmod(x, y), div = (x - mod) / y;
  if (mod != 0) {
    if ((y < 0) != (mod < 0)) {
      mod += y;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, y);
  }
  if (op == "%") return Value::number(mod);
  double floordiv = std::copysign(0.0, x / y);
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  }
  return Value::number(floordiv);
}

Value power(const Value& a, const Value& b) {
  if (!a.is_number() || !b.is_number()) unsupported("** or pow()", a, b);
  if (is_integral(a) && is_integral(b) && b.as_int() >= 0) {
    int64_t result = 1, base = a.as_int();
    for (int64_t e = b.as_int(); e > 0; e >>= 1, base *= base)
      if (e & 1) result *= base;
    return Value::integer(result);
  }
  return Value::number(std::pow(a.as_double(), b.as_double()));
}

}  // namespace

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "%" && a.is_string()) {
    // Python: a tuple gives the arguments; a list, dict or Undefined is one
    // argument that a format without conversions may leave unused.
    const bool mapping_like = b.is(Value::Kind::List) || b.is(Value::Kind::Dict) || b.is_undefined();
    return Value::string(printf_format(a.str(), b.is(Value::Kind::Tuple) ? b.items() : ValueList{b}, mapping_like));
  }
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (op == "+") return add(a, b);
  if (op == "-") {
    if (!a.is_number() || !b.is_number()) unsupported(op, a, b);
    if (is_integral(a) && is_integral(b)) return Value::integer(a.as_int() - b.as_int());
    return Value::number(a.as_double() - b.as_double());
  }
  if (op == "*") {
    if (a.is_number() && b.is_number()) {
      if (is_integral(a) && is_integral(b)) return Value::integer(a.as_int() * b.as_int());
      return Value::number(a.as_double() * b.as_double());
    }
    if ((a.is_string() || a.is_sequence()) && is_integral(b)) return repeat(a, b.as_int());
    if ((b.is_string() || b.is_sequence()) && is_integral(a)) return repeat(b, a.as_int());
    unsupported(op, a, b);
  }
  if (op == "/" || op == "//" || op == "%") return divide(op, a, b);
  if (op == "**") return power(a, b);
  throw EvalError("unknown operator " + op);
}

Value negate(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (is_integral(v)) return Value::integer(-v.as_int());
  if (v.is(Value::Kind::Float)) return Value::number(-v.as_double());
  throw EvalError("bad operand type for unary -: '" + type_name(v) + "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::Undefined:
      return false;
    case Value::Kind::String:
      if (!item.is_string()) throw EvalError("'in <string>' requires string as left operand, not " + type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::List:
    case Value::Kind::Tuple:
      for (const auto& v : container.items())
        if (equals(v, item)) return true;
      return false;
    case Value::Kind::Dict:
      if (item.is(Value::Kind::List) || item.is(Value::Kind::Dict))
        throw EvalError("unhashable type: '" + type_name(item) + "'");
      return container.dict().find(item) != nullptr;
    default:
      throw EvalError("argument of type '" + type_name(container) + "' is not iterable");
  }
}

namespace {

Value missing(const Value& obj, const std::string& name) {
  const std::string what = obj.is_none() ? "'None'" : "'" + type_name(obj) + " object'";
  return Value::undefined(what + " has no attribute '" + name + "'");
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (auto m = method(obj, name)) return *m;
  if (obj.is_mapping() || obj.is(Value::Kind::Namespace))
    if (const Value* v = obj.dict().find(name)) return *v;
  return missing(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  if ((obj.is_sequence() || obj.is_string()) && is_integral(key)) {
    if (obj.is_string()) {
      const std::u32string u = text::decode(obj.str());
      int64_t i = key.as_int();
      if (i < 0) i += static_cast<int64_t>(u.size());
      if (i < 0 || i >= static_cast<int64_t>(u.size())) return missing(obj, to_str(key));
      return Value::string(text::encode(u.substr(static_cast<std::size_t>(i), 1)));
    }
    int64_t i = key.as_int();
    if (i < 0) i += static_cast<int64_t>(obj.items().size());
    if (i < 0 || i >= static_cast<int64_t>(obj.items().size())) return missing(obj, to_str(key));
    return obj.items()[static_cast<std::size_t>(i)];
  }
  if (obj.is_mapping())
    if (const Value* v = obj.dict().find(key)) return *v;
  if (key.is_string()) return get_attr(obj, key.str());
  return missing(obj, to_str(key));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (!obj.is_sequence() && !obj.is_string()) return missing(obj, "slice");
  auto bound = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_none() || v.is_undefined()) return std::nullopt;
    if (!is_integral(v)) throw EvalError(std::string("slice ") + what + " must be an integer or None");
    return v.as_int();
  };
  const int64_t st = bound(step, "step").value_or(1);
  if (st == 0) throw EvalError("slice step cannot be zero");
  const std::u32string chars = obj.is_string() ? text::decode(obj.str()) : std::u32string();
  const int64_t n = obj.is_string() ? static_cast<int64_t>(chars.size()) : static_cast<int64_t>(obj.items().size());
  auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t i = *v;
    if (i < 0) {
      i += n;
      if (i < 0) i = st < 0 ? -1 : 0;
    } else if (i >= n) {
      i = st < 0 ? n - 1 : n;
    }
    return i;
  };
  const int64_t b = adjust(bound(start, "start"), st < 0 ? n - 1 : 0);
  const int64_t e = adjust(bound(stop, "stop"), st < 0 ? -1 : n);
  std::u32string s;
  ValueList items;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
    if (obj.is_string())
      s += chars[static_cast<std::size_t>(i)];
    else
      items.push_back(obj.items()[static_cast<std::size_t>(i)]);
  }
  if (obj.is_string()) return Value::string(text::encode(s));
  return obj.is(Value::Kind::Tuple) ? Value::tuple(std::move(items)) : Value::list(std::move(items));
}

}  // namespace scaletrain::tmpl

// Value: construction, and Python's str/repr/bool/==/</len/iter and
// json.dumps on it (see value.h).
#include "scaletrain/template/value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "scaletrain/template/text.h"

namespace scaletrain::tmpl {

// --- construction -----------------------------------------------------------
Value Value::undefined(std::string hint) {
  Value v;
  v.s_ = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::Bool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::Int;
  v.i_ = i;
  return v;
}
Value Value::number(double f) {
  Value v;
  v.kind_ = Kind::Float;
  v.f_ = f;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::String;
  v.s_ = std::move(s);
  return v;
}
Value Value::list(ValueList items) {
  Value v;
  v.kind_ = Kind::List;
  v.list_ = std::make_shared<const ValueList>(std::move(items));
  return v;
}
Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::Tuple;
  return v;
}
Value Value::dict(std::shared_ptr<DictData> d) {
  Value v;
  v.kind_ = Kind::Dict;
  v.dict_ = std::move(d);
  return v;
}
Value Value::namespace_(std::shared_ptr<DictData> d) {
  Value v = dict(std::move(d));
  v.kind_ = Kind::Namespace;
  return v;
}
Value Value::function(std::string name, std::function<Value(CallArgs&)> fn) {
  Value v;
  v.kind_ = Kind::Callable;
  v.fn_ = std::make_shared<const Function>(Function{std::move(name), std::move(fn)});
  return v;
}

const ValueList& Value::items() const {
  static const ValueList empty;
  return list_ ? *list_ : empty;
}

const Value* DictData::find(const Value& key) const {
  for (const auto& [k, v] : entries)
    if (equals(k, key)) return &v;
  return nullptr;
}

const Value* DictData::find(const std::string& key) const {
  for (const auto& [k, v] : entries)
    if (k.is_string() && k.str() == key) return &v;
  return nullptr;
}

void DictData::set(const Value& key, Value value) {
  for (auto& [k, v] : entries)
    if (equals(k, key)) {
      v = std::move(value);
      return;
    }
  entries.emplace_back(key, std::move(value));
}

Value CallArgs::get(std::size_t index, const std::string& name, Value fallback) const {
  if (index < positional.size()) return positional[index];
  for (const auto& [k, v] : keyword)
    if (k == name) return v;
  return fallback;
}

void CallArgs::check(const std::string& callee, std::size_t max_positional,
                     const std::vector<std::string>& names) const {
  if (positional.size() > max_positional)
    throw EvalError(callee + "() takes at most " + std::to_string(max_positional) + " positional argument(s) (" +
                    std::to_string(positional.size()) + " given)");
  for (const auto& [k, v] : keyword) {
    bool known = false;
    for (const auto& n : names) known = known || n == k;
    if (!known) throw EvalError(callee + "() got an unexpected keyword argument '" + k + "'");
  }
}

Value from_json(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return Value::none();
    case Json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case Json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(INT64_MAX) ? Value::number(static_cast<double>(u))
                                                  : Value::integer(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Value::number(j.get<double>());
    case Json::value_t::string:
      return Value::string(j.get<std::string>());
    case Json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::list(std::move(items));
    }
    case Json::value_t::object: {
      auto d = std::make_shared<DictData>();
      d->entries.reserve(j.size());
      for (const auto& [k, v] : j.items()) d->entries.emplace_back(Value::string(k), from_json(v));
      return Value::dict(std::move(d));
    }
    default:
      throw EvalError("unsupported JSON value in the context");
  }
}

// --- str and repr -------------------------------------------------------------
std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return "Undefined";
    case Value::Kind::None:
      return "NoneType";
    case Value::Kind::Bool:
      return "bool";
    case Value::Kind::Int:
      return "int";
    case Value::Kind::Float:
      return "float";
    case Value::Kind::String:
      return "str";
    case Value::Kind::List:
      return "list";
    case Value::Kind::Tuple:
      return "tuple";
    case Value::Kind::Dict:
      return "dict";
    case Value::Kind::Namespace:
      return "Namespace";
    case Value::Kind::Callable:
      return "function";
  }
  return "object";
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {  // the shortest digits that read back as d
    std::snprintf(buf, sizeof(buf), "%.*e", precision - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string s(buf), digits;
  const bool negative = s[0] == '-';
  const std::size_t e = s.find('e');
  for (std::size_t i = negative ? 1 : 0; i < e; ++i)
    if (s[i] != '.') digits += s[i];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const int exp = std::atoi(s.c_str() + e + 1);
  std::string out = negative ? "-" : "";
  if (exp >= -4 && exp < 16) {  // Python's repr switches to exponents outside [1e-4, 1e16)
    if (exp < 0) return out + "0." + std::string(static_cast<std::size_t>(-exp - 1), '0') + digits;
    const auto int_len = static_cast<std::size_t>(exp) + 1;
    if (digits.size() <= int_len) return out + digits + std::string(int_len - digits.size(), '0') + ".0";
    return out + digits.substr(0, int_len) + "." + digits.substr(int_len);
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + ebuf;
}

namespace {

std::string repr_string(const std::string& s) {
  const bool double_quoted = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char quote = double_quoted ? '"' : '\'';
  std::string out(1, quote);
  char buf[12];
  for (char32_t c : text::decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F || (c > 0x7F && !text::is_printable(c))) {
      const char* fmt = c <= 0xFF ? "\\x%02x" : (c <= 0xFFFF ? "\\u%04x" : "\\U%08x");
      std::snprintf(buf, sizeof(buf), fmt, static_cast<unsigned>(c));
      out += buf;
    } else {
      text::append_utf8(out, c);
    }
  }
  return out + quote;
}

std::string repr_dict(const DictData& d) {
  std::string out = "{";
  for (std::size_t i = 0; i < d.entries.size(); ++i)
    out += (i ? ", " : "") + repr(d.entries[i].first) + ": " + repr(d.entries[i].second);
  return out + "}";
}

}  // namespace

std::string repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::String:
      return repr_string(v.str());
    case Value::Kind::Undefined:
      return "Undefined";
    default:
      return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return "";
    case Value::Kind::None:
      return "None";
    case Value::Kind::Bool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::Int:
      return std::to_string(v.as_int());
    case Value::Kind::Float:
      return float_repr(v.as_double());
    case Value::Kind::String:
      return v.str();
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      const bool tuple = v.is(Value::Kind::Tuple);
      std::string out = tuple ? "(" : "[";
      for (std::size_t i = 0; i < v.items().size(); ++i) out += (i ? ", " : "") + repr(v.items()[i]);
      if (tuple && v.items().size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Value::Kind::Dict:
      return repr_dict(v.dict());
    case Value::Kind::Namespace:
      return "<Namespace " + repr_dict(v.dict()) + ">";
    case Value::Kind::Callable:
      return "<function " + v.function().name + ">";
  }
  return "";
}

// --- truth, equality, order -------------------------------------------------------
bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return false;
    case Value::Kind::Bool:
      return v.as_bool();
    case Value::Kind::Int:
      return v.as_int() != 0;
    case Value::Kind::Float:
      return v.as_double() != 0.0;
    case Value::Kind::String:
      return !v.str().empty();
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return !v.items().empty();
    case Value::Kind::Dict:
      return !v.dict().entries.empty();
    default:
      return true;
  }
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is(Value::Kind::Float) || b.is(Value::Kind::Float)) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return true;
    case Value::Kind::String:
      return a.str() == b.str();
    case Value::Kind::List:
    case Value::Kind::Tuple: {
      if (a.items().size() != b.items().size()) return false;
      for (std::size_t i = 0; i < a.items().size(); ++i)
        if (!equals(a.items()[i], b.items()[i])) return false;
      return true;
    }
    case Value::Kind::Dict: {
      if (a.dict().entries.size() != b.dict().entries.size()) return false;
      for (const auto& [k, v] : a.dict().entries) {
        const Value* other = b.dict().find(k);
        if (other == nullptr || !equals(v, *other)) return false;
      }
      return true;
    }
    case Value::Kind::Namespace:
      return &a.dict() == &b.dict();
    case Value::Kind::Callable:
      return &a.function() == &b.function();
    default:
      return false;
  }
}

void fail_undefined(const Value& v) { throw EvalError(v.str().empty() ? std::string("value is undefined") : v.str()); }

int compare(const Value& a, const Value& b, const char* op) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is(Value::Kind::Float) || b.is(Value::Kind::Float)) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    return a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int() ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : (a.str() > b.str() ? 1 : 0);
  if (a.kind() == b.kind() && a.is_sequence()) {
    const auto &x = a.items(), &y = b.items();
    for (std::size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return compare(x[i], y[i], op);
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  throw EvalError(std::string("'") + op + "' not supported between instances of '" + type_name(a) + "' and '" +
                  type_name(b) + "'");
}

ValueList iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return {};
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return v.items();
    case Value::Kind::String: {
      ValueList out;
      for (char32_t c : text::decode(v.str())) {
        std::string s;
        text::append_utf8(s, c);
        out.push_back(Value::string(std::move(s)));
      }
      return out;
    }
    case Value::Kind::Dict: {
      ValueList out;
      for (const auto& e : v.dict().entries) out.push_back(e.first);
      return out;
    }
    default:
      throw EvalError("'" + type_name(v) + "' object is not iterable");
  }
}

std::size_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined:
      return 0;
    case Value::Kind::String:
      return text::decode(v.str()).size();
    case Value::Kind::List:
    case Value::Kind::Tuple:
      return v.items().size();
    case Value::Kind::Dict:
      return v.dict().entries.size();
    default:
      throw EvalError("object of type '" + type_name(v) + "' has no len()");
  }
}

// --- json.dumps -----------------------------------------------------------------
namespace {

void dump_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  char buf[16];
  for (char32_t c : text::decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
          if (c > 0xFFFF) {  // a surrogate pair, as Python writes it
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          text::append_utf8(out, c);
        }
    }
  }
  out += '"';
}

std::string dump_key(const Value& k) {
  switch (k.kind()) {
    case Value::Kind::String:
      return k.str();
    case Value::Kind::Bool:
      return k.as_bool() ? "true" : "false";
    case Value::Kind::None:
      return "null";
    case Value::Kind::Int:
    case Value::Kind::Float:
      return to_str(k);
    default:
      throw EvalError("keys must be str, int, float, bool or None, not " + type_name(k));
  }
}

struct Dumper {
  const std::string* indent;  // null: one line
  std::string item_sep, key_sep;
  bool sort_keys, ensure_ascii;
  std::string out;

  void newline(int level) {
    out += '\n';
    for (int i = 0; i < level; ++i) out += *indent;
  }

  void dump(const Value& v, int level) {
    switch (v.kind()) {
      case Value::Kind::None:
        out += "null";
        return;
      case Value::Kind::Bool:
        out += v.as_bool() ? "true" : "false";
        return;
      case Value::Kind::Int:
        out += std::to_string(v.as_int());
        return;
      case Value::Kind::Float: {
        const double d = v.as_double();
        out += std::isnan(d) ? "NaN" : (std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : float_repr(d));
        return;
      }
      case Value::Kind::String:
        dump_string(out, v.str(), ensure_ascii);
        return;
      case Value::Kind::List:
      case Value::Kind::Tuple:
        return dump_items(v, level);
      case Value::Kind::Dict:
        return dump_dict(v.dict(), level);
      default:
        throw EvalError("Object of type " + type_name(v) + " is not JSON serializable");
    }
  }

  void open(char bracket, std::size_t i, int level) {
    out += i == 0 ? std::string(1, bracket) : item_sep;
    if (indent) newline(level + 1);
  }

  void close(char bracket, int level) {
    if (indent) newline(level);
    out += bracket;
  }

  void dump_items(const Value& v, int level) {
    if (v.items().empty()) {
      out += "[]";
      return;
    }
    for (std::size_t i = 0; i < v.items().size(); ++i) {
      open('[', i, level);
      dump(v.items()[i], level + 1);
    }
    close(']', level);
  }

  void dump_dict(const DictData& d, int level) {
    if (d.entries.empty()) {
      out += "{}";
      return;
    }
    std::vector<std::pair<std::string, const Value*>> entries;
    for (const auto& [k, v] : d.entries) entries.emplace_back(dump_key(k), &v);
    if (sort_keys)
      std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (std::size_t i = 0; i < entries.size(); ++i) {
      open('{', i, level);
      dump_string(out, entries[i].first, ensure_ascii);
      out += key_sep;
      dump(*entries[i].second, level + 1);
    }
    close('}', level);
  }
};

}  // namespace

std::string dumps(const Value& v, const DumpOptions& options) {
  const Value& indent = options.indent;
  std::string indent_str;
  if (indent.is(Value::Kind::Int)) {
    indent_str = std::string(static_cast<std::size_t>(std::max<int64_t>(indent.as_int(), 0)), ' ');
  } else if (indent.is_string()) {
    indent_str = indent.str();
  } else if (!indent.is_none() && !indent.is_undefined()) {
    throw EvalError("tojson indent must be an int or a string, not " + type_name(indent));
  }
  const bool pretty = !indent.is_none() && !indent.is_undefined();
  Dumper d{pretty ? &indent_str : nullptr, pretty ? "," : ", ", ": ", options.sort_keys, options.ensure_ascii, {}};
  if (options.separators) {
    d.item_sep = options.separators->first;
    d.key_sep = options.separators->second;
  }
  d.dump(v, 0);
  return d.out;
}

}  // namespace scaletrain::tmpl

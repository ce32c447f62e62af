// The Python methods templates call on values (`content.strip()`,
// `message.get('x')`, `d.items()`) and the global functions of the
// environment transformers builds (range, dict, namespace, raise_exception,
// strftime_now).
#include <cctype>
#include <ctime>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/text.h"

namespace scaletrain::tmpl {
namespace {

std::optional<std::string> opt_string(const Value& v, const std::string& what) {
  if (v.is_none() || v.is_undefined()) return std::nullopt;
  if (!v.is_string()) throw EvalError(what + " must be None or a str, not " + type_name(v));
  return v.str();
}

const std::string& need_string(const Value& v, const std::string& what) {
  if (!v.is_string()) throw EvalError(what + " must be a str, not " + type_name(v));
  return v.str();
}

Value string_list(const std::vector<std::string>& parts) {
  ValueList out;
  for (const auto& p : parts) out.push_back(Value::string(p));
  return Value::list(std::move(out));
}

bool affix(const std::string& s, const Value& what, bool prefix, const std::string& method) {
  if (what.is(Value::Kind::Tuple)) {
    for (const auto& w : what.items())
      if (affix(s, w, prefix, method)) return true;
    return false;
  }
  const std::string& a = need_string(what, method + " argument");
  if (a.size() > s.size()) return false;
  return prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0;
}

// str.format with automatic or numbered or named fields and no format specs.
std::string str_format(const std::string& fmt, const CallArgs& args) {
  std::string out;
  std::size_t auto_index = 0;
  for (std::size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if ((c == '{' || c == '}') && i + 1 < fmt.size() && fmt[i + 1] == c) {
      out += c;
      ++i;
      continue;
    }
    if (c != '{') {
      if (c == '}') throw EvalError("Single '}' encountered in format string");
      out += c;
      continue;
    }
    const std::size_t close = fmt.find('}', i);
    if (close == std::string::npos) throw EvalError("Single '{' encountered in format string");
    const std::string field = fmt.substr(i + 1, close - i - 1);
    if (field.find_first_of(":!.[") != std::string::npos)
      throw EvalError("str.format field '{" + field + "}' is not supported (only {}, {0} and {name})");
    Value v;
    if (field.empty() || std::isdigit(static_cast<unsigned char>(field[0]))) {
      const std::size_t index = field.empty() ? auto_index++ : std::stoul(field);
      if (index >= args.positional.size())
        throw EvalError("Replacement index " + std::to_string(index) + " out of range");
      v = args.positional[index];
    } else {
      v = args.get(SIZE_MAX, field, Value::undefined("KeyError: '" + field + "'"));
      if (v.is_undefined()) fail_undefined(v);
    }
    out += to_str(v);
    i = close;
  }
  return out;
}

std::optional<Value> string_method(const std::string& s, const std::string& name) {
  using Fn = std::function<Value(CallArgs&)>;
  Fn fn;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    fn = [s, name](CallArgs& a) {
      a.check("str." + name, 1, {});
      return Value::string(text::strip(s, opt_string(a.get(0, ""), name + " arg"), name != "rstrip", name != "lstrip"));
    };
  } else if (name == "split" || name == "rsplit") {
    fn = [s, name](CallArgs& a) {
      a.check("str." + name, 2, {"sep", "maxsplit"});
      const auto sep = opt_string(a.get(0, "sep"), "separator");
      if (sep && sep->empty()) throw EvalError("empty separator");
      const Value maxsplit = a.get(1, "maxsplit", Value::integer(-1));
      return string_list(text::split(s, sep, static_cast<long>(maxsplit.as_int()), name == "rsplit"));
    };
  } else if (name == "splitlines") {
    fn = [s](CallArgs& a) { return string_list(text::splitlines(s, truthy(a.get(0, "keepends")))); };
  } else if (name == "startswith" || name == "endswith") {
    fn = [s, name](CallArgs& a) {
      a.check("str." + name, 1, {});
      return Value::boolean(affix(s, a.get(0, ""), name == "startswith", "str." + name));
    };
  } else if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    fn = [s, name](CallArgs& a) {
      a.check("str." + name, 0, {});
      return Value::string(name == "upper"   ? text::upper(s)
                           : name == "lower" ? text::lower(s)
                           : name == "title" ? text::title(s)
                                             : text::capitalize(s));
    };
  } else if (name == "replace") {
    fn = [s](CallArgs& a) {
      a.check("str.replace", 3, {"count"});
      const long count = static_cast<long>(a.get(2, "count", Value::integer(-1)).as_int());
      return Value::string(text::replace(s, need_string(a.get(0, ""), "replace() argument 1"),
                                         need_string(a.get(1, ""), "replace() argument 2"), count));
    };
  } else if (name == "find" || name == "rfind" || name == "count") {
    fn = [s, name](CallArgs& a) {
      a.check("str." + name, 1, {});
      const std::string& sub = need_string(a.get(0, ""), "str." + name + " argument");
      if (name == "count") return Value::integer(text::count(s, sub));
      const std::size_t at = name == "find" ? s.find(sub) : s.rfind(sub);
      if (at == std::string::npos) return Value::integer(-1);
      return Value::integer(static_cast<int64_t>(text::decode(s.substr(0, at)).size()));
    };
  } else if (name == "join") {
    fn = [s](CallArgs& a) {
      std::string out;
      const ValueList items = iterate(a.get(0, ""));
      for (std::size_t i = 0; i < items.size(); ++i)
        out += (i ? s : "") + need_string(items[i], "sequence item " + std::to_string(i));
      return Value::string(std::move(out));
    };
  } else if (name == "isdigit" || name == "isspace") {
    fn = [s, name](CallArgs&) {
      const std::u32string u = text::decode(s);
      bool all = !u.empty();
      for (char32_t c : u) all = all && (name == "isspace" ? text::is_space(c) : (c >= '0' && c <= '9'));
      return Value::boolean(all);
    };
  } else if (name == "format") {
    fn = [s](CallArgs& a) { return Value::string(str_format(s, a)); };
  } else {
    return std::nullopt;
  }
  return Value::function("str." + name, std::move(fn));
}

std::optional<Value> dict_method(const Value& d, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return Value::function("dict." + name, [d, name](CallArgs& a) {
      a.check("dict." + name, 0, {});
      ValueList out;
      for (const auto& [k, v] : d.dict().entries)
        out.push_back(name == "items" ? Value::tuple({k, v}) : (name == "keys" ? k : v));
      return Value::list(std::move(out));
    });
  }
  if (name == "get") {
    return Value::function("dict.get", [d](CallArgs& a) {
      a.check("dict.get", 2, {});
      const Value* v = d.dict().find(a.get(0, ""));
      return v != nullptr ? *v : a.get(1, "", Value::none());
    });
  }
  return std::nullopt;
}

}  // namespace

std::optional<Value> method(const Value& obj, const std::string& name) {
  if (obj.is_string()) return string_method(obj.str(), name);
  if (obj.is_mapping()) return dict_method(obj, name);
  return std::nullopt;
}

namespace {

Value range(CallArgs& a) {
  a.check("range", 3, {});
  for (const auto& v : a.positional)
    if (!v.is(Value::Kind::Int) && !v.is(Value::Kind::Bool))
      throw EvalError("'" + type_name(v) + "' object cannot be interpreted as an integer");
  int64_t start = 0, stop = 0, step = 1;
  if (a.positional.size() == 1) {
    stop = a.positional[0].as_int();
  } else if (a.positional.size() >= 2) {
    start = a.positional[0].as_int();
    stop = a.positional[1].as_int();
    if (a.positional.size() == 3) step = a.positional[2].as_int();
  } else {
    throw EvalError("range expected at least 1 argument, got 0");
  }
  if (step == 0) throw EvalError("range() arg 3 must not be zero");
  ValueList out;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (out.size() >= 100000) throw EvalError("range too big, maximum size for range is 100000");  // Jinja's sandbox
    out.push_back(Value::integer(i));
  }
  return Value::list(std::move(out));
}

// namespace(...) and dict(...): an optional mapping, then keyword arguments.
std::shared_ptr<DictData> mapping_of(CallArgs& a, const std::string& callee) {
  auto d = std::make_shared<DictData>();
  if (a.positional.size() > 1) throw EvalError(callee + " expected at most 1 positional argument");
  if (!a.positional.empty()) {
    const Value& init = a.positional[0];
    if (!init.is_mapping()) throw EvalError(callee + " expected a mapping, not " + type_name(init));
    d->entries = init.dict().entries;
  }
  for (const auto& [k, v] : a.keyword) d->set(Value::string(k), v);
  return d;
}

std::string strftime_at(const std::string& fmt, std::optional<int64_t> now) {
  const std::time_t t = now ? static_cast<std::time_t>(*now) : std::time(nullptr);
  std::tm tm{};
  if (now)
    gmtime_r(&t, &tm);
  else
    localtime_r(&t, &tm);
  std::string buf(fmt.size() * 4 + 64, '\0');
  const std::size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
  buf.resize(n);
  return buf;
}

}  // namespace

std::vector<std::pair<std::string, Value>> global_functions(std::optional<int64_t> now) {
  return {
      {"range", Value::function("range", range)},
      {"dict", Value::function("dict", [](CallArgs& a) { return Value::dict(mapping_of(a, "dict")); })},
      {"namespace",
       Value::function("namespace", [](CallArgs& a) { return Value::namespace_(mapping_of(a, "namespace")); })},
      {"raise_exception",
       Value::function("raise_exception", [](CallArgs& a) -> Value { throw RaiseError(to_str(a.get(0, "message"))); })},
      {"strftime_now", Value::function("strftime_now",
                                       [now](CallArgs& a) {
                                         a.check("strftime_now", 1, {});
                                         return Value::string(strftime_at(need_string(a.get(0, ""), "format"), now));
                                       })},
  };
}

}  // namespace scaletrain::tmpl

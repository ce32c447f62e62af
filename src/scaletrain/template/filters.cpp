// Jinja's filters and tests, as jinja2/filters.py and jinja2/tests.py define
// them, with transformers' tojson (json.dumps, ensure_ascii=False, keys in
// their order). A name missing from these tables is refused when the
// template is parsed.
#include <utf8proc.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/text.h"

namespace scaletrain::tmpl {
namespace {

bool is_int(const Value& v) { return v.is(Value::Kind::Int) || v.is(Value::Kind::Bool); }

int64_t int_arg(const Value& v, const std::string& what) {
  if (!is_int(v)) throw EvalError(what + " must be an integer, not " + type_name(v));
  return v.as_int();
}

// make_attrgetter: "a.b.0" looks up a, then b, then item 0.
Value lookup_path(Value item, const Value& attribute, const Value& fallback = Value::none()) {
  if (attribute.is_none() || attribute.is_undefined()) return item;
  std::vector<Value> parts;
  if (attribute.is_string()) {
    for (const auto& p : text::split(attribute.str(), std::string("."), -1, false)) {
      const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
      parts.push_back(digits ? Value::integer(std::stoll(p)) : Value::string(p));
    }
  } else {
    parts.push_back(attribute);
  }
  for (const auto& p : parts) {
    item = get_item(item, p);
    if (!fallback.is_none() && item.is_undefined()) item = fallback;
  }
  return item;
}

Value ignore_case(const Value& v) { return v.is_string() ? Value::string(text::lower(v.str())) : v; }

// The sort key of sort, unique, min, max, dictsort.
Value sort_key(const Value& item, const Value& attribute, bool case_sensitive) {
  const Value key = lookup_path(item, attribute);
  return case_sensitive ? key : ignore_case(key);
}

Value f_abs(const Value& v, CallArgs& a) {
  a.check("abs", 0, {});
  if (is_int(v)) return Value::integer(std::llabs(v.as_int()));
  if (v.is(Value::Kind::Float)) return Value::number(std::fabs(v.as_double()));
  throw EvalError("bad operand type for abs(): '" + type_name(v) + "'");
}

Value f_attr(const Value& v, CallArgs& a) {
  a.check("attr", 1, {"name"});
  const Value name = a.get(0, "name");
  if (!name.is_string()) throw EvalError("attribute name must be a string");
  if (v.is_mapping())
    return method(v, name.str()).value_or(Value::undefined("'dict object' has no attribute '" + name.str() + "'"));
  return get_attr(v, name.str());
}

Value f_batch(const Value& v, CallArgs& a) {
  a.check("batch", 2, {"linecount", "fill_with"});
  const int64_t n = int_arg(a.get(0, "linecount"), "batch linecount");
  if (n <= 0) throw EvalError("batch linecount must be positive");
  const Value fill = a.get(1, "fill_with", Value::none());
  ValueList out, row;
  for (const auto& item : iterate(v)) {
    row.push_back(item);
    if (static_cast<int64_t>(row.size()) == n) out.push_back(Value::list(std::exchange(row, {})));
  }
  if (!row.empty()) {
    if (!fill.is_none())
      while (static_cast<int64_t>(row.size()) < n) row.push_back(fill);
    out.push_back(Value::list(std::move(row)));
  }
  return Value::list(std::move(out));
}

Value f_capitalize(const Value& v, CallArgs& a) {
  a.check("capitalize", 0, {});
  return Value::string(text::capitalize(to_str(v)));
}

Value f_center(const Value& v, CallArgs& a) {
  a.check("center", 1, {"width"});
  return Value::string(
      text::center(to_str(v), static_cast<long>(int_arg(a.get(0, "width", Value::integer(80)), "width"))));
}

Value f_default(const Value& v, CallArgs& a) {
  a.check("default", 2, {"default_value", "boolean"});
  const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
  if (v.is_undefined() || (boolean && !truthy(v))) return a.get(0, "default_value", Value::string(""));
  return v;
}

Value f_dictsort(const Value& v, CallArgs& a) {
  a.check("dictsort", 3, {"case_sensitive", "by", "reverse"});
  if (!v.is_mapping()) throw EvalError("dictsort expects a mapping, not " + type_name(v));
  const bool case_sensitive = truthy(a.get(0, "case_sensitive"));
  const Value by = a.get(1, "by", Value::string("key"));
  if (!by.is_string() || (by.str() != "key" && by.str() != "value"))
    throw EvalError("You can only sort by either \"key\" or \"value\"");
  const std::size_t pos = by.str() == "key" ? 0 : 1;
  ValueList items;
  for (const auto& [k, val] : v.dict().entries) items.push_back(Value::tuple({k, val}));
  auto key = [&](const Value& t) { return case_sensitive ? t.items()[pos] : ignore_case(t.items()[pos]); };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Value& x, const Value& y) { return compare(key(x), key(y)) < 0; });
  if (truthy(a.get(2, "reverse"))) std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_escape(const Value& v, CallArgs& a) {
  a.check("escape", 0, {});
  return Value::string(text::html_escape(to_str(v)));
}

Value f_first(const Value& v, CallArgs& a) {
  a.check("first", 0, {});
  const ValueList items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(const Value& v, CallArgs& a) {
  a.check("last", 0, {});
  const ValueList items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

// Python's float(str): surrounding whitespace, underscores between digits, inf and nan.
std::optional<double> parse_float(const std::string& s) {
  std::string t;
  for (char c : text::strip(s, std::nullopt, true, true))
    if (c != '_') t += c;
  if (t.empty() || t.find_first_of("xXpP") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return d;
}

std::optional<int64_t> parse_int(const std::string& s, int base) {
  std::string t;
  for (char c : text::strip(s, std::nullopt, true, true))
    if (c != '_') t += c;
  if (t.empty() || t.find('.') != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(t.c_str(), &end, base);
  if (end != t.c_str() + t.size() || t == "+" || t == "-") return std::nullopt;
  return v;
}

Value f_float(const Value& v, CallArgs& a) {
  a.check("float", 1, {"default"});
  if (v.is_undefined()) fail_undefined(v);  // float(Undefined) raises, and not a ValueError
  if (v.is_number()) return Value::number(v.as_double());
  if (v.is_string())
    if (auto d = parse_float(v.str())) return Value::number(*d);
  return a.get(0, "default", Value::number(0.0));
}

Value f_int(const Value& v, CallArgs& a) {
  a.check("int", 2, {"default", "base"});
  if (v.is_undefined()) fail_undefined(v);
  if (is_int(v)) return Value::integer(v.as_int());
  if (v.is(Value::Kind::Float) && std::isfinite(v.as_double()))
    return Value::integer(static_cast<int64_t>(v.as_double()));
  if (v.is_string()) {
    if (auto i = parse_int(v.str(), static_cast<int>(int_arg(a.get(1, "base", Value::integer(10)), "base"))))
      return Value::integer(*i);
    if (auto d = parse_float(v.str()); d && std::isfinite(*d)) return Value::integer(static_cast<int64_t>(*d));
  }
  return a.get(0, "default", Value::integer(0));
}

}  // namespace

// Python's %-formatting for the conversions templates use: s r d i f e g x o c and %%.
std::string printf_format(const std::string& fmt, const ValueList& args, bool may_leave_unused) {
  std::string out;
  std::size_t next = 0;
  for (std::size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    std::size_t j = i + 1;
    while (j < fmt.size() && std::strchr("-+ #0123456789.", fmt[j]) != nullptr) ++j;
    if (j >= fmt.size()) throw EvalError("incomplete format");
    const char conv = fmt[j];
    const std::string spec = fmt.substr(i + 1, j - i - 1);
    i = j;
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (next >= args.size()) throw EvalError("not enough arguments for format string");
    const Value& arg = args[next++];
    char buf[512];
    if (conv == 's' || conv == 'r') {
      const std::string s = conv == 's' ? to_str(arg) : repr(arg);
      std::snprintf(buf, sizeof(buf), ("%" + spec + "s").c_str(), s.c_str());
      out += spec.empty() ? s : std::string(buf);
    } else if (std::strchr("dixoc", conv) != nullptr) {
      if (!arg.is_number())
        throw EvalError("%" + std::string(1, conv) + " format: a real number is required, not " + type_name(arg));
      std::snprintf(buf, sizeof(buf), ("%" + spec + "ll" + std::string(1, conv == 'i' ? 'd' : conv)).c_str(),
                    static_cast<long long>(arg.as_int()));
      out += buf;
    } else if (std::strchr("feEgG", conv) != nullptr) {
      if (!arg.is_number()) throw EvalError("must be real number, not " + type_name(arg));
      std::snprintf(buf, sizeof(buf), ("%" + spec + std::string(1, conv)).c_str(), arg.as_double());
      out += buf;
    } else {
      throw EvalError(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (next < args.size() && !may_leave_unused) throw EvalError("not all arguments converted during string formatting");
  return out;
}

namespace {

Value f_format(const Value& v, CallArgs& a) {
  if (!a.keyword.empty()) throw EvalError("format with keyword arguments is not supported");
  return Value::string(printf_format(to_str(v), a.positional));
}

Value f_indent(const Value& v, CallArgs& a) {
  a.check("indent", 3, {"width", "first", "blank"});
  const Value width = a.get(0, "width", Value::integer(4));
  const std::string ind =
      width.is_string() ? width.str()
                        : std::string(static_cast<std::size_t>(std::max<int64_t>(int_arg(width, "width"), 0)), ' ');
  if (!v.is_string())  // Jinja appends "\n" to the value
    throw EvalError("unsupported operand type(s) for +=: '" + type_name(v) + "' and 'str'");
  const std::vector<std::string> lines = text::splitlines(v.str() + "\n", false);
  std::string rv;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) rv += "\n";
    const bool indent_it = i > 0 && (truthy(a.get(2, "blank")) || !lines[i].empty());
    rv += (indent_it ? ind : "") + lines[i];
  }
  return Value::string(truthy(a.get(1, "first")) ? ind + rv : rv);
}

Value f_items(const Value& v, CallArgs& a) {
  a.check("items", 0, {});
  if (v.is_undefined()) return Value::list({});
  if (!v.is_mapping()) throw EvalError("Can only get item pairs from a mapping.");
  ValueList out;
  for (const auto& [k, val] : v.dict().entries) out.push_back(Value::tuple({k, val}));
  return Value::list(std::move(out));
}

Value f_join(const Value& v, CallArgs& a) {
  a.check("join", 2, {"d", "attribute"});
  const std::string sep = to_str(a.get(0, "d", Value::string("")));
  const Value attribute = a.get(1, "attribute", Value::none());
  std::string out;
  bool first = true;
  for (const auto& item : iterate(v)) {
    out += (first ? "" : sep) + to_str(lookup_path(item, attribute));
    first = false;
  }
  return Value::string(std::move(out));
}

Value f_length(const Value& v, CallArgs& a) {
  a.check("length", 0, {});
  return Value::integer(static_cast<int64_t>(length(v)));
}

Value f_list(const Value& v, CallArgs& a) {
  a.check("list", 0, {});
  return Value::list(iterate(v));
}

Value f_lower(const Value& v, CallArgs& a) {
  a.check("lower", 0, {});
  return Value::string(text::lower(to_str(v)));
}

Value f_upper(const Value& v, CallArgs& a) {
  a.check("upper", 0, {});
  return Value::string(text::upper(to_str(v)));
}

Value f_title(const Value& v, CallArgs& a) {
  a.check("title", 0, {});
  return Value::string(text::jinja_title(to_str(v)));
}

Value f_map(const Value& v, CallArgs& a) {
  ValueList out;
  if (!truthy(v)) return Value::list({});  // Jinja maps nothing for a falsy value, iterable or not
  if (a.positional.empty()) {
    a.check("map", 0, {"attribute", "default"});
    const Value attribute = a.get(SIZE_MAX, "attribute");
    if (attribute.is_undefined()) throw EvalError("map requires a filter argument");
    const Value fallback = a.get(SIZE_MAX, "default", Value::none());
    for (const auto& item : iterate(v)) out.push_back(lookup_path(item, attribute, fallback));
    return Value::list(std::move(out));
  }
  const Value name = a.positional[0];
  const FilterFn f = name.is_string() ? find_filter(name.str()) : nullptr;
  if (f == nullptr) throw EvalError("No filter named " + repr(name) + ".");
  for (const auto& item : iterate(v)) {
    CallArgs rest{ValueList(a.positional.begin() + 1, a.positional.end()), a.keyword};
    out.push_back(f(item, rest));
  }
  return Value::list(std::move(out));
}

Value min_or_max(const Value& v, CallArgs& a, bool max) {
  a.check(max ? "max" : "min", 2, {"case_sensitive", "attribute"});
  const ValueList items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const bool cs = truthy(a.get(0, "case_sensitive"));
  const Value attribute = a.get(1, "attribute", Value::none());
  std::size_t best = 0;
  for (std::size_t i = 1; i < items.size(); ++i) {
    const int c = compare(sort_key(items[i], attribute, cs), sort_key(items[best], attribute, cs));
    if (max ? c > 0 : c < 0) best = i;
  }
  return items[best];
}
Value f_max(const Value& v, CallArgs& a) { return min_or_max(v, a, true); }
Value f_min(const Value& v, CallArgs& a) { return min_or_max(v, a, false); }

// select/reject (attr = false) and selectattr/rejectattr (attr = true).
Value select_or_reject(const Value& v, CallArgs& a, bool attr, bool keep_if) {
  std::size_t off = 0;
  Value attribute = Value::none();
  if (attr) {
    if (a.positional.empty()) throw EvalError("Missing parameter for attribute name");
    attribute = a.positional[off++];
  }
  TestFn test = nullptr;
  if (a.positional.size() > off) {
    const Value& name = a.positional[off++];
    test = name.is_string() ? find_test(name.str()) : nullptr;
    if (test == nullptr) throw EvalError("No test named " + repr(name) + ".");
  }
  ValueList out;
  if (!truthy(v)) return Value::list({});  // as in Jinja: a falsy value selects nothing, iterable or not
  for (const auto& item : iterate(v)) {
    const Value x = lookup_path(item, attribute);
    CallArgs rest{ValueList(a.positional.begin() + static_cast<std::ptrdiff_t>(off), a.positional.end()), a.keyword};
    if ((test ? test(x, rest) : truthy(x)) == keep_if) out.push_back(item);
  }
  return Value::list(std::move(out));
}
Value f_select(const Value& v, CallArgs& a) { return select_or_reject(v, a, false, true); }
Value f_reject(const Value& v, CallArgs& a) { return select_or_reject(v, a, false, false); }
Value f_selectattr(const Value& v, CallArgs& a) { return select_or_reject(v, a, true, true); }
Value f_rejectattr(const Value& v, CallArgs& a) { return select_or_reject(v, a, true, false); }

Value f_replace(const Value& v, CallArgs& a) {
  a.check("replace", 3, {"old", "new", "count"});
  const Value count = a.get(2, "count", Value::none());
  return Value::string(text::replace(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                     count.is_none() ? -1 : static_cast<long>(int_arg(count, "count"))));
}

Value f_reverse(const Value& v, CallArgs& a) {
  a.check("reverse", 0, {});
  if (v.is_string()) {
    std::u32string u = text::decode(v.str());
    std::reverse(u.begin(), u.end());
    return Value::string(text::encode(u));
  }
  ValueList items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

// Python's round(x, n): the exact binary value rounded half to even, which
// glibc's printf does.
Value f_round(const Value& v, CallArgs& a) {
  a.check("round", 2, {"precision", "method"});
  const int64_t precision = int_arg(a.get(0, "precision", Value::integer(0)), "precision");
  const std::string method = to_str(a.get(1, "method", Value::string("common")));
  if (!v.is_number()) throw EvalError("type " + type_name(v) + " doesn't define __round__ method");
  if (method == "common") {
    if (is_int(v) && precision >= 0) return Value::integer(v.as_int());
    if (precision < 0 || precision > 300) {
      const double scale = std::pow(10.0, static_cast<double>(-precision));
      return Value::number(std::nearbyint(v.as_double() / scale) * scale);
    }
    char buf[400];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), v.as_double());
    return Value::number(std::strtod(buf, nullptr));
  }
  if (method != "ceil" && method != "floor") throw EvalError("method must be common, ceil or floor");
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * scale;
  return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
}

Value f_safe(const Value& v, CallArgs& a) {
  a.check("safe", 0, {});
  return v.is_string() ? v : Value::string(to_str(v));
}

Value f_sort(const Value& v, CallArgs& a) {
  a.check("sort", 3, {"reverse", "case_sensitive", "attribute"});
  ValueList items = iterate(v);
  const bool cs = truthy(a.get(1, "case_sensitive"));
  const Value attribute = a.get(2, "attribute", Value::none());
  std::vector<std::pair<Value, Value>> keyed;
  for (auto& item : items) keyed.emplace_back(sort_key(item, attribute, cs), item);
  const bool reverse = truthy(a.get(0, "reverse"));
  // Python's sorted(reverse=True) keeps equal items in their order.
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
    return reverse ? compare(y.first, x.first) < 0 : compare(x.first, y.first) < 0;
  });
  ValueList out;
  for (auto& k : keyed) out.push_back(std::move(k.second));
  return Value::list(std::move(out));
}

Value f_string(const Value& v, CallArgs& a) {
  a.check("string", 0, {});
  return Value::string(to_str(v));
}

Value f_sum(const Value& v, CallArgs& a) {
  a.check("sum", 2, {"attribute", "start"});
  const Value attribute = a.get(0, "attribute", Value::none());
  Value total = a.get(1, "start", Value::integer(0));
  for (const auto& item : iterate(v)) total = binary_op("+", total, lookup_path(item, attribute));
  return total;
}

Value f_tojson(const Value& v, CallArgs& a) {
  a.check("tojson", 1, {"indent", "ensure_ascii", "separators", "sort_keys"});
  DumpOptions options;
  options.indent = a.get(0, "indent", Value::none());
  options.ensure_ascii = truthy(a.get(SIZE_MAX, "ensure_ascii"));
  options.sort_keys = truthy(a.get(SIZE_MAX, "sort_keys"));
  const Value sep = a.get(SIZE_MAX, "separators", Value::none());
  if (!sep.is_none()) {
    if (!sep.is_sequence() || sep.items().size() != 2 || !sep.items()[0].is_string() || !sep.items()[1].is_string())
      throw EvalError("tojson separators must be a pair of strings");
    options.separators = std::make_pair(sep.items()[0].str(), sep.items()[1].str());
  }
  return Value::string(dumps(v, options));
}

Value f_trim(const Value& v, CallArgs& a) {
  a.check("trim", 1, {"chars"});
  const Value chars = a.get(0, "chars", Value::none());
  return Value::string(
      text::strip(to_str(v), chars.is_none() ? std::nullopt : std::optional<std::string>(to_str(chars)), true, true));
}

Value f_unique(const Value& v, CallArgs& a) {
  a.check("unique", 2, {"case_sensitive", "attribute"});
  const bool cs = truthy(a.get(0, "case_sensitive"));
  const Value attribute = a.get(1, "attribute", Value::none());
  ValueList out, seen;
  for (const auto& item : iterate(v)) {
    const Value key = sort_key(item, attribute, cs);
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::list(std::move(out));
}

struct FilterEntry {
  const char* name;
  FilterFn fn;
};

const FilterEntry kFilters[] = {
    {"abs", f_abs},
    {"attr", f_attr},
    {"batch", f_batch},
    {"capitalize", f_capitalize},
    {"center", f_center},
    {"count", f_length},
    {"d", f_default},
    {"default", f_default},
    {"dictsort", f_dictsort},
    {"e", f_escape},
    {"escape", f_escape},
    {"first", f_first},
    {"float", f_float},
    {"format", f_format},
    {"indent", f_indent},
    {"int", f_int},
    {"items", f_items},
    {"join", f_join},
    {"last", f_last},
    {"length", f_length},
    {"list", f_list},
    {"lower", f_lower},
    {"map", f_map},
    {"max", f_max},
    {"min", f_min},
    {"reject", f_reject},
    {"rejectattr", f_rejectattr},
    {"replace", f_replace},
    {"reverse", f_reverse},
    {"round", f_round},
    {"safe", f_safe},
    {"select", f_select},
    {"selectattr", f_selectattr},
    {"sort", f_sort},
    {"string", f_string},
    {"sum", f_sum},
    {"title", f_title},
    {"tojson", f_tojson},
    {"trim", f_trim},
    {"unique", f_unique},
    {"upper", f_upper},
};

}  // namespace

FilterFn find_filter(const std::string& name) {
  for (const auto& f : kFilters)
    if (name == f.name) return f.fn;
  return nullptr;
}

}  // namespace scaletrain::tmpl

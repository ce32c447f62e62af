#pragma once
// The values a chat template computes with, and what Python does with them.
//
// Jinja runs on Python objects; byte-for-byte equal output needs Python's
// behaviour for the few types templates see: None, bool, int, float, str,
// list, tuple, dict (insertion-ordered), plus Jinja's own Undefined (renders
// empty, is falsy, iterates as empty, fails on most other use), namespace()
// objects (the one mutable thing), and callables (macros, globals, bound
// methods such as str.strip). str() and repr() follow Python's formatting
// (float repr, quote choice), tojson follows json.dumps(ensure_ascii=False).
//
// Lists and dicts are shared, never mutated after they are built (the
// sandbox transformers uses forbids list.append and the like); namespaces
// are shared and mutable, as in Python.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain::tmpl {

// Key order is kept as given (Python dicts keep insertion order): tojson of a
// tool schema must print its keys in the file's order.
using Json = nlohmann::ordered_json;

// A failure while rendering (Python's TypeError, UndefinedError, ...). The
// evaluator adds the template line; Template::render turns it into a
// UsageError naming the source.
class EvalError : public std::runtime_error {
 public:
  explicit EvalError(const std::string& what) : std::runtime_error(what) {}
  int line = 0;  // 0 until the innermost node that knows its line catches it
};

class Value;
struct DictData;
struct Function;
struct CallArgs;
using ValueList = std::vector<Value>;

class Value {
 public:
  enum class Kind { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Namespace, Callable };

  Value() = default;  // Undefined
  static Value undefined(std::string hint = "");
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double f);
  static Value string(std::string s);
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value dict(std::shared_ptr<DictData> d);
  static Value namespace_(std::shared_ptr<DictData> d);
  static Value function(std::string name, std::function<Value(CallArgs&)> fn);

  Kind kind() const { return kind_; }
  bool is(Kind k) const { return kind_ == k; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_sequence() const { return kind_ == Kind::List || kind_ == Kind::Tuple; }
  bool is_mapping() const { return kind_ == Kind::Dict; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::Float ? static_cast<int64_t>(f_) : (kind_ == Kind::Bool ? b_ : i_); }
  double as_double() const { return kind_ == Kind::Float ? f_ : static_cast<double>(as_int()); }
  const std::string& str() const { return s_; }  // the string, or an Undefined's hint
  const ValueList& items() const;                // List or Tuple
  DictData& dict() const { return *dict_; }      // Dict or Namespace
  const Function& function() const { return *fn_; }

 private:
  Kind kind_ = Kind::Undefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<const ValueList> list_;
  std::shared_ptr<DictData> dict_;
  std::shared_ptr<const Function> fn_;
};

// An insertion-ordered dict (Python 3.7+ semantics); linear lookup, as the
// dicts of a conversation are small.
struct DictData {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(const std::string& key) const;
  void set(const Value& key, Value value);
};

// Arguments of a call: positional, then keyword, as Python passes them.
struct CallArgs {
  ValueList positional;
  std::vector<std::pair<std::string, Value>> keyword;
  // The positional argument `index`, else the keyword `name`, else `fallback`.
  Value get(std::size_t index, const std::string& name, Value fallback = Value()) const;
  // Refuses unknown keywords and more than `max_positional` positionals.
  void check(const std::string& callee, std::size_t max_positional, const std::vector<std::string>& names) const;
};

struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

// --- Python semantics -------------------------------------------------------
Value from_json(const Json& j);
std::string type_name(const Value& v);        // Python's type name: 'str', 'dict', 'NoneType', ...
std::string to_str(const Value& v);           // str(v); Undefined renders as ""
std::string repr(const Value& v);             // repr(v), as list and dict printing uses
std::string float_repr(double d);             // repr(float): shortest round-trip digits
bool truthy(const Value& v);                  // bool(v)
bool equals(const Value& a, const Value& b);  // a == b
// <0, 0, >0; EvalError naming `op` where Python raises TypeError.
int compare(const Value& a, const Value& b, const char* op = "<");
[[noreturn]] void fail_undefined(const Value& v);  // raises the Undefined's UndefinedError
ValueList iterate(const Value& v);                 // list(v): chars, keys, items; Undefined is empty
std::size_t length(const Value& v);                // len(v)

// json.dumps(v, ensure_ascii=..., indent=..., separators=..., sort_keys=...),
// transformers' tojson. Python's defaults: separators (", ", ": ") on one
// line, ("," and ": ") when indented.
struct DumpOptions {
  Value indent;  // None or Undefined: one line; an int (spaces) or a string per level
  std::optional<std::pair<std::string, std::string>> separators;  // (item, key)
  bool sort_keys = false;
  bool ensure_ascii = false;  // escape non-ASCII as \uXXXX
};
std::string dumps(const Value& v, const DumpOptions& options = {});

}  // namespace scaletrain::tmpl

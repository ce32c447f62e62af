// Renders a parsed template: statements (if, for with loop variables and
// loop controls, set into scopes and namespaces, macros, with, filter
// blocks) and expressions, with Jinja's scoping; and Template itself.
//
// Note [Scopes]: as in Jinja, a for loop's body runs in a fresh scope per
// iteration, so `{% set %}` inside a loop is gone at the next iteration and
// after the loop (templates carry state out through namespace() objects);
// `if` opens no scope; a macro's body runs in a scope whose parent is the
// scope it was defined in; the context's variables sit in the top scope,
// over the globals (range, namespace, raise_exception, ...).
#include <unordered_map>

#include "scaletrain/template/builtins.h"
#include "scaletrain/template/jinja.h"
#include "scaletrain/template/parser.h"

namespace scaletrain::tmpl {
namespace {

struct Scope : std::enable_shared_from_this<Scope> {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;

  explicit Scope(std::shared_ptr<Scope> p = nullptr) : parent(std::move(p)) {}
  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get())
      if (auto it = s->vars.find(name); it != s->vars.end()) return &it->second;
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

constexpr int kMaxMacroDepth = 200;  // a recursive macro fails instead of overflowing the stack

class Evaluator {
 public:
  explicit Evaluator(const RenderOptions& options) : options_(options) {}
  std::string run(const Body& body, const Json& context);

 private:
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, const ScopePtr& scope, std::string& out);
  Flow exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out);
  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out);
  void define_macro(const Stmt& s, const ScopePtr& scope);
  Value call_macro(const Stmt& m, Scope& defined_in, CallArgs& args);
  std::string render_block(const Body& body, const ScopePtr& scope);
  Value apply_filters(const std::vector<ExprPtr>& filters, Value v, const ScopePtr& scope);

  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_node(const Expr& e, const ScopePtr& scope);
  CallArgs eval_args(const Expr& e, const ScopePtr& scope);
  Value eval_compare(const Expr& e, const ScopePtr& scope);
  Value eval_call(const Expr& e, const ScopePtr& scope);

  RenderOptions options_;
  std::vector<ScopePtr> macro_scopes_;  // kept alive for the render: macros point at them
  int macro_depth_ = 0;
};

void assign(Scope& scope, const std::vector<std::string>& targets, bool unpack, const Value& v) {
  if (!unpack) {
    scope.vars[targets[0]] = v;
    return;
  }
  const ValueList items = iterate(v);
  if (items.size() != targets.size())
    throw EvalError(items.size() > targets.size()
                        ? "too many values to unpack (expected " + std::to_string(targets.size()) + ")"
                        : "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                              std::to_string(items.size()) + ")");
  for (std::size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = items[i];
}

std::string Evaluator::run(const Body& body, const Json& context) {
  if (!context.is_object() && !context.is_null()) throw EvalError("the context must be a JSON object");
  auto globals = std::make_shared<Scope>();
  for (auto& [name, fn] : global_functions(options_.now)) globals->vars[name] = fn;
  auto top = std::make_shared<Scope>(globals);
  if (context.is_object())
    for (const auto& [k, v] : context.items()) top->vars[k] = from_json(v);
  std::string out;
  exec(body, top, out);
  return out;
}

Evaluator::Flow Evaluator::exec(const Body& body, const ScopePtr& scope, std::string& out) {
  for (const auto& s : body) {
    const Flow f = exec_stmt(*s, scope, out);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

std::string Evaluator::render_block(const Body& body, const ScopePtr& scope) {
  std::string out;
  exec(body, scope, out);
  return out;
}

Value Evaluator::apply_filters(const std::vector<ExprPtr>& filters, Value v, const ScopePtr& scope) {
  for (const auto& f : filters) {
    CallArgs args = eval_args(*f, scope);
    v = f->filter(v, args);
  }
  return v;
}

Evaluator::Flow Evaluator::exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out) try {
  switch (s.kind) {
    case Stmt::Kind::Text:
      out += s.text;
      break;
    case Stmt::Kind::Output:
      out += to_str(eval(*s.expr, scope));
      break;
    case Stmt::Kind::If:
      for (const auto& [cond, body] : s.branches)
        if (truthy(eval(*cond, scope))) return exec(body, scope, out);
      return exec(s.else_body, scope, out);
    case Stmt::Kind::For:
      return exec_for(s, scope, out);
    case Stmt::Kind::Set:
      assign(*scope, s.targets, s.unpack, eval(*s.expr, scope));
      break;
    case Stmt::Kind::SetAttr: {
      const Value* ns = scope->find(s.text);
      if (ns == nullptr || !ns->is(Value::Kind::Namespace))
        throw EvalError("cannot assign attribute on non-namespace object");
      ns->dict().set(Value::string(s.attr), eval(*s.expr, scope));
      break;
    }
    case Stmt::Kind::SetBlock:
      assign(*scope, s.targets, s.unpack, apply_filters(s.exprs, Value::string(render_block(s.body, scope)), scope));
      break;
    case Stmt::Kind::FilterBlock:
      out += to_str(apply_filters(s.exprs, Value::string(render_block(s.body, scope)), scope));
      break;
    case Stmt::Kind::Macro:
      define_macro(s, scope);
      break;
    case Stmt::Kind::Break:
      return Flow::Break;
    case Stmt::Kind::Continue:
      return Flow::Continue;
    case Stmt::Kind::With: {
      auto inner = std::make_shared<Scope>(scope);
      for (std::size_t i = 0; i < s.targets.size(); ++i) inner->vars[s.targets[i]] = eval(*s.exprs[i], scope);
      return exec(s.body, inner, out);
    }
    case Stmt::Kind::Block:
      return exec(s.body, scope, out);
  }
  return Flow::Normal;
} catch (EvalError& e) {
  if (e.line == 0) e.line = s.line;
  throw;
}

// The `loop` variable of iteration i of n (Jinja's LoopContext, as a dict).
Value loop_object(std::size_t i, const ValueList& items) {
  const auto n = static_cast<int64_t>(items.size()), k = static_cast<int64_t>(i);
  auto d = std::make_shared<DictData>();
  auto put = [&](const char* key, Value v) { d->entries.emplace_back(Value::string(key), std::move(v)); };
  put("index", Value::integer(k + 1));
  put("index0", Value::integer(k));
  put("revindex", Value::integer(n - k));
  put("revindex0", Value::integer(n - k - 1));
  put("first", Value::boolean(k == 0));
  put("last", Value::boolean(k == n - 1));
  put("length", Value::integer(n));
  put("depth", Value::integer(1));
  put("depth0", Value::integer(0));
  if (k > 0) put("previtem", items[i - 1]);
  if (k < n - 1) put("nextitem", items[i + 1]);
  put("cycle", Value::function("loop.cycle", [k](CallArgs& a) {
        if (a.positional.empty()) throw EvalError("no items for cycling given");
        return a.positional[static_cast<std::size_t>(k) % a.positional.size()];
      }));
  return Value::dict(std::move(d));
}

Evaluator::Flow Evaluator::exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
  const Value iterable = eval(*s.expr, scope);
  ValueList items = iterate(iterable);
  if (s.cond) {  // `for x in xs if cond`: filtered first, so loop.length counts what is kept
    ValueList kept;
    for (auto& item : items) {
      auto probe = std::make_shared<Scope>(scope);
      assign(*probe, s.targets, s.unpack, item);
      if (truthy(eval(*s.cond, probe))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) return exec(s.else_body, scope, out);
  for (std::size_t i = 0; i < items.size(); ++i) {
    auto iteration = std::make_shared<Scope>(scope);
    assign(*iteration, s.targets, s.unpack, items[i]);
    iteration->vars["loop"] = loop_object(i, items);
    if (exec(s.body, iteration, out) == Flow::Break) break;
  }
  return Flow::Normal;
}

void Evaluator::define_macro(const Stmt& s, const ScopePtr& scope) {
  macro_scopes_.push_back(scope);
  Scope* defined_in = scope.get();
  scope->vars[s.text] =
      Value::function(s.text, [this, &s, defined_in](CallArgs& a) { return call_macro(s, *defined_in, a); });
}

Value Evaluator::call_macro(const Stmt& m, Scope& defined_in, CallArgs& args) {
  if (args.positional.size() > m.targets.size())
    throw EvalError("macro '" + m.text + "' takes not more than " + std::to_string(m.targets.size()) + " argument(s)");
  for (const auto& [k, v] : args.keyword)
    if (std::find(m.targets.begin(), m.targets.end(), k) == m.targets.end())
      throw EvalError("macro '" + m.text + "' takes no keyword argument '" + k + "'");
  if (macro_depth_ >= kMaxMacroDepth) throw EvalError("maximum macro recursion depth exceeded");
  auto scope = std::make_shared<Scope>(defined_in.shared_from_this());
  for (std::size_t i = 0; i < m.targets.size(); ++i) {
    Value v = args.get(i, m.targets[i], Value::undefined("parameter '" + m.targets[i] + "' was not provided"));
    if (v.is_undefined() && i >= args.positional.size() && m.exprs[i]) v = eval(*m.exprs[i], scope);
    scope->vars[m.targets[i]] = std::move(v);
  }
  ++macro_depth_;
  std::string out;
  try {
    exec(m.body, scope, out);
  } catch (...) {
    --macro_depth_;
    throw;
  }
  --macro_depth_;
  return Value::string(std::move(out));
}

// --- expressions ---------------------------------------------------------------------
Value Evaluator::eval(const Expr& e, const ScopePtr& scope) try { return eval_node(e, scope); } catch (EvalError& err) {
  if (err.line == 0) err.line = e.line;
  throw;
}

CallArgs Evaluator::eval_args(const Expr& e, const ScopePtr& scope) {
  CallArgs a;
  for (std::size_t i = 1; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i], scope));
  for (const auto& [k, v] : e.kwargs) a.keyword.emplace_back(k, eval(*v, scope));
  return a;
}

Value Evaluator::eval_compare(const Expr& e, const ScopePtr& scope) {
  Value left = eval(*e.args[0], scope);
  for (std::size_t i = 0; i < e.ops.size(); ++i) {
    Value right = eval(*e.args[i + 1], scope);
    const std::string& op = e.ops[i];
    bool ok;
    if (op == "==")
      ok = equals(left, right);
    else if (op == "!=")
      ok = !equals(left, right);
    else if (op == "in")
      ok = contains(right, left);
    else if (op == "not in")
      ok = !contains(right, left);
    else {
      const int c = compare(left, right, op.c_str());
      ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
    }
    if (!ok) return Value::boolean(false);
    left = std::move(right);
  }
  return Value::boolean(true);
}

Value Evaluator::eval_call(const Expr& e, const ScopePtr& scope) {
  const Value callee = eval(*e.args[0], scope);
  if (callee.is_undefined()) fail_undefined(callee);
  if (!callee.is(Value::Kind::Callable)) throw EvalError("'" + type_name(callee) + "' object is not callable");
  CallArgs args = eval_args(e, scope);
  return callee.function().call(args);
}

Value Evaluator::eval_node(const Expr& e, const ScopePtr& scope) {
  using K = Expr::Kind;
  switch (e.kind) {
    case K::Literal:
      return e.literal;
    case K::Name: {
      const Value* v = scope->find(e.name);
      return v != nullptr ? *v : Value::undefined("'" + e.name + "' is undefined");
    }
    case K::List:
    case K::Tuple: {
      ValueList items;
      for (const auto& a : e.args) items.push_back(eval(*a, scope));
      return e.kind == K::List ? Value::list(std::move(items)) : Value::tuple(std::move(items));
    }
    case K::Dict: {
      auto d = std::make_shared<DictData>();
      for (std::size_t i = 0; i + 1 < e.args.size(); i += 2)
        d->set(eval(*e.args[i], scope), eval(*e.args[i + 1], scope));
      return Value::dict(std::move(d));
    }
    case K::Attr:
      return get_attr(eval(*e.args[0], scope), e.name);
    case K::Item:
      return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope));
    case K::Slice: {
      auto bound = [&](const ExprPtr& b) { return b ? eval(*b, scope) : Value::none(); };
      return slice(eval(*e.args[0], scope), bound(e.args[1]), bound(e.args[2]), bound(e.args[3]));
    }
    case K::Call:
      return eval_call(e, scope);
    case K::Filter: {
      const Value input = eval(*e.args[0], scope);
      CallArgs args = eval_args(e, scope);
      return e.filter(input, args);
    }
    case K::Test: {
      const Value input = eval(*e.args[0], scope);
      CallArgs args = eval_args(e, scope);
      return Value::boolean(e.test(input, args) != e.negated);
    }
    case K::Neg:
      return negate(eval(*e.args[0], scope));
    case K::Pos: {
      Value v = eval(*e.args[0], scope);
      if (!v.is_number()) throw EvalError("bad operand type for unary +: '" + type_name(v) + "'");
      return v;
    }
    case K::Not:
      return Value::boolean(!truthy(eval(*e.args[0], scope)));
    case K::Binary:
      return binary_op(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope));
    case K::Concat: {
      std::string s;
      for (const auto& a : e.args) s += to_str(eval(*a, scope));
      return Value::string(std::move(s));
    }
    case K::Compare:
      return eval_compare(e, scope);
    case K::And: {
      Value a = eval(*e.args[0], scope);
      return truthy(a) ? eval(*e.args[1], scope) : a;
    }
    case K::Or: {
      Value a = eval(*e.args[0], scope);
      return truthy(a) ? a : eval(*e.args[1], scope);
    }
    case K::Cond:
      if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
      if (e.args[2]) return eval(*e.args[2], scope);
      return Value::undefined("the inline if-expression evaluated to false and has no else section");
  }
  return Value();
}

}  // namespace

Template::Template(const std::string& source_text, const std::string& source_name, const TemplateOptions& options)
    : source_name_(source_name), source_text_(source_text) {
  LexOptions lex;
  lex.trim_blocks = options.trim_blocks;
  lex.lstrip_blocks = options.lstrip_blocks;
  body_ = std::make_shared<const Body>(parse(tokenize(source_text, lex, source_name_), source_name_));
}

std::string Template::render(const Json& context, const RenderOptions& options) const {
  try {
    return Evaluator(options).run(*body_, context);
  } catch (const RaiseError& e) {
    throw RaisedError(source_name_, e.what(), e.line);
  } catch (const EvalError& e) {  // line 0: before any statement ran (a context that is not an object)
    throw UsageError(source_name_ + (e.line > 0 ? " line " + std::to_string(e.line) : std::string()) + ": " + e.what());
  }
}

}  // namespace scaletrain::tmpl

#include "scaletrain/checkpoint/torch_pickle.h"

#include <cstring>
#include <limits>
#include <unordered_map>

namespace scaletrain::checkpoint {

namespace {

constexpr int kMaxDepth = 512;
constexpr std::size_t kMaxObjects = 4'000'000;

struct StorageClass {
  const char* name;
  Dtype dtype;
};
constexpr StorageClass kStorages[] = {
    {"FloatStorage", Dtype::F32}, {"DoubleStorage", Dtype::F64}, {"HalfStorage", Dtype::F16},
    {"BFloat16Storage", Dtype::BF16}, {"LongStorage", Dtype::I64}, {"IntStorage", Dtype::I32},
    {"ShortStorage", Dtype::I16}, {"CharStorage", Dtype::I8}, {"ByteStorage", Dtype::U8},
    {"BoolStorage", Dtype::BOOL}};

const char* const kCallables[] = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                                  "torch._utils._rebuild_parameter",
                                  "torch._utils._rebuild_parameter_with_state", "torch.Size"};

bool storage_dtype(const std::string& global, Dtype* out) {
  for (const StorageClass& s : kStorages)
    if (global == std::string("torch.") + s.name) {
      *out = s.dtype;
      return true;
    }
  return false;
}

bool allowed_global(const std::string& name) {
  Dtype d;
  if (storage_dtype(name, &d)) return true;
  for (const char* c : kCallables)
    if (name == c) return true;
  return false;
}

PyRef make(PyKind k) {
  auto p = std::make_shared<PyObject>();
  p->kind = k;
  return p;
}

// A dict key's identity for duplicate detection (Python keeps the first
// position and the last value).
bool key_of(const PyObject& k, std::string* out) {
  if (k.kind == PyKind::Str) *out = "s" + k.text;
  else if (k.kind == PyKind::Int) *out = "i" + std::to_string(k.integer);
  else if (k.kind == PyKind::Bool) *out = "i" + std::to_string(k.boolean ? 1 : 0);
  else return false;
  return true;
}

class Unpickler {
 public:
  Unpickler(const unsigned char* data, std::size_t size, const std::string& source)
      : p_(data), size_(size), source_(source) {}
  PyRef run();

 private:
  [[noreturn]] void fail(const std::string& what) const {
    torch_file_fail(source_, "pickle: " + what + " at byte " + std::to_string(op_at_));
  }
  const unsigned char* take(uint64_t n) {
    if (n > size_ - pos_) fail("a length runs past the end of the pickle");
    const unsigned char* at = p_ + pos_;
    pos_ += static_cast<std::size_t>(n);
    return at;
  }
  uint64_t uint(int n) {
    const unsigned char* b = take(n);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | b[i];
    return v;
  }
  PyRef fresh(PyKind k) {
    if (++objects_ > kMaxObjects) fail("more than 4,000,000 objects (not a state dict)");
    return make(k);
  }
  void push(PyRef v) { stack_.push_back(std::move(v)); }
  PyRef pop() {
    if (stack_.size() <= floor()) fail("the stack is empty");
    PyRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PyRef& top() {
    if (stack_.size() <= floor()) fail("the stack is empty");
    return stack_.back();
  }
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<PyRef> pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    std::vector<PyRef> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  void place(PyObject& into, const PyRef& v);
  void append(const PyRef& list, PyRef v);
  void set_item(const PyRef& dict, PyRef k, PyRef v);
  PyRef tuple(std::vector<PyRef> items);
  void memo_put(uint64_t i) { memo_[i] = top(); }
  PyRef memo_get(uint64_t i) {
    const auto it = memo_.find(i);
    if (it == memo_.end()) fail("memo entry " + std::to_string(i) + " was never stored");
    return it->second;
  }
  void global(const std::string& module, const std::string& name);
  void persistent_id();
  void reduce();
  void build();
  PyRef rebuild_tensor(const std::vector<PyRef>& args, bool parameter);
  bool step(unsigned char op);

  const unsigned char* p_;
  std::size_t size_, pos_ = 0, op_at_ = 0, objects_ = 0;
  const std::string& source_;
  std::vector<PyRef> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
  std::unordered_map<const PyObject*, std::map<std::string, std::size_t>> keys_;
  PyRef none_ = make(PyKind::None);
};

void Unpickler::place(PyObject& into, const PyRef& v) {
  if (v.get() == &into) fail("a container placed inside itself");
  if (v->kind == PyKind::Tuple || v->kind == PyKind::List || v->kind == PyKind::Dict) {
    v->placed = true;
    into.depth = std::max(into.depth, v->depth + 1);
    if (into.depth > kMaxDepth) fail("containers nested deeper than 512");
  }
}

void Unpickler::append(const PyRef& list, PyRef v) {
  if (list->kind != PyKind::List) fail(std::string("APPEND to a ") + kind_name(list->kind));
  if (list->placed) fail("a list changed after it was placed in another container");
  place(*list, v);
  list->items.push_back(std::move(v));
}

void Unpickler::set_item(const PyRef& dict, PyRef k, PyRef v) {
  if (dict->kind != PyKind::Dict) fail(std::string("SETITEM on a ") + kind_name(dict->kind));
  if (dict->placed) fail("a dict changed after it was placed in another container");
  std::string key;
  if (!key_of(*k, &key)) fail(std::string("a dict key of type ") + kind_name(k->kind) + " (str and int only)");
  place(*dict, v);
  auto& index = keys_[dict.get()];
  const auto [it, fresh_key] = index.emplace(key, dict->entries.size());
  if (fresh_key) dict->entries.emplace_back(std::move(k), std::move(v));
  else dict->entries[it->second].second = std::move(v);
}

PyRef Unpickler::tuple(std::vector<PyRef> items) {
  PyRef t = fresh(PyKind::Tuple);
  for (const PyRef& v : items) place(*t, v);
  t->items = std::move(items);
  return t;
}

void Unpickler::global(const std::string& module, const std::string& name) {
  const std::string full = module + "." + name;
  if (!allowed_global(full))
    fail("global '" + full + "' is not allowed (a state dict needs only OrderedDict, tensors and storages)");
  PyRef g = fresh(PyKind::Global);
  g->text = full;
  push(g);
}

void Unpickler::persistent_id() {
  const PyRef id = pop();
  const auto& t = id->items;
  Dtype dtype{};
  if (id->kind != PyKind::Tuple || t.size() != 5 || !t[0]->is_str("storage") || t[1]->kind != PyKind::Global ||
      !storage_dtype(t[1]->text, &dtype) || t[2]->kind != PyKind::Str || t[3]->kind != PyKind::Str ||
      t[4]->kind != PyKind::Int || t[4]->integer < 0)
    fail("a persistent id that is not ('storage', StorageClass, key, location, numel)");
  PyRef s = fresh(PyKind::Storage);
  s->tensor = std::make_shared<TensorRecord>();
  s->tensor->storage = t[2]->text;
  s->tensor->dtype = dtype;
  s->tensor->storage_numel = t[4]->integer;
  push(s);
}

bool empty_or_none(const PyObject& v) {
  return v.kind == PyKind::None || (v.kind == PyKind::Dict && v.entries.empty());
}

bool int_tuple(const PyObject& v, std::vector<int64_t>* out) {
  if (v.kind != PyKind::Tuple) return false;
  for (const PyRef& i : v.items) {
    if (i->kind != PyKind::Int || i->integer < 0) return false;
    out->push_back(i->integer);
  }
  return true;
}

PyRef Unpickler::rebuild_tensor(const std::vector<PyRef>& a, bool parameter) {
  if (parameter) {  // (tensor, requires_grad, backward_hooks[, state])
    if (a.size() < 3 || a.size() > 4 || a[0]->kind != PyKind::Tensor || a[1]->kind != PyKind::Bool ||
        !empty_or_none(*a[2]) || (a.size() == 4 && !empty_or_none(*a[3])))
      fail("_rebuild_parameter with arguments other than (tensor, bool, no hooks)");
    PyRef t = fresh(PyKind::Tensor);
    t->tensor = std::make_shared<TensorRecord>(*a[0]->tensor);
    t->tensor->requires_grad = a[1]->boolean;
    t->tensor->parameter = true;
    return t;
  }
  // (storage, offset, size, stride, requires_grad, backward_hooks[, metadata])
  if (a.size() < 6 || a.size() > 7 || a[0]->kind != PyKind::Storage || a[1]->kind != PyKind::Int ||
      a[1]->integer < 0 || a[4]->kind != PyKind::Bool || !empty_or_none(*a[5]) ||
      (a.size() == 7 && !empty_or_none(*a[6])))
    fail("_rebuild_tensor_v2 with arguments other than (storage, offset, size, stride, bool, no hooks)");
  auto rec = std::make_shared<TensorRecord>(*a[0]->tensor);
  rec->offset = a[1]->integer;
  if (!int_tuple(*a[2], &rec->size) || !int_tuple(*a[3], &rec->stride) || rec->size.size() != rec->stride.size())
    fail("a tensor whose size and stride are not tuples of equal length of non-negative ints");
  rec->requires_grad = a[4]->boolean;
  PyRef t = fresh(PyKind::Tensor);
  t->tensor = std::move(rec);
  return t;
}

void Unpickler::reduce() {
  const PyRef args = pop();
  const PyRef fn = pop();
  if (fn->kind != PyKind::Global || args->kind != PyKind::Tuple) fail("REDUCE of something not callable");
  const auto& a = args->items;
  if (fn->text == "collections.OrderedDict") {
    if (!a.empty()) fail("OrderedDict called with arguments");
    PyRef d = fresh(PyKind::Dict);
    d->ordered = true;
    push(d);
  } else if (fn->text == "torch.Size") {
    std::vector<int64_t> dims;
    if (a.size() != 1 || !int_tuple(*a[0], &dims)) fail("torch.Size of something other than a tuple of ints");
    push(tuple(a[0]->items));
  } else if (fn->text == "torch._utils._rebuild_tensor_v2") {
    push(rebuild_tensor(a, false));
  } else if (fn->text == "torch._utils._rebuild_parameter" ||
             fn->text == "torch._utils._rebuild_parameter_with_state") {
    push(rebuild_tensor(a, true));
  } else {
    fail("'" + fn->text + "' called (it is only allowed as a storage type)");
  }
}

void Unpickler::build() {
  const PyRef state = pop();
  const PyRef& obj = top();
  if (obj->kind == PyKind::Dict && obj->ordered && state->kind == PyKind::Dict) {
    for (const auto& kv : state->entries)
      if (kv.first->kind != PyKind::Str) fail("BUILD with a non-str attribute name");
    return;  // attributes of a state dict (`_metadata`: module versions)
  }
  fail(std::string("BUILD on a ") + kind_name(obj->kind) + " (only an OrderedDict's attributes are allowed)");
}


PyRef Unpickler::run() {
  while (pos_ < size_) {
    op_at_ = pos_;
    if (!step(*take(1))) {
      if (stack_.size() != 1 || !marks_.empty()) fail("STOP with " + std::to_string(stack_.size()) + " values left");
      return stack_.back();
    }
  }
  fail("the pickle ends without STOP");
}

// One opcode; false at STOP. Names from Python's pickletools.
bool Unpickler::step(unsigned char op) {
  auto str = [&](PyKind kind, uint64_t n) {
    const unsigned char* b = take(n);
    PyRef v = fresh(kind);
    v->text.assign(reinterpret_cast<const char*>(b), n);
    push(v);
  };
  switch (op) {
    case 0x80: if (uint(1) > 5) fail("pickle protocol above 5"); break;           // PROTO
    case 0x95: uint(8); break;                                                     // FRAME
    case '.': return false;                                                        // STOP
    case '(': marks_.push_back(stack_.size()); break;                              // MARK
    case '0': pop(); break;                                                        // POP
    case '1': pop_mark(); break;                                                   // POP_MARK
    case '2': push(top()); break;                                                  // DUP
    case 'N': push(none_); break;                                                  // NONE
    case 0x88: case 0x89: { PyRef b = fresh(PyKind::Bool); b->boolean = op == 0x88; push(b); break; }
    case 'J': case 'K': case 'M': {                                                // BININT, BININT1, BININT2
      PyRef i = fresh(PyKind::Int);
      i->integer = op == 'J' ? static_cast<int32_t>(uint(4)) : static_cast<int64_t>(uint(op == 'K' ? 1 : 2));
      push(i);
      break;
    }
    case 0x8a: case 0x8b: {                                                        // LONG1, LONG4
      const uint64_t n = op == 0x8a ? uint(1) : uint(4);
      if (n > 8) fail("an integer wider than 64 bits");
      const unsigned char* b = take(n);
      uint64_t v = 0;
      for (uint64_t k = n; k-- > 0;) v = (v << 8) | b[k];
      if (n > 0 && n < 8 && (b[n - 1] & 0x80)) v |= ~uint64_t{0} << (8 * n);   // sign-extend
      PyRef i = fresh(PyKind::Int);
      i->integer = static_cast<int64_t>(v);
      push(i);
      break;
    }
    case 'G': {                                                                    // BINFLOAT (big-endian)
      const unsigned char* b = take(8);
      uint64_t bits = 0;
      for (int k = 0; k < 8; ++k) bits = (bits << 8) | b[k];
      PyRef f = fresh(PyKind::Float);
      std::memcpy(&f->real, &bits, 8);
      push(f);
      break;
    }
    case 0x8c: str(PyKind::Str, uint(1)); break;                                   // SHORT_BINUNICODE
    case 'X': str(PyKind::Str, uint(4)); break;                                    // BINUNICODE
    case 0x8d: str(PyKind::Str, uint(8)); break;                                   // BINUNICODE8
    case 'U': case 'C': str(PyKind::Bytes, uint(1)); break;                        // SHORT_BINSTRING, SHORT_BINBYTES
    case 'T': case 'B': str(PyKind::Bytes, uint(4)); break;                        // BINSTRING, BINBYTES
    case 0x8e: str(PyKind::Bytes, uint(8)); break;                                 // BINBYTES8
    case ')': push(tuple({})); break;                                              // EMPTY_TUPLE
    case 't': push(tuple(pop_mark())); break;                                      // TUPLE
    case 0x85: case 0x86: case 0x87: {                                             // TUPLE1..3
      std::vector<PyRef> items(static_cast<std::size_t>(op - 0x84));
      for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
      push(tuple(std::move(items)));
      break;
    }
    case ']': push(fresh(PyKind::List)); break;                                    // EMPTY_LIST
    case 'l': {                                                                    // LIST
      auto items = pop_mark();
      PyRef l = fresh(PyKind::List);
      for (PyRef& v : items) append(l, std::move(v));
      push(l);
      break;
    }
    case 'a': { PyRef v = pop(); append(top(), std::move(v)); break; }             // APPEND
    case 'e': {                                                                    // APPENDS
      auto items = pop_mark();
      const PyRef l = top();
      for (PyRef& v : items) append(l, std::move(v));
      break;
    }
    case '}': push(fresh(PyKind::Dict)); break;                                    // EMPTY_DICT
    case 'd': case 'u': {                                                          // DICT, SETITEMS
      auto items = pop_mark();
      if (items.size() % 2) fail("an odd number of values for a dict");
      const PyRef d = op == 'd' ? fresh(PyKind::Dict) : top();
      for (std::size_t k = 0; k < items.size(); k += 2) set_item(d, items[k], items[k + 1]);
      if (op == 'd') push(d);
      break;
    }
    case 's': { PyRef v = pop(); PyRef k = pop(); set_item(top(), k, v); break; }  // SETITEM
    case 'q': memo_put(uint(1)); break;                                            // BINPUT
    case 'r': memo_put(uint(4)); break;                                            // LONG_BINPUT
    case 0x94: memo_put(memo_.size()); break;                                      // MEMOIZE
    case 'h': push(memo_get(uint(1))); break;                                      // BINGET
    case 'j': push(memo_get(uint(4))); break;                                      // LONG_BINGET
    case 'c': {                                                                    // GLOBAL "module\nname\n"
      std::string parts[2];
      for (std::string& part : parts) {
        const void* nl = std::memchr(p_ + pos_, '\n', std::min<std::size_t>(size_ - pos_, 256));
        if (!nl) fail("GLOBAL without a newline-terminated name");
        const auto n = static_cast<std::size_t>(static_cast<const unsigned char*>(nl) - (p_ + pos_));
        part.assign(reinterpret_cast<const char*>(take(n + 1)), n);
      }
      global(parts[0], parts[1]);
      break;
    }
    case 0x93: {                                                                   // STACK_GLOBAL
      const PyRef name = pop(), module = pop();
      if (module->kind != PyKind::Str || name->kind != PyKind::Str) fail("STACK_GLOBAL of non-strings");
      global(module->text, name->text);
      break;
    }
    case 'Q': persistent_id(); break;                                              // BINPERSID
    case 'R': reduce(); break;                                                     // REDUCE
    case 'b': build(); break;                                                      // BUILD
    case 'i': case 'o': case 0x81: case 0x92: case 0x82: case 0x83: case 0x84:
      fail("an opcode that builds an arbitrary object (" + std::to_string(op) + ")");
    default: {
      const char c = static_cast<char>(op);
      fail(c >= 0x20 && c < 0x7f ? std::string("opcode '") + c + "' is not supported (protocol 0 text?)"
                                 : "unknown opcode " + std::to_string(op));
    }
  }
  return true;
}

}  // namespace

const char* kind_name(PyKind k) {
  switch (k) {
    case PyKind::None: return "None";
    case PyKind::Bool: return "bool";
    case PyKind::Int: return "int";
    case PyKind::Float: return "float";
    case PyKind::Str: return "str";
    case PyKind::Bytes: return "bytes";
    case PyKind::Tuple: return "tuple";
    case PyKind::List: return "list";
    case PyKind::Dict: return "dict";
    case PyKind::Tensor: return "tensor";
    case PyKind::Global: return "global";
    case PyKind::Storage: return "storage";
  }
  return "?";
}

PyRef unpickle(const unsigned char* data, std::size_t size, const std::string& source) {
  return Unpickler(data, size, source).run();
}

const PyObject* PyObject::get(const std::string& key) const {
  for (const auto& kv : entries)
    if (kv.first->is_str(key)) return kv.second.get();
  return nullptr;
}

const PyObject* PyObject::get(int64_t key) const {
  for (const auto& kv : entries)
    if (kv.first->kind == PyKind::Int && kv.first->integer == key) return kv.second.get();
  return nullptr;
}

}  // namespace scaletrain::checkpoint

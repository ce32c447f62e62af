// The writing half of torch_pickle.h: builders and the protocol-2 pickler.
#include <cstring>

#include "scaletrain/checkpoint/torch_pickle.h"

namespace scaletrain::checkpoint {

namespace {

PyRef make(PyKind k) {
  auto p = std::make_shared<PyObject>();
  p->kind = k;
  return p;
}

const char* storage_class(Dtype d) {
  switch (d) {
    case Dtype::F32: return "FloatStorage";
    case Dtype::F64: return "DoubleStorage";
    case Dtype::F16: return "HalfStorage";
    case Dtype::BF16: return "BFloat16Storage";
    case Dtype::I64: return "LongStorage";
    case Dtype::I32: return "IntStorage";
    case Dtype::I16: return "ShortStorage";
    case Dtype::I8: return "CharStorage";
    case Dtype::U8: return "ByteStorage";
    case Dtype::BOOL: return "BoolStorage";
    default: torch_file_fail("<write>", std::string("no PyTorch storage holds ") + dtype_name(d));
  }
}

class Pickler {
 public:
  std::string out;
  void value(const PyObject& v, int depth);

 private:
  void u(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void op(unsigned char c) { out.push_back(static_cast<char>(c)); }
  void str(const std::string& s) {
    op('X');
    u(s.size(), 4);
    out += s;
  }
  void integer(int64_t v);
  void global(const char* module, const char* name) { out += std::string("c") + module + "\n" + name + "\n"; }
  void int_tuple(const std::vector<int64_t>& v);
  void tensor(const TensorRecord& t);
};

void Pickler::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    op('K');
    u(static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    op('M');
    u(static_cast<uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op('J');
    u(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    op(0x8a);  // LONG1, eight bytes of two's complement
    u(8, 1);
    u(static_cast<uint64_t>(v), 8);
  }
}

void Pickler::int_tuple(const std::vector<int64_t>& v) {
  op('(');
  for (int64_t x : v) integer(x);
  op('t');
}

void Pickler::tensor(const TensorRecord& t) {
  if (t.parameter) global("torch._utils", "_rebuild_parameter");
  global("torch._utils", "_rebuild_tensor_v2");
  op('(');
  op('(');  // the persistent id
  str("storage");
  global("torch", storage_class(t.dtype));
  str(t.storage);
  str("cpu");
  integer(t.storage_numel);
  op('t');
  op('Q');
  integer(t.offset);
  int_tuple(t.size);
  int_tuple(t.stride);
  op(t.requires_grad && !t.parameter ? 0x88 : 0x89);
  global("collections", "OrderedDict");
  op(')');
  op('R');
  op('t');
  op('R');
  if (t.parameter) {  // (tensor, requires_grad, OrderedDict())
    op(t.requires_grad ? 0x88 : 0x89);
    global("collections", "OrderedDict");
    op(')');
    op('R');
    op(0x87);
    op('R');
  }
}

void Pickler::value(const PyObject& v, int depth) {
  if (depth > 512) torch_file_fail("<write>", "values nested deeper than 512");
  switch (v.kind) {
    case PyKind::None: op('N'); break;
    case PyKind::Bool: op(v.boolean ? 0x88 : 0x89); break;
    case PyKind::Int: integer(v.integer); break;
    case PyKind::Float: {
      uint64_t bits;
      std::memcpy(&bits, &v.real, 8);
      op('G');
      for (int k = 7; k >= 0; --k) out.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
      break;
    }
    case PyKind::Str: str(v.text); break;
    case PyKind::Bytes:
      op('B');
      u(v.text.size(), 4);
      out += v.text;
      break;
    case PyKind::Tuple:
      op('(');
      for (const PyRef& i : v.items) value(*i, depth + 1);
      op('t');
      break;
    case PyKind::List:
      op(']');
      op('(');
      for (const PyRef& i : v.items) value(*i, depth + 1);
      op('e');
      break;
    case PyKind::Dict:
      if (v.ordered) {
        global("collections", "OrderedDict");
        op(')');
        op('R');
      } else {
        op('}');
      }
      op('(');
      for (const auto& [k, x] : v.entries) {
        if (k->kind != PyKind::Str && k->kind != PyKind::Int)
          torch_file_fail("<write>", std::string("a dict key of type ") + kind_name(k->kind));
        value(*k, depth + 1);
        value(*x, depth + 1);
      }
      op('u');
      break;
    case PyKind::Tensor: tensor(*v.tensor); break;
    case PyKind::Global:
    case PyKind::Storage: torch_file_fail("<write>", std::string("cannot pickle a bare ") + kind_name(v.kind));
  }
}

}  // namespace

PyRef py_none() { return make(PyKind::None); }
PyRef py_bool(bool v) {
  PyRef p = make(PyKind::Bool);
  p->boolean = v;
  return p;
}
PyRef py_int(int64_t v) {
  PyRef p = make(PyKind::Int);
  p->integer = v;
  return p;
}
PyRef py_float(double v) {
  PyRef p = make(PyKind::Float);
  p->real = v;
  return p;
}
PyRef py_str(std::string v) {
  PyRef p = make(PyKind::Str);
  p->text = std::move(v);
  return p;
}
PyRef py_tuple(std::vector<PyRef> items) {
  PyRef p = make(PyKind::Tuple);
  p->items = std::move(items);
  return p;
}
PyRef py_list(std::vector<PyRef> items) {
  PyRef p = make(PyKind::List);
  p->items = std::move(items);
  return p;
}
PyRef py_dict(std::vector<std::pair<PyRef, PyRef>> entries, bool ordered) {
  PyRef p = make(PyKind::Dict);
  p->entries = std::move(entries);
  p->ordered = ordered;
  return p;
}
PyRef py_tensor(TensorRecord record) {
  PyRef p = make(PyKind::Tensor);
  p->tensor = std::make_shared<TensorRecord>(std::move(record));
  return p;
}

std::string pickle(const PyObject& value) {
  Pickler p;
  p.out = "\x80\x02";
  p.value(value, 0);
  p.out.push_back('.');
  return p.out;
}

}  // namespace scaletrain::checkpoint

#pragma once
// The pickle inside PyTorch's `torch.save` files, read against an allowlist
// and written as `torch.save` writes it; without libtorch.
//
// Note [Restricted unpickling]
// A pickle is a program for a stack machine, and Python's unpickler runs
// whatever callable a GLOBAL names: `torch.load` of a stranger's file is code
// execution. We never call anything. The interpreter below knows the
// opcodes of protocols 2-5 that build plain data (None, bool, int up to 64
// bits, float, str, bytes, tuple, list, dict, the memo, marks) and exactly
// the globals PyTorch's `weights_only=True` loader needs for state dicts and
// optimizer state dicts:
//
//   collections.OrderedDict              -> a dict that remembers it was ordered
//   torch._utils._rebuild_tensor_v2      -> a TensorRecord (storage, offset,
//                                           size, stride; no backward hooks)
//   torch._utils._rebuild_parameter      -> the same, marked as a parameter
//   torch._utils._rebuild_parameter_with_state (empty state only)
//   torch.Size                           -> a tuple
//   torch.{Float,Double,Half,BFloat16,Long,Int,Short,Char,Byte,Bool}Storage
//                                        -> a storage's element type, only
//                                           inside a persistent id
//
// Any other GLOBAL (os.system, builtins.eval, a subclass of an allowed class:
// its own module and name), the opcodes that build arbitrary objects (INST,
// OBJ, NEWOBJ, NEWOBJ_EX, EXT*), a BUILD on anything but an OrderedDict's
// attributes, and the text opcodes of protocol 0 are refused by name before
// any object is built. A persistent id must be the tuple
// ('storage', StorageClass, key, location, numel); the storage's bytes are the
// caller's business (Note [PyTorch zip layout]).
//
// Bounds: every length is checked against the bytes left; a container may
// not change once placed in another (Python's pickler fills a container
// before its parent takes it), which rules out cycles and keeps each nesting
// depth exact; the depth is limited to 512 and the number of objects to
// 4 million (a 70B model's state dict and Adam state build about 30,000), so
// a pickle costs at most about 600 MB whatever it claims; tensor sizes are
// checked against the storages' bytes before anything is allocated for them.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/torch_zip.h"

namespace scaletrain::checkpoint {

// What `_rebuild_tensor_v2` is called with: storage `key`'s elements, viewed.
struct TensorRecord {
  std::string storage;                // key: PREFIX/data/KEY in the zip
  Dtype dtype = Dtype::F32;           // of the storage class
  int64_t storage_numel = 0;          // elements the storage holds
  int64_t offset = 0;                 // in elements
  std::vector<int64_t> size, stride;  // in elements
  bool requires_grad = false;
  bool parameter = false;  // saved as an nn.Parameter
};

enum class PyKind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Tensor, Global, Storage };

struct PyObject;
using PyRef = std::shared_ptr<PyObject>;

struct PyObject {
  PyKind kind = PyKind::None;
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;                              // Str, Bytes, Global ("module.name")
  std::vector<PyRef> items;                      // Tuple, List
  std::vector<std::pair<PyRef, PyRef>> entries;  // Dict, in insertion order
  bool ordered = false;                          // Dict: an OrderedDict
  std::shared_ptr<TensorRecord> tensor;          // Tensor, Storage
  int depth = 0;                                 // containers: nesting below
  bool placed = false;                           // inside another container

  // Dict: the value under a str (or int) key, or nullptr.
  const PyObject* get(const std::string& key) const;
  const PyObject* get(int64_t key) const;
  bool is_str(const std::string& s) const { return kind == PyKind::Str && text == s; }
};

const char* kind_name(PyKind k);

// Runs the pickle in [data, data + size) under Note [Restricted unpickling];
// `source` names it in errors ("torch file SOURCE: PROBLEM at byte N").
PyRef unpickle(const unsigned char* data, std::size_t size, const std::string& source);

// Builders for a value to pickle.
PyRef py_none();
PyRef py_bool(bool v);
PyRef py_int(int64_t v);
PyRef py_float(double v);
PyRef py_str(std::string v);
PyRef py_tuple(std::vector<PyRef> items);
PyRef py_list(std::vector<PyRef> items);
PyRef py_dict(std::vector<std::pair<PyRef, PyRef>> entries, bool ordered = false);
PyRef py_tensor(TensorRecord record);

// Protocol 2, as `torch.save` writes: each tensor as `_rebuild_tensor_v2`
// (a parameter wrapped in `_rebuild_parameter`) over a persistent id naming
// its storage's key; tensors that name one key share that storage when read
// back. Throws TorchFileError on a Global or Storage value, a dict key other
// than str or int, or a nesting deeper than 512.
std::string pickle(const PyObject& value);

}  // namespace scaletrain::checkpoint

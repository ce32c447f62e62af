// libFuzzer target for the PyTorch file readers (checkpoint/torch_zip.h and
// checkpoint/torch_pickle.h): the zip container and the restricted
// unpickler, each fed directly.
//
// The first byte picks the entry point: even, the input is a zip archive
// (parsed; its entries' bytes touched; a data.pkl found is unpickled); odd,
// the rest is a pickle. Every input must be accepted or refused with
// TorchFileError; anything else escapes and aborts, and ASan/UBSan catch
// reads past the buffer and overflow. An accepted pickle without globals or
// storages left in it is written back with pickle() and must read back as
// the same value.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "scaletrain/checkpoint/torch_pickle.h"
#include "scaletrain/checkpoint/torch_zip.h"

using namespace scaletrain::checkpoint;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

// Whether pickle() can write v: no bare global or storage inside, and at
// most `budget` nodes as a tree (the memo lets a small pickle name one
// object many times; pickle() writes each use).
bool writable(const PyObject& v, long& budget) {
  if (--budget < 0 || v.kind == PyKind::Global || v.kind == PyKind::Storage) return false;
  for (const auto& [k, x] : v.entries)
    if (!writable(*k, budget) || !writable(*x, budget)) return false;
  for (const PyRef& i : v.items)
    if (!writable(*i, budget)) return false;
  return true;
}

bool same(const PyObject& a, const PyObject& b) {
  if (a.kind != b.kind || a.boolean != b.boolean || a.integer != b.integer || a.text != b.text) return false;
  if (a.kind == PyKind::Float && !(a.real == b.real || (a.real != a.real && b.real != b.real))) return false;
  if (a.items.size() != b.items.size() || a.entries.size() != b.entries.size()) return false;
  for (size_t i = 0; i < a.items.size(); ++i)
    if (!same(*a.items[i], *b.items[i])) return false;
  for (size_t i = 0; i < a.entries.size(); ++i)
    if (!same(*a.entries[i].first, *b.entries[i].first) || !same(*a.entries[i].second, *b.entries[i].second))
      return false;
  if (a.kind == PyKind::Tensor) {
    const TensorRecord &x = *a.tensor, &y = *b.tensor;
    return x.storage == y.storage && x.dtype == y.dtype && x.storage_numel == y.storage_numel &&
           x.offset == y.offset && x.size == y.size && x.stride == y.stride && x.parameter == y.parameter &&
           x.requires_grad == y.requires_grad;
  }
  return true;
}

void run_pickle(const unsigned char* p, size_t n) {
  const PyRef v = unpickle(p, n, "<fuzz>");
  check(v != nullptr);
  long budget = 100000;
  if (!writable(*v, budget)) return;
  std::string again;
  try {
    again = pickle(*v);
  } catch (const TorchFileError&) {
    return;  // a dict key pickle() does not write (bool keys), or depth
  }
  check(same(*v, *unpickle(reinterpret_cast<const unsigned char*>(again.data()), again.size(), "<again>")));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  try {
    if (data[0] & 1) {
      run_pickle(data + 1, size - 1);
      return 0;
    }
    const ZipView zip = ZipView::parse(data + 1, size - 1, "<fuzz>");
    unsigned sum = 0;
    for (const ZipEntry& e : zip.entries()) {
      check(e.data >= data + 1 && e.data + e.size <= data + size);
      for (size_t i = 0; i < e.size; ++i) sum += e.data[i];
      check(zip.find(e.name) == &e);
      if (e.name.size() >= 8 && e.name.compare(e.name.size() - 8, 8, "data.pkl") == 0) {
        zip.check_crc(e);
        run_pickle(e.data, e.size);
      }
    }
    (void)sum;
  } catch (const TorchFileError&) {
  }
  return 0;
}

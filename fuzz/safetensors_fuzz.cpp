// libFuzzer target for the safetensors reader's byte-span entry point.
//
// Every input must either parse or be refused with SafetensorsError; any other
// exception escapes and aborts (libFuzzer reports it), and ASan/UBSan catch
// out-of-bounds reads and arithmetic overflow. Accepted inputs are also
// checked for internal consistency, touched byte by byte (so a view past the
// buffer faults under ASan), and round-tripped through the writer: the
// re-serialized file must parse to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"

using namespace scaletrain::checkpoint;

namespace {

void check(bool ok) {
  if (!ok) std::abort();
}

void check_same(const SafetensorsView& a, const SafetensorsView& b) {
  check(a.metadata() == b.metadata());
  check(a.tensors().size() == b.tensors().size());
  for (const TensorView& t : a.tensors()) {
    const TensorView* u = b.find(t.name);
    check(u != nullptr);
    check(u->dtype == t.dtype && u->shape == t.shape && u->nbytes == t.nbytes);
    check(t.nbytes == 0 || std::memcmp(u->data, t.data, t.nbytes) == 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const SafetensorsView view = SafetensorsView::parse(data, size, "<fuzz>");
    const auto* end = data + size;
    unsigned sum = 0;
    std::vector<TensorRef> refs;
    for (const TensorView& t : view.tensors()) {
      check(t.data >= data && t.data + t.nbytes <= end);
      check(static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype) == t.nbytes);
      for (std::size_t i = 0; i < t.nbytes; ++i) sum += t.data[i];
      check(view.find(t.name) == &t);
      refs.push_back(TensorRef{t.name, t.dtype, t.shape, t.data, t.nbytes});
    }
    const std::string again = serialize_safetensors(refs, view.metadata());
    check_same(view, SafetensorsView::parse(again.data(), again.size(), "<again>"));
    // Canonical form is a fixed point.
    check(serialize_safetensors(refs, view.metadata()) == again);
    (void)sum;
  } catch (const SafetensorsError&) {
  }
  return 0;
}

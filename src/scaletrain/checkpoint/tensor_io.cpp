#include "scaletrain/checkpoint/tensor_io.h"

#include <cstring>

namespace scaletrain::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& source, const std::string& tensor, const std::string& problem) {
  throw SafetensorsError("safetensors " + source + ": tensor '" + tensor + "': " + problem);
}

}  // namespace

Dtype safetensors_dtype(at::ScalarType type, const std::string& tensor) {
  switch (type) {
    case at::kDouble:
      return Dtype::F64;
    case at::kFloat:
      return Dtype::F32;
    case at::kHalf:
      return Dtype::F16;
    case at::kBFloat16:
      return Dtype::BF16;
    case at::kLong:
      return Dtype::I64;
    case at::kInt:
      return Dtype::I32;
    case at::kShort:
      return Dtype::I16;
    case at::kChar:
      return Dtype::I8;
    case at::kByte:
      return Dtype::U8;
    case at::kBool:
      return Dtype::BOOL;
    default:
      throw SafetensorsError("safetensors: tensor '" + tensor + "' has dtype " + std::string(c10::toString(type)) +
                             ", which safetensors cannot store");
  }
}

at::ScalarType torch_dtype(Dtype dtype, const std::string& tensor) {
  switch (dtype) {
    case Dtype::F64:
      return at::kDouble;
    case Dtype::F32:
      return at::kFloat;
    case Dtype::F16:
      return at::kHalf;
    case Dtype::BF16:
      return at::kBFloat16;
    case Dtype::I64:
      return at::kLong;
    case Dtype::I32:
      return at::kInt;
    case Dtype::I16:
      return at::kShort;
    case Dtype::I8:
      return at::kChar;
    case Dtype::U8:
      return at::kByte;
    case Dtype::BOOL:
      return at::kBool;
    default:
      throw SafetensorsError("safetensors: tensor '" + tensor + "' has dtype " + dtype_name(dtype) +
                             ", which this libtorch has no type for");
  }
}

at::Tensor tensor_from_view(const TensorView& view, const std::string& source) {
  at::ScalarType type;
  try {
    type = torch_dtype(view.dtype, view.name);
  } catch (const SafetensorsError&) {
    fail(source, view.name, std::string("dtype ") + dtype_name(view.dtype) + " has no libtorch type");
  }
  if (view.dtype == Dtype::BOOL) {
    for (std::size_t i = 0; i < view.nbytes; ++i) {
      if (view.data[i] > 1) {
        fail(source, view.name,
             "BOOL element " + std::to_string(i) + " is " + std::to_string(view.data[i]) + ", not 0 or 1");
      }
    }
  }
  at::Tensor t = at::empty(view.shape, at::TensorOptions().dtype(type).device(at::kCPU));  // host: file bytes
  if (view.nbytes > 0) std::memcpy(t.data_ptr(), view.data, view.nbytes);
  return t;
}

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const Metadata& metadata) {
  std::vector<at::Tensor> keep;  // the contiguous CPU copies the refs point into
  std::vector<TensorRef> refs;
  keep.reserve(tensors.size());
  refs.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) fail(path, name, "undefined tensor");
    if (tensor.layout() != at::kStrided) fail(path, name, "only dense (strided) tensors can be saved");
    const Dtype dtype = safetensors_dtype(tensor.scalar_type(), name);
    keep.push_back(tensor.detach().to(at::kCPU).contiguous());  // host: file bytes
    const at::Tensor& t = keep.back();
    refs.push_back(TensorRef{name, dtype, t.sizes().vec(), t.data_ptr(), t.nbytes()});
  }
  write_safetensors(path, refs, metadata);
}

TensorMap load_safetensors(const std::string& path, Metadata* metadata) {
  const SafetensorsFile file(path);
  TensorMap out;
  for (const TensorView& v : file.tensors()) out.emplace(v.name, tensor_from_view(v, path));
  if (metadata) *metadata = file.metadata();
  return out;
}

}  // namespace scaletrain::checkpoint

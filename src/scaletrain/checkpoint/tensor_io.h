#pragma once
// at::Tensor <-> safetensors files: a thin adapter over the torch-free
// checkpoint/safetensors.h (which owns the format and its validation).
//
// Note [Copy on load]
// load_safetensors() copies every tensor out of the mapped file into memory
// that the tensor owns, instead of at::from_blob over the mapping with the
// mapping kept alive by a deleter. Reasons: (1) a mapping is read-only, and
// loaded tensors become parameters and optimizer state that are written in
// place; a copy-on-write private mapping would silently double memory on the
// first write anyway. (2) A file replaced or truncated on disk while mapped
// makes later reads fault (SIGBUS) at some distant point in training; after a
// copy the file can be deleted or rewritten at once (the next checkpoint often
// overwrites the one just loaded). (3) The copy is one memcpy per tensor, small
// next to reading the bytes from disk, and the tensors then have ordinary
// allocator-owned, aligned storage. A caller that wants zero-copy access
// can use SafetensorsFile and the views directly.
#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"

namespace scaletrain::checkpoint {

// Loaded tensors, ordered by name.
using TensorMap = std::map<std::string, at::Tensor>;

// The safetensors dtype of a torch dtype; throws SafetensorsError naming
// `tensor` for one the format or this adapter cannot store (complex, quantized).
Dtype safetensors_dtype(at::ScalarType type, const std::string& tensor);
// The torch dtype of a safetensors dtype; throws SafetensorsError naming
// `tensor` for one libtorch 1.13 lacks (U16, U32, U64, F8_*).
at::ScalarType torch_dtype(Dtype dtype, const std::string& tensor);

// A CPU tensor holding a copy of `view` (Note [Copy on load]). BOOL bytes must
// be 0 or 1 (anything else throws: a torch bool holding 2 is undefined).
at::Tensor tensor_from_view(const TensorView& view, const std::string& source);

// Writes `tensors` (any device, any strides: each is copied to a contiguous CPU
// tensor first) and `metadata` to `path` with write_safetensors() (temp file,
// fsync, rename). Throws SafetensorsError on an undefined, sparse or
// unsupported tensor, or a duplicate name.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const Metadata& metadata = {});

// Reads every tensor of `path` into CPU tensors (copies, Note [Copy on load]);
// stores the file's metadata in *metadata when given. Throws SafetensorsError.
TensorMap load_safetensors(const std::string& path, Metadata* metadata = nullptr);

}  // namespace scaletrain::checkpoint

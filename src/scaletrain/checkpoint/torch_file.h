#pragma once
// PyTorch's `torch.save` files as at::Tensors: read safely (no pickle code
// runs, Note [Restricted unpickling]) and written so that Python's
// `torch.load(..., weights_only=True)` reads them back.
//
// A file is memory-mapped; a tensor is copied out (Note [Copy on load]) only
// when asked for, after its record is checked against its storage: the
// storage entry exists, holds exactly numel * element size bytes, and every
// element the size, stride and offset reach lies inside it. A storage's
// CRC-32 is checked the first time any tensor reads it.
#include <torch/torch.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/torch_pickle.h"
#include "scaletrain/checkpoint/torch_zip.h"

namespace scaletrain::checkpoint {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

class TorchFile {
 public:
  // Maps, validates the zip and runs the pickle. Throws TorchFileError (a
  // legacy non-zip file, from PyTorch before 1.6, is named as such).
  explicit TorchFile(const std::string& path);
  ~TorchFile();
  TorchFile(const TorchFile&) = delete;
  TorchFile& operator=(const TorchFile&) = delete;

  const std::string& path() const { return path_; }
  const PyObject& root() const { return *root_; }
  // A copy of the tensor `record` describes, contiguous, in its own dtype.
  at::Tensor tensor(const TensorRecord& record) const;
  // The bytes of a contiguous record inside the mapping (no copy), or nullptr
  // when the record is strided; validated as tensor() validates.
  const unsigned char* contiguous_bytes(const TensorRecord& record) const;
  // Lets the kernel drop mapped pages already copied (SafetensorsFile::release).
  bool contains(const unsigned char* p, std::size_t n) const noexcept;
  void release(const unsigned char* p, std::size_t n) const noexcept;

 private:
  const ZipEntry& storage(const TensorRecord& record) const;

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  ZipView zip_;
  std::string prefix_;  // "PREFIX/"
  PyRef root_;
  mutable std::set<std::string> crc_checked_;
};

// The tensors of a state dict inside `file`: the root when `key` is empty,
// else root[key] (e.g. "model", "state_dict"); names in the file's order.
// A value that is not a tensor, a non-str name or a root that is not a dict
// is refused by name.
NamedTensors state_dict_tensors(const TorchFile& file, const std::string& key = "");
NamedTensors read_torch_state_dict(const std::string& path, const std::string& key = "");

// Copies `state` into `module`'s parameters and buffers by name (converting
// dtype). Refuses, before writing anything, a name the module lacks, a
// parameter or buffer the state lacks (unless `strict` is false) and a shape
// that differs, all named in one message (UsageError).
void load_state_dict(torch::nn::Module& module, const NamedTensors& state, bool strict = true);
// The checks alone (nothing is written).
void check_state_dict(const torch::nn::Module& module, const NamedTensors& state, bool strict = true);

// Builds the pickled value of a `torch.save` file: tensors added here become
// storages of the file (one per tensor, contiguous CPU copies).
class TorchFileWriter {
 public:
  PyRef tensor(const at::Tensor& t);
  // Writes PREFIX/data.pkl, the storages, version and byteorder (temp file,
  // rename). Throws TorchFileError.
  void write(const std::string& path, const PyObject& root) const;

 private:
  std::vector<at::Tensor> storages_;
};

// `torch.save(state_dict, path)` of the named tensors (an OrderedDict).
void save_torch_state_dict(const std::string& path, const NamedTensors& state);

}  // namespace scaletrain::checkpoint

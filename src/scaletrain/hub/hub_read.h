#pragma once
// Hugging Face Hub model directories, read: `config.json` beside either one
// `model.safetensors` or shards named by `model.safetensors.index.json`
// ({"metadata": {"total_size": N}, "weight_map": {tensor: file}}). Where no
// safetensors exist, `pytorch_model.bin` or the shards its
// `pytorch_model.bin.index.json` names (the same index format) are read as
// PyTorch files (checkpoint/torch_file.h: nothing pickled is executed); a
// tensor stored strided in one is copied once at open, the rest are read
// from the mapping like safetensors.
//
// Every file is memory-mapped; a tensor is copied out (and converted to the
// run's dtype) only when asked for, so a loader that asks for one tensor at a
// time holds one tensor, and a rank that asks for a slice copies the slice.
// The mapped pages a read touched are given back once copied (they would
// otherwise count in the process's resident memory until the files close:
// the whole checkpoint, for a loader that reads every tensor).
// Names are the file's; mapping them onto a model's parameters is the model
// family's business (models/), not this file's.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"

namespace scaletrain::checkpoint {
class TorchFile;
}  // namespace scaletrain::checkpoint

namespace scaletrain::hub {

class HubWeights {
 public:
  // `path`: a directory (index + shards, or model.safetensors) or one
  // safetensors file. Throws UsageError naming the file and the problem: no
  // weights, an index that is not JSON or names a missing file, a shard whose
  // header is malformed or lies about sizes, a tensor the index places in a
  // shard that lacks it, a tensor in two shards.
  explicit HubWeights(const std::string& path);
  ~HubWeights();
  HubWeights(HubWeights&&) noexcept;
  HubWeights& operator=(HubWeights&&) noexcept;

  const std::string& source() const { return source_; }
  std::vector<std::string> names() const;
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  // Throws UsageError naming the tensor when it is absent.
  const checkpoint::TensorView& view(const std::string& name) const;
  // A copy of the tensor in `dtype` (F32, F16, BF16 and F64 files).
  at::Tensor read(const std::string& name, at::ScalarType dtype) const;
  // Elements [begin, begin + count) of the flattened tensor, converted into
  // the 1-D `out` (count elements, any floating dtype); the rest of the file
  // is not touched.
  void read_range(const std::string& name, int64_t begin, int64_t count, at::Tensor& out) const;

 private:
  const checkpoint::TensorView& weight(const std::string& name) const;  // view(), floating point or UsageError
  void release(const unsigned char* p, std::size_t n) const;  // SafetensorsFile::release in whichever file holds it
  // Adds the state dict of a PyTorch file (a shard when `weight_map` is not
  // empty) to where_.
  void add_torch_file(const std::string& path, const std::map<std::string, std::string>& weight_map);

  std::string source_;
  std::vector<std::unique_ptr<checkpoint::SafetensorsFile>> files_;
  std::vector<std::unique_ptr<checkpoint::TorchFile>> torch_files_;
  std::deque<checkpoint::TensorView> torch_views_;  // stable addresses for where_
  std::vector<at::Tensor> strided_copies_;  // the bytes of views of strided tensors
  std::map<std::string, const checkpoint::TensorView*> where_;
};

// The config.json of a Hub directory (or of the directory holding a
// safetensors file), parsed; nullopt when there is none. UsageError when it
// is not JSON.
std::optional<nlohmann::json> read_hub_config(const std::string& path);

}  // namespace scaletrain::hub

#include "scaletrain/hub/hub_read.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/checkpoint/torch_file.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

namespace scaletrain::hub {
namespace fs = std::filesystem;
using checkpoint::Dtype;
using checkpoint::SafetensorsFile;
using checkpoint::TensorView;
using checkpoint::TorchFile;
using checkpoint::dtype_name;
using checkpoint::dtype_size;
using checkpoint::kind_name;
using checkpoint::PyKind;
using checkpoint::SafetensorsError;
using checkpoint::TensorRecord;
using checkpoint::torch_file_fail;

namespace {

nlohmann::json parse_file(const fs::path& p) {
  return util::read_json_file(p.string(), p.string());  // Note [Strict JSON]
}

}  // namespace

namespace {

// The files an index names, checked to exist beside it; fills `weight_map`.
std::vector<fs::path> indexed_shards(const fs::path& index, std::map<std::string, std::string>* weight_map) {
  const nlohmann::json j = parse_file(index);
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw UsageError(index.string() + ": no \"weight_map\" object");
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw UsageError(index.string() + ": weight_map entry '" + name + "' is not a file name");
    (*weight_map)[name] = file.get<std::string>();
    files.insert(file.get<std::string>());
  }
  std::vector<fs::path> shards;
  for (const auto& f : files) {
    if (f.find('/') != std::string::npos) throw UsageError(index.string() + ": file '" + f + "' is not in the directory");
    if (!fs::exists(index.parent_path() / f))
      throw UsageError(index.string() + " names " + f + ", which does not exist");
    shards.push_back(index.parent_path() / f);
  }
  return shards;
}

// The weight files of a directory, safetensors first; sets *torch_format
// when only PyTorch files are there.
std::vector<fs::path> directory_shards(const fs::path& p, std::map<std::string, std::string>* weight_map,
                                       bool* torch_format) {
  *torch_format = false;
  if (fs::exists(p / "model.safetensors.index.json")) return indexed_shards(p / "model.safetensors.index.json", weight_map);
  if (fs::exists(p / "model.safetensors")) return {p / "model.safetensors"};
  *torch_format = true;
  if (fs::exists(p / "pytorch_model.bin.index.json")) return indexed_shards(p / "pytorch_model.bin.index.json", weight_map);
  if (fs::exists(p / "pytorch_model.bin")) return {p / "pytorch_model.bin"};
  throw UsageError(p.string() + ": no model.safetensors, model.safetensors.index.json, pytorch_model.bin "
                   "or pytorch_model.bin.index.json");
}

// A single file is a PyTorch one when it starts as a zip does.
bool zip_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  char head[4] = {};
  in.read(head, 4);
  return in.gcount() == 4 && std::string(head, 4) == std::string("PK\x03\x04", 4);
}

}  // namespace

HubWeights::HubWeights(const std::string& path) : source_(path) {
  const fs::path p(path);
  std::vector<fs::path> shards;
  std::map<std::string, std::string> weight_map;  // from the index
  bool torch_format = false;
  if (fs::is_directory(p)) {
    shards = directory_shards(p, &weight_map, &torch_format);
  } else if (fs::exists(p)) {
    shards.push_back(p);
    torch_format = zip_file(p);
  } else {
    throw UsageError(path + ": no such file or directory");
  }
  for (const auto& s : shards) {
    if (torch_format) {
      add_torch_file(s.string(), weight_map);
      continue;
    }
    try {
      files_.push_back(std::make_unique<SafetensorsFile>(s.string()));
    } catch (const SafetensorsError& e) {
      throw UsageError(std::string(e.what()));  // names the file and what its header gets wrong
    }
    const std::string file = s.filename().string();
    for (const TensorView& t : files_.back()->tensors()) {
      if (!weight_map.empty()) {
        auto it = weight_map.find(t.name);
        if (it == weight_map.end() || it->second != file) continue;  // the index decides which copy counts
      }
      if (!where_.emplace(t.name, &t).second) throw UsageError(path + ": tensor '" + t.name + "' is in two files");
    }
  }
  for (const auto& [name, file] : weight_map)
    if (!where_.count(name))
      throw UsageError(path + ": the index places '" + name + "' in " + file + ", which does not hold it");
}

void HubWeights::add_torch_file(const std::string& path, const std::map<std::string, std::string>& weight_map) {
  torch_files_.push_back(std::make_unique<TorchFile>(path));
  const TorchFile& f = *torch_files_.back();
  const std::string file = fs::path(path).filename().string();
  const checkpoint::PyObject& root = f.root();
  if (root.kind != PyKind::Dict) torch_file_fail(path, std::string("holds a ") + kind_name(root.kind) + ", not a state dict");
  for (const auto& [k, v] : root.entries) {
    if (k->kind != PyKind::Str || v->kind != PyKind::Tensor)
      torch_file_fail(path, "holds an entry that is not a named tensor (not a state dict)");
    if (!weight_map.empty()) {
      auto it = weight_map.find(k->text);
      if (it == weight_map.end() || it->second != file) continue;
    }
    const TensorRecord& r = *v->tensor;
    TensorView view;
    view.name = k->text;
    view.dtype = r.dtype;
    view.shape = r.size;
    view.nbytes = static_cast<std::size_t>(view.numel()) * dtype_size(r.dtype);
    view.data = f.contiguous_bytes(r);
    if (!view.data) {  // strided: one copy, owned here
      strided_copies_.push_back(f.tensor(r));
      view.data = static_cast<const unsigned char*>(strided_copies_.back().data_ptr());
    }
    torch_views_.push_back(std::move(view));
    if (!where_.emplace(k->text, &torch_views_.back()).second)
      throw UsageError(source_ + ": tensor '" + k->text + "' is in two files");
  }
}

HubWeights::~HubWeights() = default;
HubWeights::HubWeights(HubWeights&&) noexcept = default;
HubWeights& HubWeights::operator=(HubWeights&&) noexcept = default;

std::vector<std::string> HubWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, v] : where_) out.push_back(name);
  return out;
}

const TensorView& HubWeights::view(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) throw UsageError(source_ + ": no tensor '" + name + "'");
  return *it->second;
}

const TensorView& HubWeights::weight(const std::string& name) const {
  const TensorView& v = view(name);
  if (v.dtype != Dtype::F32 && v.dtype != Dtype::F16 && v.dtype != Dtype::BF16 && v.dtype != Dtype::F64)
    throw UsageError(source_ + ": tensor '" + name + "' is " + dtype_name(v.dtype) + ", not a floating-point weight");
  return v;
}

void HubWeights::release(const unsigned char* p, std::size_t n) const {
  for (const auto& f : files_)
    if (f->contains(p, n)) return f->release(p, n);
  for (const auto& f : torch_files_)
    if (f->contains(p, n)) return f->release(p, n);
}

at::Tensor HubWeights::read(const std::string& name, at::ScalarType dtype) const {
  const TensorView& v = weight(name);
  at::Tensor t = tensor_from_view(v, source_).to(dtype);  // a copy
  release(v.data, v.nbytes);
  return t;
}

void HubWeights::read_range(const std::string& name, int64_t begin, int64_t count, at::Tensor& out) const {
  const TensorView& v = weight(name);
  if (begin < 0 || count < 0 || begin + count > v.numel() || out.dim() != 1 || out.numel() != count)
    throw UsageError(source_ + ": tensor '" + name + "' has no elements [" + std::to_string(begin) + ", " +
                     std::to_string(begin + count) + ") to fill a tensor of " + std::to_string(out.numel()));
  // Only the pages of the range are touched: the mapped bytes (never
  // written) viewed flat, narrowed, converted into `out`.
  const at::Tensor mapped = at::from_blob(const_cast<unsigned char*>(v.data), {v.numel()},
                                          at::TensorOptions().dtype(torch_dtype(v.dtype, name)));
  torch::NoGradGuard no_grad;
  out.copy_(mapped.narrow(0, begin, count));
  const std::size_t size = dtype_size(v.dtype);
  release(v.data + static_cast<std::size_t>(begin) * size, static_cast<std::size_t>(count) * size);
}

std::optional<nlohmann::json> read_hub_config(const std::string& path) {
  fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const fs::path cfg = dir / "config.json";
  if (!fs::exists(cfg)) return std::nullopt;
  return parse_file(cfg);
}

}  // namespace scaletrain::hub

#include "scaletrain/checkpoint/torch_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/posix_file.h"

namespace scaletrain::checkpoint {

namespace {

// The top directory of the entry ".../data.pkl" (exactly one).
std::string find_prefix(const ZipView& zip, const std::string& path) {
  std::string prefix;
  for (const ZipEntry& e : zip.entries()) {
    const auto slash = e.name.find('/');
    if (slash == std::string::npos || e.name.substr(slash + 1) != "data.pkl") continue;
    if (!prefix.empty()) torch_file_fail(path, "two data.pkl entries");
    prefix = e.name.substr(0, slash + 1);
  }
  if (prefix.empty())
    torch_file_fail(path, "no PREFIX/data.pkl entry (a zip, but not written by torch.save)");
  return prefix;
}

}  // namespace

TorchFile::TorchFile(const std::string& path) : path_(path) {
  util::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) torch_file_fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) torch_file_fail(path, "not a regular file");
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  if (map_bytes_ < 4) torch_file_fail(path, "too short to be a PyTorch file");
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    torch_file_fail(path, std::string("cannot map: ") + std::strerror(errno));
  }
  const auto* bytes = static_cast<const unsigned char*>(map_);
  try {
    if (bytes[0] == 0x80 && bytes[1] <= 5)
      torch_file_fail(path, "a legacy (pre-1.6, non-zip) torch.save file: load and save it again with PyTorch >= 1.6");
    if (std::memcmp(bytes, "PK\x03\x04", 4) != 0) torch_file_fail(path, "not a PyTorch file (no zip signature)");
    zip_ = ZipView::parse(map_, map_bytes_, path);
    prefix_ = find_prefix(zip_, path);
    if (const ZipEntry* order = zip_.find(prefix_ + "byteorder");
        order && std::string(reinterpret_cast<const char*>(order->data), order->size) != "little")
      torch_file_fail(path, "a big-endian file (byteorder is not 'little')");
    const ZipEntry& pkl = *zip_.find(prefix_ + "data.pkl");
    zip_.check_crc(pkl);
    root_ = unpickle(pkl.data, pkl.size, path + " (" + pkl.name + ")");
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

TorchFile::~TorchFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

const ZipEntry& TorchFile::storage(const TensorRecord& r) const {
  const std::string name = prefix_ + "data/" + r.storage;
  const ZipEntry* e = zip_.find(name);
  if (!e) torch_file_fail(path_, "a tensor names storage '" + r.storage + "', which the file lacks");
  const unsigned __int128 bytes = static_cast<unsigned __int128>(r.storage_numel) * dtype_size(r.dtype);
  if (bytes != e->size)
    torch_file_fail(path_, "storage '" + r.storage + "' holds " + std::to_string(e->size) + " bytes, not " +
                               std::to_string(r.storage_numel) + " " + dtype_name(r.dtype) + " elements");
  // The last element the view reaches, in 128 bits (no overflow for any
  // 64-bit size, stride and offset).
  unsigned __int128 last = static_cast<uint64_t>(r.offset);
  for (std::size_t d = 0; d < r.size.size(); ++d) {
    if (r.size[d] == 0) return *e;  // no elements: nothing is read
    last += static_cast<unsigned __int128>(r.size[d] - 1) * static_cast<uint64_t>(r.stride[d]);
  }
  if (last >= static_cast<unsigned __int128>(r.storage_numel))
    torch_file_fail(path_, "a tensor over storage '" + r.storage + "' reaches past its " +
                               std::to_string(r.storage_numel) + " elements");
  if (crc_checked_.insert(r.storage).second) zip_.check_crc(*e);
  return *e;
}

const unsigned char* TorchFile::contiguous_bytes(const TensorRecord& r) const {
  const ZipEntry& e = storage(r);
  for (int64_t n : r.size)
    if (n == 0) return e.data;  // no elements
  int64_t expect = 1;
  for (std::size_t d = r.size.size(); d-- > 0;) {
    if (r.size[d] != 1 && r.stride[d] != expect) return nullptr;
    expect *= r.size[d];
  }
  return e.data + static_cast<std::size_t>(r.offset) * dtype_size(r.dtype);
}

at::Tensor TorchFile::tensor(const TensorRecord& r) const {
  const ZipEntry& e = storage(r);
  const at::ScalarType type = torch_dtype(r.dtype, r.storage);
  if (r.dtype == Dtype::BOOL)
    for (std::size_t i = 0; i < e.size; ++i)
      if (e.data[i] > 1) torch_file_fail(path_, "bool storage '" + r.storage + "' holds a byte other than 0 or 1");
  const at::Tensor flat = at::from_blob(const_cast<unsigned char*>(e.data), {r.storage_numel},
                                        at::TensorOptions().dtype(type));
  return flat.as_strided(r.size, r.stride, r.offset).clone(at::MemoryFormat::Contiguous);
}

bool TorchFile::contains(const unsigned char* p, std::size_t n) const noexcept {
  const auto* base = static_cast<const unsigned char*>(map_);
  return map_ && p >= base && n <= map_bytes_ && p - base <= static_cast<std::ptrdiff_t>(map_bytes_ - n);
}

void TorchFile::release(const unsigned char* p, std::size_t n) const noexcept {
  if (!contains(p, n)) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

NamedTensors state_dict_tensors(const TorchFile& file, const std::string& key) {
  const PyObject* dict = &file.root();
  if (!key.empty()) {
    dict = dict->kind == PyKind::Dict ? dict->get(key) : nullptr;
    if (!dict) torch_file_fail(file.path(), "the saved object has no key '" + key + "'");
  }
  const std::string where = key.empty() ? "the saved object" : "'" + key + "'";
  if (dict->kind != PyKind::Dict)
    torch_file_fail(file.path(), where + " is a " + kind_name(dict->kind) + ", not a state dict");
  NamedTensors out;
  for (const auto& [k, v] : dict->entries) {
    if (k->kind != PyKind::Str) torch_file_fail(file.path(), where + " has a key that is not a str");
    if (v->kind != PyKind::Tensor)
      torch_file_fail(file.path(), where + "['" + k->text + "'] is a " + kind_name(v->kind) + ", not a tensor" +
                                       (key.empty() ? " (is the state dict under a key such as 'model'?)" : ""));
    out.emplace_back(k->text, file.tensor(*v->tensor));
  }
  return out;
}

NamedTensors read_torch_state_dict(const std::string& path, const std::string& key) {
  return state_dict_tensors(TorchFile(path), key);
}

namespace {

std::map<std::string, at::Tensor> parameters_and_buffers(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> targets;
  for (const auto& p : module.named_parameters(true)) targets.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(true)) targets.emplace(b.key(), b.value());
  return targets;
}

}  // namespace

void check_state_dict(const torch::nn::Module& module, const NamedTensors& state, bool strict) {
  const std::map<std::string, at::Tensor> targets = parameters_and_buffers(module);
  std::string problems;
  std::set<std::string> seen;
  for (const auto& [name, t] : state) {
    const auto it = targets.find(name);
    if (it == targets.end()) {
      problems += "; unexpected '" + name + "'";
    } else if (it->second.sizes() != t.sizes()) {
      problems += "; '" + name + "' is " + c10::str(t.sizes()) + " in the file, " + c10::str(it->second.sizes()) +
                  " in the module";
    }
    seen.insert(name);
  }
  if (strict)
    for (const auto& [name, t] : targets)
      if (!seen.count(name)) problems += "; missing '" + name + "'";
  if (!problems.empty()) throw UsageError("state dict does not fit the module: " + problems.substr(2));
}

void load_state_dict(torch::nn::Module& module, const NamedTensors& state, bool strict) {
  check_state_dict(module, state, strict);
  const std::map<std::string, at::Tensor> targets = parameters_and_buffers(module);
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : state) targets.at(name).copy_(t);
}

PyRef TorchFileWriter::tensor(const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided, "TorchFileWriter: an undefined or sparse tensor");
  storages_.push_back(t.detach().to(at::kCPU).contiguous());  // host: the file's bytes
  const at::Tensor& s = storages_.back();
  TensorRecord r;
  r.storage = std::to_string(storages_.size() - 1);
  r.dtype = safetensors_dtype(s.scalar_type(), r.storage);
  r.storage_numel = s.numel();
  r.size = s.sizes().vec();
  r.stride = s.strides().vec();
  r.requires_grad = t.requires_grad();
  return py_tensor(std::move(r));
}

void TorchFileWriter::write(const std::string& path, const PyObject& root) const {
  const std::string pkl = pickle(root);
  static const std::string version = "3\n", order = "little";
  std::vector<ZipRecord> records{{"archive/data.pkl", pkl.data(), pkl.size()},
                                 {"archive/byteorder", order.data(), order.size()}};
  std::vector<std::string> names;
  names.reserve(storages_.size());
  for (std::size_t i = 0; i < storages_.size(); ++i) names.push_back("archive/data/" + std::to_string(i));
  for (std::size_t i = 0; i < storages_.size(); ++i)
    records.push_back({names[i], storages_[i].data_ptr(), storages_[i].nbytes()});
  records.push_back({"archive/version", version.data(), version.size()});
  write_zip(path, records);
}

void save_torch_state_dict(const std::string& path, const NamedTensors& state) {
  TorchFileWriter w;
  std::vector<std::pair<PyRef, PyRef>> entries;
  for (const auto& [name, t] : state) entries.emplace_back(py_str(name), w.tensor(t));
  w.write(path, *py_dict(std::move(entries), /*ordered=*/true));
}

}  // namespace scaletrain::checkpoint

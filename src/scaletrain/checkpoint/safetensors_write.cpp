// The safetensors writer (Note [Safetensors write order] in safetensors.h).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/safetensors_detail.h"
#include "scaletrain/util/posix_file.h"

namespace scaletrain::checkpoint {

using namespace detail;
namespace {

// The header and the tensors in data order (Note [Safetensors write order]).
struct Prepared {
  std::string prefix;                   // u64 length + padded JSON header
  std::vector<const TensorRef*> order;  // tensors in data order
  uint64_t data_bytes = 0;              // length of the data section
};

Prepared prepare(const std::vector<TensorRef>& tensors, const Metadata& metadata, const std::string& dest,
                 bool streamed = false) {
  Prepared p;
  std::set<std::string> names;
  for (const TensorRef& t : tensors) {
    if (t.name == kMetadataKey) fail(dest, "tensor name \"__metadata__\" is reserved");
    if (!is_utf8(t.name)) fail(dest, "tensor name " + quote_name(t.name) + " is not valid UTF-8");
    if (!names.insert(t.name).second) fail(dest, "duplicate tensor name " + quote_name(t.name));
    uint64_t want = 0;
    for (const int64_t d : t.shape) {
      if (d < 0) fail(dest, "tensor " + quote_name(t.name) + ": negative dimension in shape " + shape_string(t.shape));
    }
    if (!shape_bytes(t.shape, t.dtype, &want)) {
      fail(dest, "tensor " + quote_name(t.name) + ": shape " + shape_string(t.shape) + " overflows 64 bits");
    }
    if (want != t.nbytes) {
      fail(dest, "tensor " + quote_name(t.name) + ": shape " + shape_string(t.shape) + " of " + dtype_name(t.dtype) +
                     " needs " + std::to_string(want) + " bytes, got " + std::to_string(t.nbytes));
    }
    if (t.nbytes > 0 && !t.data && !streamed) fail(dest, "tensor " + quote_name(t.name) + ": null data");
    p.order.push_back(&t);
  }
  for (const auto& [k, v] : metadata) {
    if (!is_utf8(k) || !is_utf8(v)) fail(dest, "__metadata__ entry " + quote_name(k) + " is not valid UTF-8");
  }
  std::sort(p.order.begin(), p.order.end(), [](const TensorRef* a, const TensorRef* b) { return data_before(*a, *b); });

  // Compact JSON in the Rust implementation's field order; built by hand
  // (strings escaped by nlohmann) so the cost stays linear in the tensors.
  auto str = [](const std::string& s) { return nlohmann::json(s).dump(); };
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      header += (first ? "" : ",") + str(k) + ":" + str(v);
      first = false;
    }
    header += "}";
  }
  for (const TensorRef* t : p.order) {
    if (header.size() > 1) header += ",";
    header += str(t->name) + ":{\"dtype\":\"" + dtype_name(t->dtype) + "\",\"shape\":[";
    for (std::size_t i = 0; i < t->shape.size(); ++i) header += (i ? "," : "") + std::to_string(t->shape[i]);
    const uint64_t begin = p.data_bytes;
    if (__builtin_add_overflow(p.data_bytes, static_cast<uint64_t>(t->nbytes), &p.data_bytes)) {
      fail(dest, "total data size overflows 64 bits");
    }
    header += "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(p.data_bytes) + "]}";
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxHeaderBytes) {
    fail(dest, "header of " + std::to_string(header.size()) + " bytes exceeds the limit of " +
                   std::to_string(kMaxHeaderBytes));
  }
  p.prefix.resize(8);
  for (int i = 0; i < 8; ++i) p.prefix[i] = static_cast<char>(static_cast<uint64_t>(header.size()) >> (8 * i));
  p.prefix += header;
  return p;
}

void write_all(int fd, const void* buf, std::size_t n, const std::string& path) {
  if (const int err = util::write_all(fd, buf, n)) fail(path, "write failed: " + os_error(err));
}

}  // namespace

std::string serialize_safetensors(const std::vector<TensorRef>& tensors, const Metadata& metadata) {
  Prepared p = prepare(tensors, metadata, "<memory>");
  std::string out = std::move(p.prefix);
  out.reserve(out.size() + p.data_bytes);
  for (const TensorRef* t : p.order) out.append(static_cast<const char*>(t->data), t->nbytes);
  return out;
}

bool data_before(const TensorRef& a, const TensorRef& b) {
  if (a.dtype != b.dtype) return a.dtype > b.dtype;
  return a.name < b.name;
}

void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors, const Metadata& metadata) {
  write_safetensors_streamed(
      path, tensors, [](const TensorRef& t) { return t.data; }, metadata);
}

void write_safetensors_streamed(const std::string& path, const std::vector<TensorRef>& tensors,
                                const TensorSource& source, const Metadata& metadata) {
  const Prepared p = prepare(tensors, metadata, path, /*streamed=*/true);
  // The pid keeps two processes writing the same path (every rank of a job)
  // out of one temp file; the last rename wins and each renamed file is whole.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  util::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail(path, "cannot create " + tmp + ": " + os_error(errno));
  util::TempFileGuard guard(tmp);
  write_all(fd.get(), p.prefix.data(), p.prefix.size(), path);
  for (const TensorRef* t : p.order) {
    const void* data = source(*t);
    if (t->nbytes > 0 && !data) fail(path, "tensor " + quote_name(t->name) + ": null data");
    write_all(fd.get(), data, t->nbytes, path);
  }
  // fsync before rename: otherwise a crash can leave the new name pointing at
  // a file whose data blocks never reached the disk.
  if (::fsync(fd.get()) != 0) fail(path, "fsync failed: " + os_error(errno));
  if (fd.release_and_close() != 0) fail(path, "close failed: " + os_error(errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(path, "cannot rename " + tmp + " into place: " + os_error(errno));
  guard.commit();
  // Make the rename itself durable (best effort: some file systems refuse
  // fsync on a directory, and the data is already safe under one name).
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  util::Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() >= 0) ::fsync(dfd.get());
}

}  // namespace scaletrain::checkpoint

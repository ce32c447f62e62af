#pragma once
// The zip container of PyTorch's `torch.save` files (and of `pytorch_model.bin`
// since PyTorch 1.6), read and written without libtorch.
//
// Note [PyTorch zip layout]
// A `torch.save` file is a zip archive whose entries all sit under one top
// directory (PREFIX: the file's stem in PyTorch 1.x, "archive" in 2.x):
//
//   PREFIX/data.pkl     the pickled object (Note [Restricted unpickling])
//   PREFIX/data/KEY     one storage's raw little-endian bytes per key
//   PREFIX/version      "3\n" (the format version), sometimes ".data/version"
//   PREFIX/byteorder    "little" (PyTorch 2.x; absent means little)
//
// Entries are stored (method 0, no compression) and each entry's data starts
// on a 64-byte boundary: PyTorch pads the local header's extra field so a
// mapped file gives aligned storages. Archives above 4 GiB use the ZIP64
// records (APPNOTE 4.3.14-4.3.15, extra field 0x0001).
//
// The reader trusts nothing: the end record is searched only in the last
// 64 KiB + 22 bytes, every offset and size (central directory, local header,
// name, extra field, data) is checked against the bytes present before it is
// used, an entry must be stored (a compressed or encrypted one is refused by
// name), its stored and original sizes must agree, and two entries may not
// share a name. Memory use is the central directory's entry count times a
// small record, and the count is bounded by the directory's size.
#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "scaletrain/util/error.h"

namespace scaletrain::checkpoint {

// Any malformed PyTorch file (zip or pickle) and any invalid write request:
// bad input, so a UsageError (the CLI exits 2). One line: "torch file
// SOURCE: PROBLEM".
class TorchFileError : public UsageError {
 public:
  explicit TorchFileError(const std::string& what) : UsageError(what) {}
};

[[noreturn]] void torch_file_fail(const std::string& source, const std::string& problem);

struct ZipEntry {
  std::string name;
  const unsigned char* data = nullptr;  // first byte of the stored bytes
  std::size_t size = 0;
  uint32_t crc32 = 0;  // as the central directory records it
};

// A validated view of a whole zip archive in memory (a mapping).
class ZipView {
 public:
  // Throws TorchFileError naming `source` and the problem.
  static ZipView parse(const void* data, std::size_t size, const std::string& source);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  const ZipEntry* find(const std::string& name) const;
  // Throws TorchFileError naming the entry when the bytes do not match the
  // recorded CRC-32.
  void check_crc(const ZipEntry& entry) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<ZipEntry> entries_;
  std::map<std::string, std::size_t> index_;
};

// One entry to write; `data` stays valid during the call.
struct ZipRecord {
  std::string name;
  const void* data = nullptr;
  std::size_t size = 0;
};

// An archive as PyTorch writes it (stored entries, data on 64-byte
// boundaries, ZIP64 records only where a size or offset needs them), as bytes.
std::string serialize_zip(const std::vector<ZipRecord>& records);
// The same bytes written to `path` through a temp file and a rename (a reader
// never sees a partial file). Throws TorchFileError.
void write_zip(const std::string& path, const std::vector<ZipRecord>& records);

}  // namespace scaletrain::checkpoint

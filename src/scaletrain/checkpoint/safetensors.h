#pragma once
// Reading and writing the safetensors format (huggingface/safetensors), without
// libtorch. checkpoint/tensor_io.h adapts it to at::Tensor.
//
// Note [Safetensors layout]
// A file is, all little-endian:
//
//   8 bytes   u64 N, the length of the header
//   N bytes   a UTF-8 JSON object, padded with spaces to a multiple of 8:
//               {"__metadata__": {"k": "v", ...},                 (optional)
//                "NAME": {"dtype": "F32", "shape": [2, 3],
//                         "data_offsets": [BEGIN, END]}, ...}
//   the rest  the data section: each tensor's raw row-major bytes at
//             [BEGIN, END) relative to the start of this section.
//
// The reader accepts a file only if the tensors tile the data section exactly:
// sorted by offset they start at 0, each begins where the previous ends, the
// last ends at the end of the file, and each span holds exactly
// product(shape) * dtype size bytes. Every size is computed with overflow
// checks and compared with the bytes actually present before any data pointer
// is formed, so a hostile file is rejected without reading out of bounds, and
// memory use is proportional to the header's length (at most 100 MB, the Rust
// implementation's limit), never to a size claimed inside it. Duplicate keys
// are rejected (a DOM parser would silently keep the last one): the header is
// read with a SAX handler that builds the tensor table directly.
//
// Note [Safetensors write order]
// The writer orders tensors like the Rust implementation's serialize(): by
// Dtype, last enumerator first (the enum is in increasing size order), then by
// name. Because the header is padded to a
// multiple of 8 and every dtype size is 1, 2, 4 or 8, every tensor then starts
// at an address aligned for its element type in a mapped file, so typed views
// need no copy. The header lists "__metadata__" first and the tensors in data
// order, compact JSON, so equal inputs give byte-identical files whatever the
// order they were passed in.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace scaletrain::checkpoint {

// Any malformed or unreadable safetensors input, and any invalid write
// request. The message is one line: "safetensors SOURCE: PROBLEM".
class SafetensorsError : public std::runtime_error {
 public:
  explicit SafetensorsError(const std::string& what) : std::runtime_error(what) {}
};

// Element types of the format (names as they appear in the header), in the
// Rust implementation's order, which the writer sorts by (Note [Safetensors
// write order]).
enum class Dtype { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

// Header spelling, e.g. "BF16".
const char* dtype_name(Dtype d);
// Bytes per element (1, 2, 4 or 8).
std::size_t dtype_size(Dtype d);
// Parses a header spelling; returns false for an unknown one.
bool dtype_from_name(const std::string& name, Dtype* out);

// The dtype a C++ element type is stored as (BOOL is read as uint8_t: the
// bytes are not checked to be 0 or 1, and a bool holding another value is UB).
template <typename T>
constexpr Dtype dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return Dtype::F64;
  else if constexpr (std::is_same_v<T, float>)
    return Dtype::F32;
  else if constexpr (std::is_same_v<T, int64_t>)
    return Dtype::I64;
  else if constexpr (std::is_same_v<T, uint64_t>)
    return Dtype::U64;
  else if constexpr (std::is_same_v<T, int32_t>)
    return Dtype::I32;
  else if constexpr (std::is_same_v<T, uint32_t>)
    return Dtype::U32;
  else if constexpr (std::is_same_v<T, int16_t>)
    return Dtype::I16;
  else if constexpr (std::is_same_v<T, uint16_t>)
    return Dtype::U16;
  else if constexpr (std::is_same_v<T, int8_t>)
    return Dtype::I8;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return Dtype::U8;
  else
    static_assert(!sizeof(T), "no safetensors dtype for this C++ type; use bytes()");
}

// String-to-string map stored under "__metadata__".
using Metadata = std::map<std::string, std::string>;

// One tensor of a parsed file. The data pointer points into the parsed bytes
// (the mapping of a SafetensorsFile): it is valid as long as they are.
struct TensorView {
  std::string name;                     // the header key
  Dtype dtype = Dtype::F32;             // element type
  std::vector<int64_t> shape;           // row-major; empty for a scalar
  const unsigned char* data = nullptr;  // first byte; never null, even when nbytes == 0
  std::size_t nbytes = 0;               // product(shape) * dtype_size(dtype)

  // Number of elements (product of shape; 1 for a scalar).
  int64_t numel() const;
  // The elements as T. Throws SafetensorsError if dtype is not dtype_of<T>()
  // (uint8_t also reads BOOL) or if the data is not aligned for T (only in
  // files whose writer did not follow Note [Safetensors write order]).
  template <typename T>
  const T* as() const {
    const Dtype want = dtype_of<T>();
    check_access(want, alignof(T));
    return reinterpret_cast<const T*>(data);
  }

 private:
  void check_access(Dtype want, std::size_t align) const;
};

// A validated view of a whole safetensors byte string (Note [Safetensors
// layout]). Holds no copy of the data: views point into the parsed bytes.
class SafetensorsView {
 public:
  // Parses and validates `size` bytes at `data`; `source` names them in error
  // messages (a path, or "<memory>"). Throws SafetensorsError.
  static SafetensorsView parse(const void* data, std::size_t size, const std::string& source);

  // Tensors in data-offset order (the order of the data section).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // The tensor called `name`, or nullptr.
  const TensorView* find(const std::string& name) const;
  // The tensor called `name`; throws SafetensorsError naming it if absent.
  const TensorView& at(const std::string& name) const;
  // The "__metadata__" map (empty if the file has none).
  const Metadata& metadata() const { return metadata_; }
  // Where the bytes came from, for error messages upstream.
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::size_t> index_;  // name -> position in tensors_
  Metadata metadata_;
};

// A safetensors file mapped read-only and validated on open. RAII: the mapping
// lives as long as the object; move-only; views die with it. Another process
// truncating the file while it is mapped makes reads fault (SIGBUS), as with
// any mapping: files are replaced by rename (write_safetensors), never
// rewritten in place.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // The parsed content.
  const SafetensorsView& view() const { return view_; }
  const std::vector<TensorView>& tensors() const { return view_.tensors(); }
  const TensorView& at(const std::string& name) const { return view_.at(name); }
  const Metadata& metadata() const { return view_.metadata(); }
  const std::string& path() const { return view_.source(); }

  // Whether [p, p + n) lies in this file's mapping.
  bool contains(const unsigned char* p, std::size_t n) const noexcept;
  // Lets the kernel drop the mapped pages under [p, p + n) (a range inside
  // the mapping, already copied out): they count in the process's resident
  // memory until then. The mapping is read-only, so a later read faults the
  // same bytes back in from the file.
  void release(const unsigned char* p, std::size_t n) const noexcept;

 private:
  void unmap() noexcept;

  void* map_ = nullptr;        // start of the mapping, or null
  std::size_t map_bytes_ = 0;  // length passed to mmap, for munmap
  SafetensorsView view_;
};

// One tensor to write: the caller keeps `data` alive during the call.
struct TensorRef {
  std::string name;            // header key; unique, valid UTF-8, not "__metadata__"
  Dtype dtype = Dtype::F32;    // element type of the bytes
  std::vector<int64_t> shape;  // row-major; non-negative entries
  const void* data = nullptr;  // product(shape) * dtype_size(dtype) bytes, little-endian
  std::size_t nbytes = 0;      // must equal that product
};

// Serializes `tensors` and `metadata` into a byte string in the canonical
// order (Note [Safetensors write order]). Throws SafetensorsError on a
// duplicate or reserved name, invalid UTF-8, a negative dimension, or nbytes
// not matching the shape.
std::string serialize_safetensors(const std::vector<TensorRef>& tensors, const Metadata& metadata = {});

// Writes the same bytes to `path`: into a temp file next to it, fsync'ed, then
// renamed over `path` (readers never see a partial file; on failure `path` is
// untouched and the temp file removed). Tensor data is written straight from
// the callers' buffers, not copied. Throws SafetensorsError.
void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors, const Metadata& metadata = {});

// The same file, but each tensor's bytes come from `source`, called once per
// tensor in data order (TensorRef::data is not read), just before they are
// written; the pointer must stay valid until the next call. A writer that
// gathers each tensor when it is asked for never holds them all at once.
using TensorSource = std::function<const void*(const TensorRef& tensor)>;
void write_safetensors_streamed(const std::string& path, const std::vector<TensorRef>& tensors,
                                const TensorSource& source, const Metadata& metadata = {});
// True when `a`'s bytes come before `b`'s in a file (Note [Safetensors write
// order]): callers that stream tensors produce them in this order.
bool data_before(const TensorRef& a, const TensorRef& b);

}  // namespace scaletrain::checkpoint

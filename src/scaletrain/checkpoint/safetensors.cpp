#include "scaletrain/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "scaletrain/checkpoint/safetensors_detail.h"

// Tensor bytes are handed out without byte swapping and the format is
// little-endian (Note [Safetensors layout]): refuse to build elsewhere.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "scaletrain safetensors I/O assumes a little-endian host"
#endif

namespace scaletrain::checkpoint {
namespace detail {

[[noreturn]] void fail(const std::string& source, const std::string& problem) {
  throw SafetensorsError("safetensors " + source + ": " + problem);
}

std::string os_error(int err) { return std::strerror(err); }

std::string quote_name(const std::string& s) {
  std::string out = "'";
  for (std::size_t i = 0; i < s.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + (s.size() > 80 ? "...'" : "'");
}

std::size_t utf8_error_offset(const unsigned char* s, std::size_t n) {
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (n - i < len) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (std::size_t k = 2; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
    }
    i += len;
  }
  return n;
}

bool is_utf8(const std::string& s) {
  return utf8_error_offset(reinterpret_cast<const unsigned char*>(s.data()), s.size()) == s.size();
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool shape_bytes(const std::vector<int64_t>& shape, Dtype dtype, uint64_t* out) {
  uint64_t n = 1;
  for (const int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  }
  return !__builtin_mul_overflow(n, static_cast<uint64_t>(dtype_size(dtype)), out);
}

}  // namespace detail

using namespace detail;

namespace {

// A tensor entry as the header describes it, before the offsets are checked.
struct Entry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

// Note [Safetensors SAX handler]
// Builds the tensor table while nlohmann's parser walks the header, so that
// (a) duplicate keys are seen (a DOM keeps only the last), (b) every type
// error names the tensor and field, and (c) memory is the table itself, not
// a DOM several times the header's size. It throws SafetensorsError on the
// first problem; values of unknown tensor fields are skipped (the Rust reader
// ignores them too).
class HeaderSax {
 public:
  using json = nlohmann::json;
  HeaderSax(const std::string& source, std::vector<Entry>* entries, std::map<std::string, std::size_t>* index,
            Metadata* metadata)
      : source_(source), entries_(entries), index_(index), metadata_(metadata) {}

  bool null() { return scalar("null"); }
  bool boolean(bool) { return scalar("a boolean"); }
  bool number_integer(json::number_integer_t v) {
    if (v >= 0) return number(static_cast<uint64_t>(v));
    if (skip_ == 0 && !skip_value_ && where_ == kInShape) bad("negative dimension " + std::to_string(v));
    if (skip_ == 0 && !skip_value_ && where_ == kInOffsets) bad("negative data offset " + std::to_string(v));
    return scalar("a negative number");
  }
  bool number_unsigned(json::number_unsigned_t v) { return number(v); }
  bool number_float(json::number_float_t, const std::string&) { return scalar("a non-integer number"); }
  bool binary(json::binary_t&) { return scalar("binary"); }

  bool string(std::string& s) {
    if (skip_ > 0) return true;
    if (where_ == kTensor && field_ == kDtype) {
      if (!dtype_from_name(s, &entries_->back().dtype)) bad("unknown dtype " + quote_name(s));
      where_ = kTensor;
      return true;
    }
    if (where_ == kMetadata) {
      (*metadata_)[key_] = std::move(s);
      return true;
    }
    return scalar("a string");
  }

  bool start_object(std::size_t) {
    if (skip_ > 0 || skip_value_) return open_skipped();
    switch (where_) {
      case kStart:
        where_ = kTop;
        return true;
      case kTop:
        if (key_ == kMetadataKey) {
          where_ = kMetadata;
        } else {
          entries_->push_back(Entry{key_, Dtype::F32, {}, 0, 0});
          seen_ = 0;
          where_ = kTensor;
        }
        return true;
      default:
        return scalar("an object");
    }
  }

  bool start_array(std::size_t) {
    if (skip_ > 0 || skip_value_) return open_skipped();
    if (where_ == kTensor && field_ == kShape) {
      where_ = kInShape;
      return true;
    }
    if (where_ == kTensor && field_ == kOffsets) {
      where_ = kInOffsets;
      offsets_ = 0;
      return true;
    }
    return scalar("an array");
  }

  bool key(std::string& k) {
    if (skip_ > 0) return true;
    if (where_ == kTop) {
      const bool fresh =
          k == kMetadataKey ? !std::exchange(saw_metadata_, true) : index_->emplace(k, entries_->size()).second;
      if (!fresh) fail(source_, "duplicate key " + quote_name(k) + " in the header");
      key_ = std::move(k);
    } else if (where_ == kMetadata) {
      if (metadata_->count(k)) fail(source_, "duplicate __metadata__ key " + quote_name(k));
      key_ = std::move(k);
    } else {  // kTensor
      field_ = k == "dtype" ? kDtype : k == "shape" ? kShape : k == "data_offsets" ? kOffsets : kOther;
      if (field_ == kOther) {
        skip_value_ = true;
      } else {
        if (seen_ & (1u << field_)) bad("duplicate field " + quote_name(k));
        seen_ |= 1u << field_;
      }
    }
    return true;
  }

  bool end_object() {
    if (skip_ > 0) return close_skipped();
    if (where_ == kTensor) {
      if (seen_ != 0b111) {
        const char* missing = !(seen_ & (1u << kDtype))   ? "dtype"
                              : !(seen_ & (1u << kShape)) ? "shape"
                                                          : "data_offsets";
        fail(source_, "tensor " + quote_name(entries_->back().name) + ": missing field \"" + missing + "\"");
      }
    } else if (where_ == kTop) {
      where_ = kDone;
      return true;
    }
    where_ = kTop;  // end of a tensor or of __metadata__
    return true;
  }

  bool end_array() {
    if (skip_ > 0) return close_skipped();
    if (where_ == kInOffsets && offsets_ != 2) bad("data_offsets must have 2 entries, got " + std::to_string(offsets_));
    where_ = kTensor;
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& ex) {
    std::string why = ex.what();
    const auto colon = why.find(": ");  // drop "[json.exception...] parse error at ..."
    if (colon != std::string::npos) why = why.substr(colon + 2);
    const auto last = why.find("; last read");
    if (last != std::string::npos) why = why.substr(0, last);
    if (why.size() > 120) why = why.substr(0, 120) + "...";
    fail(source_, "header is not valid JSON at byte " + std::to_string(position) + ": " + why);
  }

  bool done() const { return where_ == kDone; }

 private:
  // Where the parser is: which container the next event belongs to.
  enum Where { kStart, kTop, kTensor, kMetadata, kInShape, kInOffsets, kDone };
  // The field of a tensor entry whose value comes next (bit index in seen_).
  enum Field { kDtype = 0, kShape = 1, kOffsets = 2, kOther = 3 };

  [[noreturn]] void bad(const std::string& problem) {
    fail(source_, "tensor " + quote_name(entries_->back().name) + ": " + problem);
  }

  bool number(uint64_t v) {
    if (skip_ > 0) return true;
    if (skip_value_) return scalar("");
    if (where_ == kInShape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        bad("dimension " + std::to_string(v) + " overflows int64");
      entries_->back().shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (where_ == kInOffsets) {
      if (offsets_ >= 2) bad("data_offsets must have 2 entries");
      (offsets_++ == 0 ? entries_->back().begin : entries_->back().end) = v;
      return true;
    }
    return scalar("a number");
  }

  // A scalar value where `what` is not allowed, unless it is being skipped.
  bool scalar(const std::string& what) {
    if (skip_ > 0) return true;
    if (skip_value_) {
      skip_value_ = false;
      return true;
    }
    switch (where_) {
      case kStart:
        fail(source_, "header is not a JSON object");
      case kTop:
        if (key_ == kMetadataKey && what == "null") return true;  // "__metadata__": null
        if (key_ == kMetadataKey) fail(source_, "__metadata__ is " + what + ", not an object");
        fail(source_, "tensor " + quote_name(key_) + ": entry is " + what + ", not an object");
      case kMetadata:
        fail(source_, "__metadata__ value of " + quote_name(key_) + " is " + what + ", not a string");
      case kTensor:
        bad(std::string(field_ == kDtype ? "dtype" : field_ == kShape ? "shape" : "data_offsets") + " is " + what);
      case kInShape:
        bad("shape entry is " + what + ", not a dimension");
      case kInOffsets:
        bad("data_offsets entry is " + what + ", not an offset");
      default:
        fail(source_, "unexpected " + what + " in the header");
    }
  }

  bool open_skipped() {
    skip_value_ = false;
    ++skip_;
    return true;
  }
  bool close_skipped() {
    --skip_;
    return true;
  }

  const std::string& source_;
  std::vector<Entry>* entries_;
  std::map<std::string, std::size_t>* index_;  // tensor name -> position in *entries_
  Metadata* metadata_;
  bool saw_metadata_ = false;  // "__metadata__" was a key already
  Where where_ = kStart;
  Field field_ = kOther;     // the tensor field whose value comes next
  unsigned seen_ = 0;        // bit per Field already seen in this tensor
  int offsets_ = 0;          // data_offsets entries read so far
  std::string key_;          // the current top-level or __metadata__ key
  bool skip_value_ = false;  // the next value belongs to an unknown field
  uint64_t skip_ = 0;        // nesting depth inside a skipped value
};

}  // namespace

namespace {
struct DtypeInfo {
  const char* name;  // header spelling
  std::size_t size;  // bytes per element
};
// Indexed by Dtype; the order of the enum.
constexpr DtypeInfo kDtypes[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
                                 {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
                                 {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
static_assert(sizeof(kDtypes) / sizeof(kDtypes[0]) == static_cast<std::size_t>(Dtype::U64) + 1);
}  // namespace

const char* dtype_name(Dtype d) { return kDtypes[static_cast<int>(d)].name; }
std::size_t dtype_size(Dtype d) { return kDtypes[static_cast<int>(d)].size; }

bool dtype_from_name(const std::string& name, Dtype* out) {
  for (int i = 0; i <= static_cast<int>(Dtype::U64); ++i) {
    if (name == kDtypes[i].name) {
      *out = static_cast<Dtype>(i);
      return true;
    }
  }
  return false;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;  // validated on parse: fits (n * size <= file size)
  return n;
}

void TensorView::check_access(Dtype want, std::size_t align) const {
  if (dtype != want && !(want == Dtype::U8 && dtype == Dtype::BOOL)) {
    throw SafetensorsError("safetensors tensor " + quote_name(name) + " is " + dtype_name(dtype) + ", not " +
                           dtype_name(want));
  }
  if (reinterpret_cast<std::uintptr_t>(data) % align != 0) {
    throw SafetensorsError("safetensors tensor " + quote_name(name) + " is not aligned for " + dtype_name(want) +
                           " in this file; read it with bytes-level copies");
  }
}

namespace {

// The header length the file starts with, checked against the file's size,
// and the header's bytes checked for UTF-8 and NUL bytes.
uint64_t header_length(const unsigned char* bytes, std::size_t size, const std::string& source) {
  if (size < 8) fail(source, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (n > kMaxHeaderBytes) {
    fail(source, "header length " + std::to_string(n) + " exceeds the limit of " + std::to_string(kMaxHeaderBytes));
  }
  if (n > size - 8) {
    fail(source,
         "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) + " bytes)");
  }
  const unsigned char* header = bytes + 8;
  const std::size_t bad_utf8 = utf8_error_offset(header, n);
  if (bad_utf8 != n) fail(source, "header is not valid UTF-8 at byte " + std::to_string(bad_utf8));
  // nlohmann's lexer takes a NUL byte for the end of input, so "{}\0junk"
  // would parse; valid JSON never holds a raw NUL (only the escape \u0000).
  if (const void* nul = std::memchr(header, 0, n)) {
    fail(source, "header is not valid JSON: NUL byte at byte " +
                     std::to_string(static_cast<const unsigned char*>(nul) - header));
  }
  return n;
}

// Each tensor's byte size from its dtype and shape (overflow-checked),
// against its data_offsets.
void check_sizes(const std::vector<Entry>& entries, const std::string& source) {
  for (const Entry& e : entries) {
    uint64_t want = 0;
    if (!shape_bytes(e.shape, e.dtype, &want)) {
      fail(source, "tensor " + quote_name(e.name) + ": shape " + shape_string(e.shape) + " of " + dtype_name(e.dtype) +
                       " overflows 64 bits");
    }
    if (e.end < e.begin) {
      fail(source, "tensor " + quote_name(e.name) + ": data_offsets [" + std::to_string(e.begin) + ", " +
                       std::to_string(e.end) + "] end before they begin");
    }
    if (e.end - e.begin != want) {
      fail(source, "tensor " + quote_name(e.name) + ": shape " + shape_string(e.shape) + " of " + dtype_name(e.dtype) +
                       " needs " + std::to_string(want) + " bytes but data_offsets span " +
                       std::to_string(e.end - e.begin));
    }
  }
}

// The entries in data order, which must tile the data section of
// `data_len` bytes exactly.
std::vector<std::size_t> data_order(const std::vector<Entry>& entries, uint64_t data_len, const std::string& source) {
  std::vector<std::size_t> order(entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::tie(entries[a].begin, entries[a].end) < std::tie(entries[b].begin, entries[b].end);
  });
  uint64_t expected = 0;
  const Entry* previous = nullptr;
  for (const std::size_t i : order) {
    const Entry& e = entries[i];
    if (e.begin != expected) {
      const std::string what = !previous            ? "data does not start at offset 0"
                               : e.begin < expected ? "data overlaps tensor " + quote_name(previous->name)
                                                    : "gap of " + std::to_string(e.begin - expected) +
                                                          " bytes after tensor " + quote_name(previous->name);
      fail(source, "tensor " + quote_name(e.name) + ": " + what + " (data_offsets begin at " + std::to_string(e.begin) +
                       ", expected " + std::to_string(expected) + ")");
    }
    expected = e.end;
    previous = &e;
  }
  if (expected < data_len) {
    fail(source, std::to_string(data_len - expected) + " trailing bytes after the last tensor (data section is " +
                     std::to_string(data_len) + " bytes, tensors end at " + std::to_string(expected) + ")");
  }
  if (expected > data_len) {
    fail(source, "tensors end at data offset " + std::to_string(expected) + " but the data section is only " +
                     std::to_string(data_len) + " bytes (truncated file?)");
  }
  return order;
}

}  // namespace

SafetensorsView SafetensorsView::parse(const void* data, std::size_t size, const std::string& source) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const uint64_t n = header_length(bytes, size, source);
  const unsigned char* header = bytes + 8;

  SafetensorsView view;
  view.source_ = source;
  std::vector<Entry> entries;
  HeaderSax sax(source, &entries, &view.index_, &view.metadata_);
  const char* text = reinterpret_cast<const char*>(header);
  nlohmann::json::sax_parse(text, text + n, &sax, nlohmann::json::input_format_t::json, /*strict=*/true);
  if (!sax.done()) fail(source, "header is not a complete JSON object");

  // Sizes first (overflow-checked), then the tiling of the data section.
  const uint64_t data_len = size - 8 - n;
  check_sizes(entries, source);
  const std::vector<std::size_t> order = data_order(entries, data_len, source);

  // Everything is in bounds: form the views, in data order.
  const unsigned char* base = header + n;
  view.tensors_.reserve(entries.size());
  for (const std::size_t i : order) {
    Entry& e = entries[i];
    view.index_[e.name] = view.tensors_.size();  // header position -> data position
    view.tensors_.push_back(TensorView{std::move(e.name), e.dtype, std::move(e.shape), base + e.begin,
                                       static_cast<std::size_t>(e.end - e.begin)});
  }
  return view;
}

const TensorView* SafetensorsView::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorView& SafetensorsView::at(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail(source_, "no tensor named " + quote_name(name));
  return *t;
}

// --- the mapped file ---

SafetensorsFile::SafetensorsFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, errno == ENOENT ? std::string("no such file") : "cannot open: " + os_error(errno));
  struct stat st {};
  const int stat_rc = ::fstat(fd, &st);
  const int stat_errno = errno;
  if (stat_rc != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, stat_rc != 0 ? "cannot stat: " + os_error(stat_errno) : std::string("not a regular file"));
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    const unsigned char none[8] = {};
    SafetensorsView::parse(none, size, path);  // throws the "too short" error
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file open
  if (map == MAP_FAILED) fail(path, "mmap failed: " + os_error(map_errno));
  map_ = map;
  map_bytes_ = size;
  try {
    view_ = SafetensorsView::parse(map_, map_bytes_, path);
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      view_(std::move(other.view_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    view_ = std::move(other.view_);
  }
  return *this;
}

bool SafetensorsFile::contains(const unsigned char* p, std::size_t n) const noexcept {
  const auto* begin = static_cast<const unsigned char*>(map_);
  return map_ != nullptr && p >= begin && n <= map_bytes_ && static_cast<std::size_t>(p - begin) <= map_bytes_ - n;
}

void SafetensorsFile::release(const unsigned char* p, std::size_t n) const noexcept {
  if (n == 0 || !contains(p, n)) return;
  // Whole pages only, rounded outwards: a page shared with a neighbouring
  // tensor is dropped too and simply read again if that tensor is read.
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = reinterpret_cast<std::uintptr_t>(p) / page * page;
  const auto hi = (reinterpret_cast<std::uintptr_t>(p) + n + page - 1) / page * page;
  const auto map_lo = reinterpret_cast<std::uintptr_t>(map_);
  const auto map_hi = (map_lo + map_bytes_ + page - 1) / page * page;
  // madvise takes the page-aligned address computed above.
  ::madvise(reinterpret_cast<void*>(std::max(lo, map_lo)),  // NOLINT(performance-no-int-to-ptr)
            std::min(hi, map_hi) - std::max(lo, map_lo), MADV_DONTNEED);
}

void SafetensorsFile::unmap() noexcept {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

}  // namespace scaletrain::checkpoint

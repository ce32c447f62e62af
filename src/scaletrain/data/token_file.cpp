#include "scaletrain/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>
#include <utility>

#include "scaletrain/util/error.h"
#include "scaletrain/util/posix_file.h"

// The tokens are mapped and handed out as uint16_t/uint32_t without byte swapping; the
// format is little-endian (Note [Token file layout]), so a big-endian host would
// read garbage. Fail the build there rather than at training time.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "scaletrain token files assume a little-endian host"
#endif

namespace scaletrain::data {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw UsageError("token file " + path + ": " + problem);
}

std::string os_error(int err) { return std::strerror(err); }

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

void write_all(int fd, const void* buf, std::size_t n, const std::string& path) {
  if (const int err = util::write_all(fd, buf, n)) fail(path, "write failed: " + os_error(err));
}

}  // namespace

namespace {

uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// The sections a version 2 file carries after its tokens (Note [Token file records]).
std::vector<unsigned char> record_sections(const TokenRecords& r, uint64_t data_end) {
  std::vector<unsigned char> out(align8(data_end) - data_end, 0);
  std::vector<unsigned char> mask((r.tokens.size() + 7) / 8, 0);
  for (std::size_t i = 0; i < r.target.size(); ++i)
    if (r.target[i] != 0) mask[i >> 3] = static_cast<unsigned char>(mask[i >> 3] | (1u << (i & 7)));
  out.insert(out.end(), mask.begin(), mask.end());
  out.resize(align8(data_end + out.size()) - data_end, 0);
  unsigned char word[8];
  put_u64(word, r.documents());
  out.insert(out.end(), word, word + 8);
  for (uint64_t o : r.doc_offsets) {
    put_u64(word, o);
    out.insert(out.end(), word, word + 8);
  }
  return out;
}

// Writes header + `bytes` of token data (already checked) atomically (Note
// [Token file layout]); with `records`, as version 2 with its sections.
void write_checked(const std::string& path, const void* data, std::size_t count, uint32_t dtype, uint32_t vocab,
                   const TokenRecords* records = nullptr) {
  const std::size_t width = dtype == kDtypeUint16 ? sizeof(uint16_t) : sizeof(uint32_t);
  unsigned char header[kTokenFileHeaderBytes] = {};
  std::memcpy(header, kTokenFileMagic, sizeof(kTokenFileMagic));
  put_u32(header + 8, records ? kTokenFileVersionRecords : kTokenFileVersion);
  put_u32(header + 12, dtype);
  put_u64(header + 16, static_cast<uint64_t>(count));
  put_u32(header + 24, vocab);
  std::vector<unsigned char> sections;
  if (records) {
    put_u32(header + 28, 1u | 2u | (static_cast<uint32_t>(records->kind) << 8));
    sections = record_sections(*records, kTokenFileHeaderBytes + count * width);
  }

  // The pid in the name keeps two processes preparing the same output (e.g.
  // every rank of a job) from writing into one temp file; the last rename wins
  // and each renamed file is complete.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  util::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail(path, "cannot create " + tmp + ": " + os_error(errno));
  util::TempFileGuard guard(tmp);

  write_all(fd.get(), header, sizeof(header), path);
  write_all(fd.get(), data, count * width, path);
  write_all(fd.get(), sections.data(), sections.size(), path);
  // fsync before rename: otherwise a crash can leave the new name pointing at
  // a file whose data blocks never reached the disk.
  if (::fsync(fd.get()) != 0) fail(path, "fsync failed: " + os_error(errno));
  if (fd.release_and_close() != 0) fail(path, "close failed: " + os_error(errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    fail(path, "cannot rename " + tmp + " into place: " + os_error(errno));
  }
  guard.commit();
}

// Check before creating anything, so a bad call leaves no file behind.
template <typename T>
void check_tokens(const std::string& path, const T* tokens, std::size_t count, uint32_t vocab) {
  for (std::size_t i = 0; i < count; ++i) {
    if (tokens[i] >= vocab) {
      fail(path, "token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                     " is not below the vocab size " + std::to_string(vocab));
    }
  }
}

}  // namespace

void write_token_file(const std::string& path, const uint16_t* tokens, std::size_t count, uint32_t vocab) {
  if (vocab == 0 || vocab > kMaxUint16Vocab) {
    fail(path, "vocab size " + std::to_string(vocab) + " is outside [1, " + std::to_string(kMaxUint16Vocab) +
                   "] for uint16 tokens");
  }
  check_tokens(path, tokens, count, vocab);
  write_checked(path, tokens, count, kDtypeUint16, vocab);
}

void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens, uint32_t vocab) {
  write_token_file(path, tokens.data(), tokens.size(), vocab);
}

void write_token_file(const std::string& path, const uint32_t* tokens, std::size_t count, uint32_t vocab) {
  if (vocab == 0) fail(path, "vocab size 0");
  check_tokens(path, tokens, count, vocab);
  if (dtype_for_vocab(vocab) == kDtypeUint32) {
    write_checked(path, tokens, count, kDtypeUint32, vocab);
    return;
  }
  // Every id is below vocab <= 65536, so the narrowing is exact.
  std::vector<uint16_t> narrow(tokens, tokens + count);
  write_checked(path, narrow.data(), count, kDtypeUint16, vocab);
}

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens, uint32_t vocab) {
  write_token_file(path, tokens.data(), tokens.size(), vocab);
}

const char* record_kind_name(RecordKind kind) {
  switch (kind) {
    case RecordKind::Text: return "text";
    case RecordKind::PromptCompletion: return "prompt/completion";
    case RecordKind::Messages: return "messages";
  }
  return "unknown";
}

void TokenRecords::add(const std::vector<uint32_t>& ids, const std::vector<uint8_t>& targets) {
  if (ids.size() != targets.size())
    throw std::invalid_argument("TokenRecords::add: " + std::to_string(ids.size()) + " ids but " +
                                std::to_string(targets.size()) + " target flags");
  tokens.insert(tokens.end(), ids.begin(), ids.end());
  target.insert(target.end(), targets.begin(), targets.end());
  doc_offsets.push_back(tokens.size());
}

void write_token_file(const std::string& path, const TokenRecords& records, uint32_t vocab) {
  if (vocab == 0) fail(path, "vocab size 0");
  const std::size_t n = records.tokens.size();
  if (records.target.size() != n || records.doc_offsets.empty() || records.doc_offsets.front() != 0 ||
      records.doc_offsets.back() != n)
    throw std::invalid_argument("write_token_file: inconsistent TokenRecords for " + path);
  check_tokens(path, records.tokens.data(), n, vocab);
  if (dtype_for_vocab(vocab) == kDtypeUint32) {
    write_checked(path, records.tokens.data(), n, kDtypeUint32, vocab, &records);
    return;
  }
  std::vector<uint16_t> narrow(records.tokens.begin(), records.tokens.end());
  write_checked(path, narrow.data(), n, kDtypeUint16, vocab, &records);
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  util::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    fail(path, errno == ENOENT ? std::string("no such file") : "cannot open: " + os_error(errno));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, "cannot stat: " + os_error(errno));
  if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kTokenFileHeaderBytes) {
    fail(path, "truncated header (" + std::to_string(file_bytes) + " bytes, need " +
                   std::to_string(kTokenFileHeaderBytes) + ")");
  }

  // Map the whole file, header included: mmap offsets must be page-aligned,
  // and the 32-byte header keeps the tokens 2- or 4-byte aligned inside the map.
  map_bytes_ = static_cast<std::size_t>(file_bytes);
  void* map = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) fail(path, "mmap failed: " + os_error(errno));
  map_ = map;
  // From here on a throw must unmap, since the destructor of a partially
  // constructed object does not run. The descriptor stays open for
  // check_intact() and is closed by unmap().
  fd_ = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0);
  try {
    const auto* h = static_cast<const unsigned char*>(map_);
    if (std::memcmp(h, kTokenFileMagic, sizeof(kTokenFileMagic)) != 0) {
      fail(path, "bad magic (not a scaletrain token file)");
    }
    const uint32_t version = get_u32(h + 8);
    if (version != kTokenFileVersion && version != kTokenFileVersionRecords) {
      fail(path, "unsupported version " + std::to_string(version) + " (this build reads " +
                     std::to_string(kTokenFileVersion) + " and " + std::to_string(kTokenFileVersionRecords) + ")");
    }
    const uint32_t dtype = get_u32(h + 12);
    if (dtype != kDtypeUint16 && dtype != kDtypeUint32) {
      fail(path, "unsupported dtype code " + std::to_string(dtype) + " (expected " + std::to_string(kDtypeUint16) +
                     " = uint16 or " + std::to_string(kDtypeUint32) + " = uint32)");
    }
    const uint64_t width = dtype == kDtypeUint16 ? sizeof(uint16_t) : sizeof(uint32_t);
    const uint64_t count = get_u64(h + 16);
    const uint32_t vocab = get_u32(h + 24);
    if (vocab == 0 || (dtype == kDtypeUint16 && vocab > kMaxUint16Vocab)) {
      fail(path, "vocab size " + std::to_string(vocab) + " is outside [1, " + std::to_string(kMaxUint16Vocab) +
                     "] for uint16 tokens");
    }
    const uint64_t data_bytes = file_bytes - kTokenFileHeaderBytes;
    // Compare in token units so a huge corrupt count cannot overflow width*count.
    if (count > data_bytes / width) {
      fail(path, "truncated: header says " + std::to_string(count) + " tokens but only " + std::to_string(data_bytes) +
                     " data bytes follow");
    }
    if (version == kTokenFileVersionRecords) {
      open_sections(h, file_bytes, kTokenFileHeaderBytes + count * width);
    } else if (data_bytes != count * width) {
      fail(path, "size mismatch: header says " + std::to_string(count) + " tokens (" +
                     std::to_string(count * width) + " bytes) but " + std::to_string(data_bytes) +
                     " data bytes follow");
    }
    count_ = static_cast<std::size_t>(count);
    vocab_ = vocab;
    dtype_ = dtype;
    tokens_ = h + kTokenFileHeaderBytes;
  } catch (...) {
    unmap();
    throw;
  }
}

// The mask and the document index of a version 2 file (Note [Token file records]).
void TokenFile::open_sections(const unsigned char* h, uint64_t file_bytes, uint64_t data_end) {
  const uint32_t flags = get_u32(h + 28);
  if ((flags & ~0xFF03u) != 0 || (flags & 2u) == 0)
    fail(path_, "version 2 header flags " + std::to_string(flags) + " are not ones this build writes");
  const uint32_t kind = (flags >> 8) & 0xFF;
  if (kind > static_cast<uint32_t>(RecordKind::Messages)) fail(path_, "unknown record kind " + std::to_string(kind));
  const uint64_t count = get_u64(h + 16);
  uint64_t at = align8(data_end);
  if (flags & 1u) {
    if (at + (count + 7) / 8 > file_bytes) fail(path_, "truncated in its target mask");
    mask_ = h + at;
    at = align8(at + (count + 7) / 8);
  }
  if (at + 8 > file_bytes) fail(path_, "truncated before its document index");
  const uint64_t docs = get_u64(h + at);
  if (docs > (file_bytes - at - 8) / 8 || file_bytes != at + 8 + 8 * (docs + 1))
    fail(path_, "size mismatch: " + std::to_string(file_bytes) + " bytes, but the header and a document index of " +
                    std::to_string(docs) + " documents need " + std::to_string(at + 8 + 8 * (docs + 1)));
  docs_ = reinterpret_cast<const uint64_t*>(h + at + 8);
  if (docs_[0] != 0 || docs_[docs] != count)
    fail(path_, "document index does not cover the " + std::to_string(count) + " tokens");
  for (uint64_t d = 0; d < docs; ++d)
    if (docs_[d + 1] < docs_[d]) fail(path_, "document " + std::to_string(d) + " ends before it starts");
  num_docs_ = static_cast<std::size_t>(docs);
  kind_ = static_cast<RecordKind>(kind);
}

TokenFile::~TokenFile() { unmap(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      count_(std::exchange(other.count_, 0)),
      vocab_(std::exchange(other.vocab_, 0)),
      dtype_(other.dtype_),
      mask_(std::exchange(other.mask_, nullptr)),
      docs_(std::exchange(other.docs_, nullptr)),
      num_docs_(std::exchange(other.num_docs_, 0)),
      kind_(other.kind_) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
    tokens_ = std::exchange(other.tokens_, nullptr);
    count_ = std::exchange(other.count_, 0);
    vocab_ = std::exchange(other.vocab_, 0);
    dtype_ = other.dtype_;
    mask_ = std::exchange(other.mask_, nullptr);
    docs_ = std::exchange(other.docs_, nullptr);
    num_docs_ = std::exchange(other.num_docs_, 0);
    kind_ = other.kind_;
  }
  return *this;
}

void TokenFile::check_intact() const {
  struct stat st {};
  if (fd_ < 0 || ::fstat(fd_, &st) != 0) return;
  if (static_cast<uint64_t>(st.st_size) < map_bytes_)
    fail(path_, "truncated to " + std::to_string(st.st_size) + " bytes while in use (it had " +
                    std::to_string(map_bytes_) + " when opened); stopped before reading past its end");
}

void TokenFile::unmap() noexcept {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  mask_ = nullptr;
  docs_ = nullptr;
}

}  // namespace scaletrain::data

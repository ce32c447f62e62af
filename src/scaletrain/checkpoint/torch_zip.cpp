#include "scaletrain/checkpoint/torch_zip.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "scaletrain/util/posix_file.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "scaletrain's PyTorch file I/O assumes a little-endian host"
#endif

namespace scaletrain::checkpoint {

void torch_file_fail(const std::string& source, const std::string& problem) {
  throw TorchFileError("torch file " + source + ": " + problem);
}

namespace {

constexpr uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50, kLocator64Sig = 0x07064b50;
constexpr std::size_t kLocalBytes = 30, kCentralBytes = 46, kEndBytes = 22;
constexpr std::size_t kLocatorBytes = 20, kEnd64Bytes = 56, kAlign = 64;

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Bounds-checked reads from the archive's bytes.
struct Reader {
  const unsigned char* base;
  std::size_t size;
  const std::string& source;
  bool fits(uint64_t off, uint64_t n) const { return off <= size && n <= size - off; }
  const unsigned char* at(uint64_t off, uint64_t n, const char* what) const {
    if (!fits(off, n)) torch_file_fail(source, std::string(what) + " lies past the end of the file (truncated?)");
    return base + off;
  }
};

struct EndRecord {
  uint64_t count = 0, dir_size = 0, dir_offset = 0;
};

EndRecord find_end(const Reader& r) {
  if (r.size < kEndBytes) torch_file_fail(r.source, "not a zip archive (shorter than its end record)");
  const std::size_t lowest = r.size > kEndBytes + 65535 ? r.size - kEndBytes - 65535 : 0;
  for (std::size_t pos = r.size - kEndBytes + 1; pos-- > lowest;) {
    const unsigned char* p = r.base + pos;
    if (le(p, 4) != kEndSig || pos + kEndBytes + le(p + 20, 2) != r.size) continue;
    EndRecord end{le(p + 10, 2), le(p + 12, 4), le(p + 16, 4)};
    if (end.count != 0xffff && end.dir_size != 0xffffffff && end.dir_offset != 0xffffffff) return end;
    if (pos < kLocatorBytes || le(p - kLocatorBytes, 4) != kLocator64Sig)
      torch_file_fail(r.source, "zip end record needs ZIP64 values but has no ZIP64 locator");
    const unsigned char* rec = r.at(le(p - kLocatorBytes + 8, 8), kEnd64Bytes, "the ZIP64 end record");
    if (le(rec, 4) != kEnd64Sig) torch_file_fail(r.source, "the ZIP64 locator points at no ZIP64 end record");
    return EndRecord{le(rec + 32, 8), le(rec + 40, 8), le(rec + 48, 8)};
  }
  torch_file_fail(r.source, "not a zip archive (no end of central directory record)");
}

// Sizes and offset of one central entry, widened by its ZIP64 extra field.
struct Sizes {
  uint64_t stored, original, local;
};

Sizes widen(const Reader& r, const unsigned char* extra, std::size_t n, Sizes s, const std::string& name) {
  for (std::size_t i = 0; i + 4 <= n;) {
    const uint64_t id = le(extra + i, 2), len = le(extra + i + 2, 2);
    if (i + 4 + len > n) torch_file_fail(r.source, "entry '" + name + "': extra field overruns its header");
    if (id == 0x0001) {
      const unsigned char* f = extra + i + 4;
      std::size_t used = 0;
      for (uint64_t* v : {&s.original, &s.stored, &s.local}) {
        if (*v != 0xffffffff) continue;
        if (used + 8 > len) torch_file_fail(r.source, "entry '" + name + "': ZIP64 field too short");
        *v = le(f + used, 8);
        used += 8;
      }
    }
    i += 4 + len;
  }
  return s;
}

uint32_t crc_of(const void* data, std::size_t size) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  for (std::size_t left = size; left > 0;) {
    const auto n = static_cast<uInt>(std::min<std::size_t>(left, 1u << 30));
    crc = ::crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

ZipEntry read_entry(const Reader& r, uint64_t* pos) {
  const unsigned char* c = r.at(*pos, kCentralBytes, "a central directory entry");
  if (le(c, 4) != kCentralSig) torch_file_fail(r.source, "central directory entry has a bad signature");
  const uint64_t name_len = le(c + 28, 2), extra_len = le(c + 30, 2), comment_len = le(c + 32, 2);
  const unsigned char* var = r.at(*pos + kCentralBytes, name_len + extra_len + comment_len, "a central entry's name");
  ZipEntry e;
  e.name.assign(reinterpret_cast<const char*>(var), name_len);
  *pos += kCentralBytes + name_len + extra_len + comment_len;
  if (le(c + 8, 2) & 1) torch_file_fail(r.source, "entry '" + e.name + "' is encrypted");
  if (le(c + 10, 2) != 0)
    torch_file_fail(r.source, "entry '" + e.name + "' is compressed (method " + std::to_string(le(c + 10, 2)) +
                                  "); torch.save stores entries uncompressed");
  const Sizes s = widen(r, var + name_len, extra_len, Sizes{le(c + 20, 4), le(c + 24, 4), le(c + 42, 4)}, e.name);
  if (s.stored != s.original) torch_file_fail(r.source, "entry '" + e.name + "': stored and original sizes differ");
  const unsigned char* l = r.at(s.local, kLocalBytes, ("the local header of '" + e.name + "'").c_str());
  if (le(l, 4) != kLocalSig) torch_file_fail(r.source, "entry '" + e.name + "': bad local header signature");
  const uint64_t begin = s.local + kLocalBytes + le(l + 26, 2) + le(l + 28, 2);
  e.data = r.at(begin, s.stored, ("the data of '" + e.name + "'").c_str());
  e.size = static_cast<std::size_t>(s.stored);
  e.crc32 = static_cast<uint32_t>(le(c + 16, 4));
  return e;
}

}  // namespace

ZipView ZipView::parse(const void* data, std::size_t size, const std::string& source) {
  ZipView z;
  z.source_ = source;
  const Reader r{static_cast<const unsigned char*>(data), size, z.source_};
  const EndRecord end = find_end(r);
  r.at(end.dir_offset, end.dir_size, "the central directory");
  if (end.count > end.dir_size / kCentralBytes)
    torch_file_fail(source, "zip end record claims more entries than its central directory holds");
  uint64_t pos = end.dir_offset;
  for (uint64_t i = 0; i < end.count; ++i) {
    ZipEntry e = read_entry(r, &pos);
    if (pos > end.dir_offset + end.dir_size) torch_file_fail(source, "central directory overruns its stated size");
    if (!z.index_.emplace(e.name, z.entries_.size()).second)
      torch_file_fail(source, "entry '" + e.name + "' appears twice");
    z.entries_.push_back(std::move(e));
  }
  return z;
}

const ZipEntry* ZipView::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void ZipView::check_crc(const ZipEntry& entry) const {
  if (crc_of(entry.data, entry.size) != entry.crc32)
    torch_file_fail(source_, "entry '" + entry.name + "' fails its CRC-32 check (corrupt file)");
}

namespace {

void put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// One central directory record (with a ZIP64 extra field when needed).
void central(std::string& dir, const ZipRecord& rec, uint32_t crc, uint64_t local) {
  const bool big = rec.size >= 0xffffffff || local >= 0xffffffff;
  std::string extra;
  if (big) {
    put(extra, 0x0001, 2);
    put(extra, 24, 2);
    put(extra, rec.size, 8);
    put(extra, rec.size, 8);
    put(extra, local, 8);
  }
  put(dir, kCentralSig, 4);
  put(dir, big ? 45 : 20, 2);  // made by
  put(dir, big ? 45 : 20, 2);  // needed
  put(dir, 0, 2);              // flags
  put(dir, 0, 2);              // stored
  put(dir, 0, 4);              // time, date
  put(dir, crc, 4);
  put(dir, big ? 0xffffffff : rec.size, 4);
  put(dir, big ? 0xffffffff : rec.size, 4);
  put(dir, rec.name.size(), 2);
  put(dir, extra.size(), 2);
  put(dir, 0, 6);  // comment length, disk, internal attributes
  put(dir, 0, 4);  // external attributes
  put(dir, big ? 0xffffffff : local, 4);
  dir += rec.name;
  dir += extra;
}

}  // namespace

std::string serialize_zip(const std::vector<ZipRecord>& records) {
  std::string out, dir;
  for (const ZipRecord& rec : records) {
    if (rec.name.empty() || rec.name.size() > 0xffff) torch_file_fail("<write>", "bad zip entry name");
    const uint64_t local = out.size();
    const uint32_t crc = crc_of(rec.data, rec.size);
    const bool big = rec.size >= 0xffffffff;
    const std::size_t fixed = local + kLocalBytes + rec.name.size() + 4 + (big ? 20 : 0);
    const std::size_t pad = (kAlign - fixed % kAlign) % kAlign;
    put(out, kLocalSig, 4);
    put(out, big ? 45 : 20, 2);
    put(out, 0, 2);
    put(out, 0, 2);
    put(out, 0, 4);
    put(out, crc, 4);
    put(out, big ? 0xffffffff : rec.size, 4);
    put(out, big ? 0xffffffff : rec.size, 4);
    put(out, rec.name.size(), 2);
    put(out, 4 + (big ? 20 : 0) + pad, 2);
    out += rec.name;
    if (big) {
      put(out, 0x0001, 2);
      put(out, 16, 2);
      put(out, rec.size, 8);
      put(out, rec.size, 8);
    }
    put(out, 0x4246, 2);  // a private extra field holding the alignment padding
    put(out, pad, 2);
    out.append(pad, 'Z');
    out.append(static_cast<const char*>(rec.data), rec.size);
    central(dir, rec, crc, local);
  }
  const uint64_t dir_offset = out.size(), count = records.size();
  out += dir;
  const bool big = count >= 0xffff || dir_offset >= 0xffffffff || dir.size() >= 0xffffffff;
  if (big) {
    const uint64_t end64 = out.size();
    put(out, kEnd64Sig, 4);
    put(out, kEnd64Bytes - 12, 8);
    put(out, 45, 2);
    put(out, 45, 2);
    put(out, 0, 8);  // disk numbers
    put(out, count, 8);
    put(out, count, 8);
    put(out, dir.size(), 8);
    put(out, dir_offset, 8);
    put(out, kLocator64Sig, 4);
    put(out, 0, 4);
    put(out, end64, 8);
    put(out, 1, 4);
  }
  put(out, kEndSig, 4);
  put(out, 0, 4);
  put(out, big ? 0xffff : count, 2);
  put(out, big ? 0xffff : count, 2);
  put(out, big ? 0xffffffff : dir.size(), 4);
  put(out, big ? 0xffffffff : dir_offset, 4);
  put(out, 0, 2);
  return out;
}

void write_zip(const std::string& path, const std::vector<ZipRecord>& records) {
  const std::string bytes = serialize_zip(records);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  util::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) torch_file_fail(path, std::string("cannot create: ") + std::strerror(errno));
  util::TempFileGuard guard(tmp);
  int err = util::write_all(fd.get(), bytes.data(), bytes.size());
  if (err == 0 && ::fsync(fd.get()) != 0) err = errno;
  if (err == 0 && fd.release_and_close() != 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) torch_file_fail(path, std::string("cannot write: ") + std::strerror(err));
  guard.commit();
}

}  // namespace scaletrain::checkpoint

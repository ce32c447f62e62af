// A directory of token shards and its index (token_shards.h).
#include "scaletrain/data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>

#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"
#include "scaletrain/util/posix_file.h"

namespace scaletrain::data {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "scaletrain token shards";

[[noreturn]] void fail(const std::string& dir, const std::string& problem) {
  throw UsageError("token shards " + dir + ": " + problem);
}

// CRC-32 (zlib's) of a whole file, read by mapping it.
uint32_t file_crc32(const std::string& path, uint64_t bytes) {
  util::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw UsageError("cannot open " + path + ": " + std::strerror(errno));
  if (bytes == 0) return static_cast<uint32_t>(crc32(0L, Z_NULL, 0));
  void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) throw UsageError("cannot map " + path + ": " + std::strerror(errno));
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(map);
  for (uint64_t at = 0; at < bytes;) {
    const uint64_t n = std::min<uint64_t>(bytes - at, 1u << 30);
    crc = crc32(crc, p + at, static_cast<uInt>(n));
    at += n;
  }
  ::munmap(map, bytes);
  return static_cast<uint32_t>(crc);
}

// Writes `text` to `path` by a temp file renamed into place (after fsync).
void write_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  util::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw UsageError("cannot create " + tmp + ": " + std::strerror(errno));
  util::TempFileGuard guard(tmp);
  if (const int err = util::write_all(fd.get(), text.data(), text.size()))
    throw UsageError("cannot write " + tmp + ": " + std::strerror(err));
  if (::fsync(fd.get()) != 0 || fd.release_and_close() != 0)
    throw UsageError("cannot flush " + tmp + ": " + std::strerror(errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    throw UsageError("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
  guard.commit();
}

// Documents [first, last) of `r` as a TokenRecords of their own.
TokenRecords slice(const TokenRecords& r, std::size_t first, std::size_t last) {
  TokenRecords out;
  out.kind = r.kind;
  const uint64_t b = r.doc_offsets[first], e = r.doc_offsets[last];
  out.tokens.assign(r.tokens.begin() + static_cast<std::ptrdiff_t>(b),
                    r.tokens.begin() + static_cast<std::ptrdiff_t>(e));
  out.target.assign(r.target.begin() + static_cast<std::ptrdiff_t>(b),
                    r.target.begin() + static_cast<std::ptrdiff_t>(e));
  for (std::size_t d = first + 1; d <= last; ++d) out.doc_offsets.push_back(r.doc_offsets[d] - b);
  return out;
}

const nlohmann::json& field(const nlohmann::json& j, const char* key, const std::string& dir, const std::string& what) {
  const auto it = j.find(key);
  if (it == j.end()) fail(dir, what + " has no \"" + key + "\"");
  return *it;
}

uint64_t count(const nlohmann::json& j, const char* key, const std::string& dir, const std::string& what) {
  const auto& v = field(j, key, dir, what);
  if (!v.is_number_unsigned()) fail(dir, what + ": \"" + key + "\" is not a count");
  return v.get<uint64_t>();
}

// A shard file the index does not list would be left out of training without
// a word (a shard copied in by hand, an index from an older prepare): refused.
void check_no_unlisted_shards(const std::string& dir, const nlohmann::json& list) {
  std::set<std::string> listed;
  for (const auto& entry : list)
    if (entry.is_object() && entry.contains("file") && entry["file"].is_string())
      listed.insert(entry["file"].get<std::string>());
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() == ".tok" && !listed.count(name))
      fail(dir, name + " is not listed in index.json (remove it, or prepare the directory again)");
  }
}

// Opens one shard the index names and checks it against its entry.
TokenFile open_shard(const std::string& dir, const nlohmann::json& entry, std::size_t i, uint32_t vocab,
                     const std::string& kind) {
  const std::string what = "shard " + std::to_string(i);
  const auto& name = field(entry, "file", dir, what);
  if (!name.is_string() || name.get<std::string>().find('/') != std::string::npos)
    fail(dir, what + ": \"file\" must be a file name in the directory");
  const std::string path = (fs::path(dir) / name.get<std::string>()).string();
  std::error_code ec;
  const auto bytes = fs::file_size(path, ec);
  if (ec) fail(dir, name.get<std::string>() + " is missing (" + ec.message() + ")");
  if (bytes != count(entry, "bytes", dir, what))
    fail(dir, name.get<std::string>() + " has " + std::to_string(bytes) + " bytes, the index says " +
                  std::to_string(count(entry, "bytes", dir, what)));
  if (file_crc32(path, bytes) != count(entry, "crc32", dir, what))
    fail(dir, name.get<std::string>() + " does not match its checksum in the index (damaged or replaced)");
  TokenFile f(path);
  if (f.vocab() != vocab || f.size() != count(entry, "tokens", dir, what) ||
      f.documents() != count(entry, "documents", dir, what) || !f.has_documents() || record_kind_name(f.kind()) != kind)
    fail(dir, name.get<std::string>() + " does not hold what the index says (vocab, tokens, documents or kind)");
  return f;
}

}  // namespace

std::size_t write_token_shards(const std::string& dir, const TokenRecords& records, uint32_t vocab,
                               uint64_t shard_tokens) {
  if (shard_tokens < 1) fail(dir, "shard size must be at least 1 token");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(dir, "cannot create the directory: " + ec.message());
  const std::string index_path = (fs::path(dir) / kShardIndexName).string();
  fs::remove(index_path, ec);  // the old index must not outlive the shards it named
  // Nor its shards the new one: a reader refuses shard files its index does not list.
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".tok" && e.path().filename().string().rfind("shard-", 0) == 0)
      fs::remove(e.path(), ec);
  nlohmann::json shards = nlohmann::json::array();
  for (std::size_t first = 0; first < records.documents();) {
    std::size_t last = first + 1;
    while (last < records.documents() && records.doc_offsets[last + 1] - records.doc_offsets[first] <= shard_tokens)
      ++last;
    char name[32];
    std::snprintf(name, sizeof name, "shard-%05zu.tok", shards.size());
    const std::string path = (fs::path(dir) / name).string();
    const TokenRecords part = slice(records, first, last);
    write_token_file(path, part, vocab);
    const auto bytes = fs::file_size(path);
    shards.push_back({{"file", name},
                      {"bytes", bytes},
                      {"tokens", part.tokens.size()},
                      {"documents", part.documents()},
                      {"crc32", file_crc32(path, bytes)}});
    first = last;
  }
  const nlohmann::json index = {{"format", kFormat},
                                {"version", 1},
                                {"vocab", vocab},
                                {"kind", record_kind_name(records.kind)},
                                {"tokens", records.tokens.size()},
                                {"documents", records.documents()},
                                {"shards", shards}};
  write_atomically(index_path, index.dump(1) + "\n");
  return shards.size();
}

bool is_token_shard_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / kShardIndexName, ec);
}

std::vector<TokenFile> open_token_shards(const std::string& dir) {
  const std::string index_path = (fs::path(dir) / kShardIndexName).string();
  std::error_code ec;
  if (!fs::exists(index_path, ec))
    fail(dir, "no index.json (not a prepared shard directory, or its prepare did not finish)");
  const nlohmann::json index = util::read_json_file(index_path, "token shards " + index_path);
  if (!index.is_object() || index.value("format", "") != kFormat || index.value("version", 0) != 1)
    fail(dir, "index.json is not a version 1 shard index");
  const uint64_t vocab = count(index, "vocab", dir, "index.json");
  const auto& kind = field(index, "kind", dir, "index.json");
  const auto& list = field(index, "shards", dir, "index.json");
  if (!kind.is_string() || !list.is_array() || list.empty() || vocab == 0 || vocab > UINT32_MAX)
    fail(dir, "index.json: \"kind\", \"vocab\" or \"shards\" is malformed");
  check_no_unlisted_shards(dir, list);
  std::vector<TokenFile> files;
  uint64_t tokens = 0, documents = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    files.push_back(open_shard(dir, list[i], i, static_cast<uint32_t>(vocab), kind.get<std::string>()));
    tokens += files.back().size();
    documents += files.back().documents();
  }
  if (tokens != count(index, "tokens", dir, "index.json") || documents != count(index, "documents", dir, "index.json"))
    fail(dir, "the shards hold " + std::to_string(tokens) + " tokens in " + std::to_string(documents) +
                  " documents, not the index's totals");
  return files;
}

}  // namespace scaletrain::data

#include "scaletrain/checkpoint/index.h"

#include "scaletrain/util/posix_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

namespace scaletrain::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A file an index may name: a relative path of at most two plain components
// ("rank-00000.safetensors", "tokenizer/tokenizer.json"), never one that
// leaves the step directory ("..", an absolute path) or hides in it (".").
bool plain_name(const std::string& name) {
  if (name.empty() || name.front() == '/' || name.find('\\') != std::string::npos ||
      name.find('\0') != std::string::npos)
    return false;
  int parts = 0;
  std::stringstream ss(name);
  for (std::string part; std::getline(ss, part, '/');) {
    if (part.empty() || part == "." || part == "..") return false;
    ++parts;
  }
  return parts >= 1 && parts <= 2 && name.back() != '/';
}

constexpr const char* kFormat = "scaletrain-checkpoint";
constexpr const char* kIndexName = "index.json";
constexpr const char* kStepPrefix = "step-";

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw UsageError("checkpoint " + source + ": " + what);
}

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw UsageError("checkpoint " + path + ": cannot open for fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw UsageError("checkpoint " + path + ": fsync failed: " + std::strerror(errno));
}

// Step number of a "step-000100" directory name, or -1.
int64_t step_of(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() == std::strlen(kStepPrefix)) return -1;
  const std::string digits = name.substr(std::strlen(kStepPrefix));
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return -1;
  return std::stoll(digits);
}

// Step directories under root, by step, with whether each is complete.
std::vector<std::pair<int64_t, fs::path>> step_dirs(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t s = step_of(e.path().filename().string());
    if (s >= 0 && e.is_directory()) out.emplace_back(s, e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool complete(const fs::path& dir) { return fs::is_regular_file(dir / kIndexName); }

// Note [Index checksum]: index.json carries the CRC-32 of its own content
// (every other key), so an edited or damaged index (optimizer_steps 20 -> 2,
// a world size) is refused, and resume=auto passes over it, instead of being
// trusted. Every index this version writes has one, so a missing checksum is
// an error too: deleting the key must not turn the check off. Indexes written
// before checksums existed are read only when the user says so with
// SCALETRAIN_ACCEPT_UNCHECKED_INDEX=1; their fields are still checked one by one.
void check_index_crc(json& j, const std::string& source) {
  const auto it = j.find("index_crc32");
  if (it == j.end()) {
    const char* accept = std::getenv("SCALETRAIN_ACCEPT_UNCHECKED_INDEX");
    if (accept && std::string(accept) == "1") return;
    fail(source,
         "the index has no index_crc32 checksum (edited, or written before checksums: "
         "SCALETRAIN_ACCEPT_UNCHECKED_INDEX=1 reads such an index)");
  }
  if (!it->is_number_unsigned()) fail(source, "index_crc32 is not a checksum");
  const uint32_t want = it->get<uint32_t>();
  j.erase(it);
  const std::string body = j.dump(1);
  if (crc32_update(0, body.data(), body.size()) != want)
    fail(source, "the index does not match its checksum (edited or damaged after it was written)");
}

// Every field a resume relies on, within its range.
void check_fields(const Index& x, const std::string& source) {
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) fail(source, what);
  };
  need(x.step >= 0, "step " + std::to_string(x.step) + " is negative");
  need(x.world_size >= 1, "world_size " + std::to_string(x.world_size) + " is not a positive count of ranks");
  need(x.state.step == x.step,
       "state.step " + std::to_string(x.state.step) + " differs from step " + std::to_string(x.step));
  need(x.state.optimizer_steps >= 0 && x.state.optimizer_steps <= x.state.step,
       "state.optimizer_steps " + std::to_string(x.state.optimizer_steps) + " is not within [0, step " +
           std::to_string(x.state.step) + "]");
  const ModelShape& m = x.model;
  for (auto [name, v] : {std::pair<const char*, int64_t>{"vocab_size", m.vocab_size},
                         {"block_size", m.block_size},
                         {"n_layer", m.n_layer},
                         {"n_head", m.n_head},
                         {"n_embd", m.n_embd}})
    need(v >= 0, std::string("model.") + name + " " + std::to_string(v) + " is negative");  // 0: not a model of ours
  for (const auto& [k, v] : x.state.loss_scaler) need(std::isfinite(v), "state.loss_scaler." + k + " is not finite");
  for (double v : x.state.fp8_scaling) need(std::isfinite(v), "state.fp8_scaling holds a value that is not finite");
  need(x.state.rng_cpu.size() % 2 == 0 && x.state.rng_cpu.find_first_not_of("0123456789abcdef") == std::string::npos,
       "state.rng_cpu is not a hex string");
  for (const auto& f : x.files) {
    need(f.rank >= 0 && f.rank < x.world_size, "file " + f.name + " has rank " + std::to_string(f.rank) +
                                                   ", outside world_size " + std::to_string(x.world_size));
    need(f.bytes >= 0, "file " + f.name + " has a negative size");
  }
  for (const auto& [name, t] : x.tensors) {
    Dtype dt = Dtype::F32;
    need(dtype_from_name(t.dtype, &dt), "tensor " + name + " has an unknown dtype '" + t.dtype + "'");
    for (const auto& p : t.pieces) need(!p.key.empty(), "a piece of tensor " + name + " has no key");
  }
}

}  // namespace

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string index_to_json(const Index& x) {
  json j;
  j["format"] = kFormat;
  j["version"] = x.version;
  j["step"] = x.step;
  j["world_size"] = x.world_size;
  j["strategy"] = x.strategy;
  j["mesh"] = x.mesh;
  j["model"] = {{"vocab_size", x.model.vocab_size}, {"block_size", x.model.block_size}, {"n_layer", x.model.n_layer},
                {"n_head", x.model.n_head},         {"n_embd", x.model.n_embd},         {"bias", x.model.bias},
                {"family", x.model.family}};
  if (!x.model.hf_config.empty()) j["model"]["hf_config"] = json::parse(x.model.hf_config);
  if (!x.model.finetune.empty()) j["model"]["finetune"] = json::parse(x.model.finetune);
  j["state"] = {{"step", x.state.step},
                {"optimizer_steps", x.state.optimizer_steps},
                {"loss_scaler", x.state.loss_scaler},
                {"rng_cpu", x.state.rng_cpu}};
  if (!x.state.fp8_scaling.empty()) j["state"]["fp8_scaling"] = x.state.fp8_scaling;
  json files = json::array();
  for (const auto& f : x.files)
    files.push_back({{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"crc32", f.crc32}});
  j["files"] = files;
  json tensors = json::object();
  for (const auto& [name, t] : x.tensors) {
    json pieces = json::array();
    for (const auto& p : t.pieces)
      pieces.push_back({{"file", p.file}, {"key", p.key}, {"begin", p.begin}, {"numel", p.numel}, {"crc32", p.crc32}});
    tensors[name] = {{"shape", t.shape}, {"dtype", t.dtype}, {"pieces", pieces}};
  }
  j["tensors"] = tensors;
  // Note [Index checksum]: the CRC-32 of the index without this key, as
  // dumped here (nlohmann keeps keys sorted, so the text is canonical).
  const std::string body = j.dump(1);
  j["index_crc32"] = crc32_update(0, body.data(), body.size());
  return j.dump(1);
}

Index index_from_json(const std::string& text, const std::string& source) {
  Index x;
  try {
    json j = util::parse_json(text, "checkpoint " + source);  // Note [Strict JSON]
    if (j.value("format", std::string()) != kFormat) fail(source, "not a scaletrain checkpoint index");
    check_index_crc(j, source);
    x.version = j.at("version").get<int>();
    if (x.version != kIndexVersion)
      fail(source,
           "index version " + std::to_string(x.version) + " (this build reads " + std::to_string(kIndexVersion) + ")");
    x.step = j.at("step").get<int64_t>();
    x.world_size = j.at("world_size").get<int>();
    x.strategy = j.at("strategy").get<std::string>();
    x.mesh = j.at("mesh").get<std::string>();
    const json& m = j.at("model");
    x.model = {m.at("vocab_size").get<int64_t>(), m.at("block_size").get<int64_t>(), m.at("n_layer").get<int64_t>(),
               m.at("n_head").get<int64_t>(),     m.at("n_embd").get<int64_t>(),     m.at("bias").get<bool>(),
               m.value("family", std::string())};
    if (m.contains("hf_config")) {
      if (!m["hf_config"].is_object()) fail(source, "model.hf_config is not a JSON object");
      x.model.hf_config = m["hf_config"].dump();
    }
    if (m.contains("finetune")) {
      if (!m["finetune"].is_object()) fail(source, "model.finetune is not a JSON object");
      x.model.finetune = m["finetune"].dump();
    }
    const json& s = j.at("state");
    x.state.step = s.at("step").get<int64_t>();
    x.state.optimizer_steps = s.at("optimizer_steps").get<int64_t>();
    x.state.loss_scaler = s.at("loss_scaler").get<std::map<std::string, double>>();
    x.state.rng_cpu = s.at("rng_cpu").get<std::string>();
    if (s.contains("fp8_scaling")) x.state.fp8_scaling = s.at("fp8_scaling").get<std::vector<double>>();
    for (const auto& f : j.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      if (!plain_name(name)) fail(source, "file name '" + name + "' is not a plain name inside the step directory");
      x.files.push_back({name, f.at("rank").get<int>(), f.at("bytes").get<int64_t>(), f.at("crc32").get<uint32_t>()});
    }
    for (const auto& [name, t] : j.at("tensors").items()) {
      TensorEntry e;
      e.shape = t.at("shape").get<std::vector<int64_t>>();
      e.dtype = t.at("dtype").get<std::string>();
      for (const auto& p : t.at("pieces"))
        e.pieces.push_back({p.at("file").get<int>(), p.at("key").get<std::string>(), p.at("begin").get<int64_t>(),
                            p.at("numel").get<int64_t>(), p.at("crc32").get<uint32_t>()});
      x.tensors[name] = std::move(e);
    }
  } catch (const json::exception& e) {
    fail(source, std::string("malformed index: ") + util::json_reason(e.what()));
  }
  check_fields(x, source);
  // The pieces of every tensor must tile its flattened range (Note [Checkpoint pieces]).
  for (auto& [name, t] : x.tensors) {
    for (int64_t d : t.shape)
      if (d < 0) fail(source, "tensor " + name + " has a negative dimension");
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const PieceEntry& a, const PieceEntry& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const auto& p : t.pieces) {
      if (p.file < 0 || p.file >= static_cast<int>(x.files.size()))
        fail(source, "tensor " + name + " names file #" + std::to_string(p.file) + ", which the index lacks");
      if (p.begin != next || p.numel < 0)
        fail(source, "the pieces of tensor " + name + " do not tile it (gap or overlap at element " +
                         std::to_string(next) + ")");
      next += p.numel;
    }
    if (next != t.numel())
      fail(source, "the pieces of tensor " + name + " cover " + std::to_string(next) + " of " +
                       std::to_string(t.numel()) + " elements");
  }
  return x;
}

Index read_index(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / kIndexName).string();
  std::ifstream in(path);
  if (!in) throw UsageError("checkpoint " + step_dir + " has no " + kIndexName + " (incomplete or not a checkpoint)");
  std::stringstream ss;
  ss << in.rdbuf();
  return index_from_json(ss.str(), path);
}

void write_file_durably(const std::string& path, const std::string& text) {
  auto fail = [&](const char* what) {
    throw UsageError("checkpoint " + path + ": " + what + ": " + std::strerror(errno));
  };
  const std::string tmp = path + ".tmp";
  util::Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) fail("cannot create");
  util::TempFileGuard guard(tmp);
  if (const int err = util::write_all(fd.get(), text.data(), text.size())) {
    errno = err;
    fail("write failed");
  }
  if (::fsync(fd.get()) != 0 || fd.release_and_close() != 0) fail("fsync failed");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("rename failed");
  guard.commit();
  fsync_path(fs::path(path).parent_path().string(), /*directory=*/true);
}

void write_index(const std::string& step_dir, const Index& index) {
  write_file_durably((fs::path(step_dir) / kIndexName).string(), index_to_json(index));
}

std::string step_dir(const std::string& root, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "%s%06lld", kStepPrefix, static_cast<long long>(step));
  return (fs::path(root) / name).string();
}

std::vector<std::string> complete_checkpoints(const std::string& root) {
  std::vector<std::string> out;
  for (const auto& [step, dir] : step_dirs(root))
    if (complete(dir)) out.push_back(dir.string());
  return out;
}

std::optional<std::string> newest_checkpoint(const std::string& root) {
  auto all = complete_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::vector<std::string> prune_checkpoints(const std::string& root, int keep) {
  std::vector<std::string> removed;
  const auto dirs = step_dirs(root);
  int64_t newest_complete = -1;
  int kept = 0;
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    const bool done = complete(it->second);
    if (done && newest_complete < 0) newest_complete = it->first;
    // Incomplete directories newer than the newest complete one may still be being written.
    const bool stale_incomplete = !done && newest_complete >= 0;
    const bool beyond_keep = done && keep > 0 && kept >= keep;
    if (done) ++kept;
    if (stale_incomplete || beyond_keep) {
      std::error_code ec;
      // Remove the commit marker first: a half-deleted directory is never taken for complete.
      fs::remove(it->second / kIndexName, ec);
      fs::remove_all(it->second, ec);
      removed.push_back(it->second.string());
    }
  }
  return removed;
}

uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  while (size > 0) {  // zlib takes uInt lengths
    const uInt n = static_cast<uInt>(std::min<std::size_t>(size, 1u << 30));
    c = ::crc32(c, p, n);
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32_file(const std::string& path, int64_t* bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("checkpoint file " + path + " cannot be read");
  std::vector<char> buf(1 << 22);
  uint32_t crc = 0;
  int64_t total = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    crc = crc32_update(crc, buf.data(), static_cast<std::size_t>(n));
    total += n;
  }
  if (bytes) *bytes = total;
  return crc;
}

}  // namespace scaletrain::checkpoint

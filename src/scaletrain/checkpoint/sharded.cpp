#include "scaletrain/checkpoint/sharded.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {


std::string rank_name(int rank, const char* ext) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "rank-%05d.%s", rank, ext);
  return buf;
}

// One piece to write: a 1-D tensor and where it belongs.
struct OutPiece {
  std::string tensor;  // "model/NAME"
  std::vector<int64_t> shape;
  int64_t begin = 0;
  at::Tensor data;  // 1-D, contiguous, CPU
};

std::vector<OutPiece> collect(const Layout& layout, const OptimizerState* opt, bool copy) {
  std::vector<OutPiece> out;
  for (const auto& slot : layout.slots) {
    std::vector<std::pair<std::string, at::Tensor>> sources{{"model", slot.tensor}};
    if (opt && slot.optim_index >= 0) {
      // fp32 values whatever the optimizer stores (Note [FP8 moments] in optim/adamw.h)
      const std::vector<std::string> kinds = opt->kinds();
      for (size_t k = 0; k < kinds.size(); ++k) sources.emplace_back(kinds[k], opt->value(k, slot.optim_index));
    }
    for (const auto& [kind, t] : sources) {
      at::Tensor flat = t.detach().reshape(-1);
      for (const auto& p : slot.pieces) {
        if (!p.saved) continue;
        at::Tensor d = flat.narrow(0, p.local_offset, p.numel).to(at::kCPU).contiguous();  // host: file bytes
        out.push_back({kind + "/" + p.name, p.shape, p.param_offset, copy ? d.clone() : d});
      }
    }
  }
  return out;
}

// Writes rank-R.safetensors, then its part rank-R.json (Note [Checkpoint commit]).
void write_part(const std::string& dir, int rank, const std::vector<OutPiece>& pieces) {
  std::vector<TensorRef> refs;
  json part_pieces = json::array();
  for (const auto& p : pieces) {
    const std::string key = p.tensor + "@" + std::to_string(p.begin);
    const Dtype dt = safetensors_dtype(p.data.scalar_type(), key);
    refs.push_back({key, dt, {p.data.numel()}, p.data.data_ptr(), static_cast<std::size_t>(p.data.nbytes())});
    part_pieces.push_back({{"tensor", p.tensor},
                           {"shape", p.shape},
                           {"dtype", dtype_name(dt)},
                           {"key", key},
                           {"begin", p.begin},
                           {"numel", p.data.numel()},
                           {"crc32", crc32_update(0, p.data.data_ptr(), p.data.nbytes())}});
  }
  const std::string file = rank_name(rank, "safetensors");
  const std::string path = (fs::path(dir) / file).string();
  try {
    write_safetensors(path, refs, {{"format", "scaletrain"}});
  } catch (const SafetensorsError& e) {
    throw UsageError(std::string("checkpoint: ") + e.what());
  }
  int64_t bytes = 0;
  const uint32_t crc = crc32_file(path, &bytes);  // just written: read back from the page cache
  json part = {{"file", file}, {"rank", rank}, {"bytes", bytes}, {"crc32", crc}, {"pieces", part_pieces}};
  write_file_durably((fs::path(dir) / rank_name(rank, "json")).string(), part.dump());
}

// Rank 0, after every part is durable: the index from the parts.
Index build_index(const std::string& dir, int world_size, const std::string& strategy, const std::string& mesh,
                  const SaveState& state, const std::vector<std::pair<std::string, std::string>>& assets) {
  Index x;
  x.step = state.run.step;
  x.world_size = world_size;
  x.strategy = strategy;
  x.mesh = mesh;
  x.model = state.model;
  x.state = state.run;
  for (int r = 0; r < world_size; ++r) {
    const fs::path part_path = fs::path(dir) / rank_name(r, "json");
    if (!fs::exists(part_path)) continue;  // a rank that owns nothing unique (a replica)
    std::ifstream in(part_path);
    json part = json::parse(in);
    const int file = static_cast<int>(x.files.size());
    x.files.push_back(
        {part.at("file").get<std::string>(), r, part.at("bytes").get<int64_t>(), part.at("crc32").get<uint32_t>()});
    for (const auto& p : part.at("pieces")) {
      TensorEntry& t = x.tensors[p.at("tensor").get<std::string>()];
      t.shape = p.at("shape").get<std::vector<int64_t>>();
      t.dtype = p.at("dtype").get<std::string>();
      t.pieces.push_back({file, p.at("key").get<std::string>(), p.at("begin").get<int64_t>(),
                          p.at("numel").get<int64_t>(), p.at("crc32").get<uint32_t>()});
    }
  }
  for (const auto& [name, source] : assets) {  // Note [Checkpoint assets]
    int64_t bytes = 0;
    const uint32_t crc = crc32_file((fs::path(dir) / name).string(), &bytes);
    x.files.push_back({name, 0, bytes, crc});
  }
  // Round trip through the parser: checks that the pieces tile every tensor.
  return index_from_json(index_to_json(x), (fs::path(dir) / "index.json").string());
}

// Rank 0, before the index: the run's files into the step directory
// (Note [Checkpoint assets]), durably.
void copy_assets(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& assets) {
  for (const auto& [name, source] : assets) {
    std::ifstream in(source, std::ios::binary);
    if (!in) throw UsageError("checkpoint: cannot read " + source + " to copy it into " + dir);
    std::stringstream ss;
    ss << in.rdbuf();
    const fs::path to = fs::path(dir) / name;
    std::error_code ec;
    fs::create_directories(to.parent_path(), ec);
    if (ec) throw UsageError("checkpoint: cannot create " + to.parent_path().string() + ": " + ec.message());
    write_file_durably(to.string(), ss.str());
  }
}

// Lazily opened, memory-mapped files of one checkpoint, with checked pieces.
class Reader {
 public:
  Reader(std::string dir, const Index& index) : dir_(std::move(dir)), index_(index) {}

  // Copies elements [begin, begin + out.numel()) of tensor `name` into the
  // 1-D tensor `out`, reading only the pieces that overlap.
  void copy(const std::string& name, const std::vector<int64_t>* shape, int64_t begin, at::Tensor out) {
    auto it = index_.tensors.find(name);
    if (it == index_.tensors.end()) throw UsageError("checkpoint " + dir_ + " has no tensor " + name);
    const TensorEntry& t = it->second;
    if (shape && *shape != t.shape)
      throw UsageError("checkpoint " + dir_ + ": tensor " + name + " has shape " + c10::str(t.shape) +
                       ", the model's is " + c10::str(*shape));
    const int64_t end = begin + out.numel();
    torch::NoGradGuard no_grad;
    // Pieces are sorted and tile the tensor: start at the one holding `begin`
    // (tensor-parallel checkpoints have one piece per row of a column split).
    auto first = std::partition_point(t.pieces.begin(), t.pieces.end(),
                                      [&](const PieceEntry& p) { return p.begin + p.numel <= begin; });
    for (auto it = first; it != t.pieces.end() && it->begin < end; ++it) {
      const PieceEntry& p = *it;
      const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.begin + p.numel);
      if (lo >= hi) continue;
      const TensorView& v = piece(p);
      const at::Tensor src = at::from_blob(const_cast<unsigned char*>(v.data), {p.numel},
                                           at::TensorOptions().dtype(torch_dtype(v.dtype, v.name)));
      out.narrow(0, lo - begin, hi - lo).copy_(src.narrow(0, lo - p.begin, hi - lo));
    }
  }

 private:
  const TensorView& piece(const PieceEntry& p) {
    const FileEntry& f = index_.files.at(p.file);
    const std::string path = (fs::path(dir_) / f.name).string();
    auto& file = files_[p.file];
    if (!file) {
      std::error_code ec;
      const auto size = fs::file_size(path, ec);
      if (ec) throw UsageError("checkpoint file " + path + " is missing");
      if (static_cast<int64_t>(size) != f.bytes)
        throw UsageError("checkpoint file " + path + " is corrupt: " + std::to_string(size) +
                         " bytes, the index says " + std::to_string(f.bytes));
      try {
        file = std::make_unique<SafetensorsFile>(path);
      } catch (const SafetensorsError& e) {
        throw UsageError("checkpoint file " + path + " is corrupt: " + e.what());
      }
    }
    const TensorView* v = file->view().find(p.key);
    if (!v || v->numel() != p.numel || v->shape.size() != 1)
      throw UsageError("checkpoint file " + path + " is corrupt: no 1-D tensor " + p.key + " of " +
                       std::to_string(p.numel) + " elements");
    if (checked_.insert({p.file, p.key}).second && crc32_update(0, v->data, v->nbytes) != p.crc32)
      throw UsageError("checkpoint file " + path + " is corrupt: checksum mismatch in " + p.key);
    return *v;
  }

  std::string dir_;
  const Index& index_;
  std::map<int, std::unique_ptr<SafetensorsFile>> files_;
  std::set<std::pair<int, std::string>> checked_;
};

}  // namespace

Layout replicated_layout(const torch::nn::Module& model, bool writer) {
  Layout l;
  l.writer = writer;
  l.strategy = "ddp";
  int i = 0;
  for (auto& item : model.named_parameters()) {
    const at::Tensor& p = item.value();
    TORCH_CHECK(p.is_contiguous(), "checkpoint: parameter ", item.key(), " is not contiguous");
    // Optimizer states follow the trainable parameters only (frozen: none).
    l.slots.push_back({p, p.requires_grad() ? i++ : -1, {{item.key(), p.sizes().vec(), 0, 0, p.numel()}}});
  }
  return l;
}

struct Checkpointer::Pending {
  std::string dir;
  std::string strategy, mesh;
  SaveState state;
  std::thread thread;
  std::exception_ptr error;
};

Checkpointer::Checkpointer(comm::Group& group, CheckpointOptions options)
    : group_(group), options_(std::move(options)) {}

Checkpointer::~Checkpointer() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

void Checkpointer::commit_pending() {
  if (!pending_) return;
  std::unique_ptr<Pending> p = std::move(pending_);
  if (p->thread.joinable()) p->thread.join();
  if (p->error) std::rethrow_exception(p->error);
  group_.barrier().wait();  // every rank's part is durable
  if (group_.rank() == 0) {
    copy_assets(p->dir, options_.assets);
    write_index(p->dir, build_index(p->dir, group_.size(), p->strategy, p->mesh, p->state, options_.assets));
    prune_checkpoints(options_.root, options_.keep);
  }
}

void Checkpointer::save(const Layout& layout, const OptimizerState* opt, const SaveState& state) {
  const auto t0 = std::chrono::steady_clock::now();
  commit_pending();  // the previous asynchronous save
  auto pending = std::make_unique<Pending>();
  pending->dir = step_dir(options_.root, state.run.step);
  pending->strategy = layout.strategy;
  pending->mesh = layout.mesh;
  pending->state = state;
  if (group_.rank() == 0) {  // a leftover of a crashed save of this step is replaced
    std::error_code ec;
    fs::remove(fs::path(pending->dir) / "index.json", ec);
    fs::remove_all(pending->dir, ec);
    fs::create_directories(pending->dir, ec);
    if (ec) throw UsageError("checkpoint.dir: cannot create " + pending->dir + ": " + ec.message());
  }
  group_.barrier().wait();
  if (options_.full) {
    if (options_.async) throw UsageError("checkpoint: a full state dict cannot be written asynchronously");
    write_full(layout, opt, pending->dir);
  } else if (layout.writer) {
    std::vector<OutPiece> pieces = collect(layout, opt, /*copy=*/options_.async);
    if (options_.async) {
      Pending* raw = pending.get();
      const int rank = group_.rank();
      raw->thread = std::thread([raw, rank, pieces = std::move(pieces)] {
        trace::name_thread("checkpoint writer");  // Note [Tracing]
        trace::Span span("checkpoint", "write shards (async)");
        try {
          write_part(raw->dir, rank, pieces);
        } catch (...) {
          raw->error = std::current_exception();
        }
      });
    } else {
      trace::Span span("checkpoint", "write shards");
      write_part(pending->dir, group_.rank(), pieces);
    }
  }
  pending_ = std::move(pending);
  if (!options_.async) commit_pending();
  last_stall_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Checkpointer::finish() { commit_pending(); }

void check_shared_directory(comm::Group& group, const std::string& root) {
  if (group.size() == 1) return;
  const fs::path marker = fs::path(root) / ".scaletrain-shared-directory";
  at::Tensor token = at::zeros({1}, at::kLong);
  if (group.rank() == 0) {
    token.fill_(static_cast<int64_t>(std::chrono::steady_clock::now().time_since_epoch().count() ^ ::getpid()));
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) throw UsageError("checkpoint.dir: cannot create " + root + ": " + ec.message());
    write_file_durably(marker.string(), std::to_string(token.item<int64_t>()));
  }
  group.broadcast(token, 0).wait();
  std::ifstream in(marker);
  std::string seen;
  std::getline(in, seen);
  at::Tensor bad = at::zeros({group.size()}, at::kLong);
  if (seen != std::to_string(token.item<int64_t>())) bad[group.rank()] = 1;
  group.all_reduce(bad, comm::ReduceOp::Sum).wait();
  for (int r = 0; r < group.size(); ++r)
    if (bad[r].item<int64_t>() != 0) {
      char host[256] = "?";
      ::gethostname(host, sizeof host - 1);
      throw UsageError("checkpoint.dir " + root + " is not the directory rank 0 writes on rank " + std::to_string(r) +
                       (r == group.rank() ? std::string(" (host ") + host + ")" : std::string()) +
                       ": every rank writes its part there and rank 0 reads them all, so it must be on a "
                       "filesystem every node shares");
    }
  if (group.rank() == 0) fs::remove(marker);
}

std::string save_alone(const std::string& root, const Layout& layout, const OptimizerState* opt,
                       const SaveState& state) {
  const std::string dir = step_dir(root, state.run.step);
  if (fs::exists(dir))  // a run's checkpoint, or an earlier import: never overwritten
    throw UsageError("checkpoint: " + dir + " already exists; give another root");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError("checkpoint: cannot create " + dir + ": " + ec.message());
  write_part(dir, 0, collect(layout, opt, /*copy=*/false));
  write_index(dir, build_index(dir, 1, layout.strategy, layout.mesh, state, {}));
  return dir;
}

namespace {

// What one rank holds of one tensor, as every rank learns it (Note [Full state dict]).
struct Holding {
  int rank = 0;
  int64_t begin = 0, numel = 0;
};
struct FullTensor {
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  std::vector<Holding> held;  // sorted by begin
};

// Every rank's bytes, on every rank (lengths may differ).
std::vector<std::string> all_gather_text(comm::Group& g, const std::string& mine) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(mine.size()), at::kLong);
  at::Tensor lens = at::empty({g.size()}, at::kLong);
  g.all_gather(len, lens).wait();
  const int64_t longest = std::max<int64_t>(1, lens.max().item<int64_t>());
  at::Tensor buf = at::zeros({longest}, at::kByte);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  at::Tensor all = at::empty({longest * g.size()}, at::kByte);
  g.all_gather(buf, all).wait();
  std::vector<std::string> out;
  for (int r = 0; r < g.size(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * longest,
                     static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

// What every rank holds of every tensor, on every rank (Note [Full state dict]).
std::map<std::string, FullTensor> gather_holdings(comm::Group& g, const std::vector<OutPiece>& mine) {
  json desc = json::array();
  for (const auto& p : mine)
    desc.push_back({p.tensor, p.shape, static_cast<int>(p.data.scalar_type()), p.begin, p.data.numel()});
  std::map<std::string, FullTensor> tensors;
  const std::vector<std::string> texts = all_gather_text(g, desc.dump());
  for (int r = 0; r < g.size(); ++r)
    for (const auto& d : json::parse(texts[r])) {
      FullTensor& t = tensors[d[0].get<std::string>()];
      t.shape = d[1].get<std::vector<int64_t>>();
      t.dtype = static_cast<at::ScalarType>(d[2].get<int>());
      if (d[4].get<int64_t>() > 0) t.held.push_back({r, d[3].get<int64_t>(), d[4].get<int64_t>()});
    }
  return tensors;
}

// One whole tensor per name, in name order; sorts each tensor's holdings by begin.
std::vector<TensorRef> whole_refs(std::map<std::string, FullTensor>& tensors) {
  std::vector<TensorRef> refs;
  for (auto& [name, t] : tensors) {
    std::sort(t.held.begin(), t.held.end(), [](const Holding& a, const Holding& b) { return a.begin < b.begin; });
    int64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    const std::string key = name + "@0";
    refs.push_back({key,
                    safetensors_dtype(t.dtype, key),
                    {numel},
                    nullptr,
                    static_cast<size_t>(numel) * c10::elementSize(t.dtype)});
  }
  return refs;
}

std::string tensor_of(const TensorRef& ref) { return ref.name.substr(0, ref.name.rfind('@')); }

// This rank's pieces of tensor `name`, by begin.
std::vector<const OutPiece*> pieces_of(const std::vector<OutPiece>& mine, const std::string& name) {
  std::vector<const OutPiece*> out;
  for (const auto& p : mine)
    if (p.tensor == name && p.data.numel() > 0) out.push_back(&p);
  std::sort(out.begin(), out.end(), [](const OutPiece* a, const OutPiece* b) { return a->begin < b->begin; });
  return out;
}

}  // namespace

void Checkpointer::write_full(const Layout& layout, const OptimizerState* opt, const std::string& dir) {
  comm::Group& g = group_;
  const std::vector<OutPiece> mine = layout.writer ? collect(layout, opt, /*copy=*/false) : std::vector<OutPiece>{};
  std::map<std::string, FullTensor> tensors = gather_holdings(g, mine);
  // The file's tensors in data order, the same on every rank.
  std::vector<TensorRef> refs = whole_refs(tensors);
  std::vector<size_t> order(refs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return data_before(refs[a], refs[b]); });
  const int tag = 7;
  if (g.rank() != 0) {  // send my ranges of each tensor, in data order
    for (size_t i : order) {
      std::vector<at::Tensor> parts;
      for (const OutPiece* p : pieces_of(mine, tensor_of(refs[i]))) parts.push_back(p->data);
      if (!parts.empty()) g.send(at::cat(parts), 0, tag).wait();
    }
    return;
  }
  json part_pieces = json::array();
  at::Tensor whole, received;
  const std::string file = rank_name(0, "safetensors");
  const std::string path = (fs::path(dir) / file).string();
  auto assemble = [&](const TensorRef& ref) -> const void* {
    const std::string name = tensor_of(ref);
    const FullTensor& t = tensors.at(name);
    whole = at::empty({ref.shape[0]}, at::TensorOptions().dtype(t.dtype));
    for (const OutPiece* p : pieces_of(mine, name)) whole.narrow(0, p->begin, p->data.numel()).copy_(p->data);
    for (int r = 1; r < g.size(); ++r) {
      int64_t n = 0;
      for (const auto& h : t.held) n += h.rank == r ? h.numel : 0;
      if (n == 0) continue;
      received = at::empty({n}, whole.options());
      g.recv(received, r, tag).wait();
      int64_t at_ = 0;
      for (const auto& h : t.held) {
        if (h.rank != r) continue;
        whole.narrow(0, h.begin, h.numel).copy_(received.narrow(0, at_, h.numel));
        at_ += h.numel;
      }
    }
    int64_t covered = 0;
    for (const auto& h : t.held) covered += h.numel;
    if (covered != ref.shape[0])
      throw UsageError("checkpoint: the ranks hold " + std::to_string(covered) + " of " + std::to_string(ref.shape[0]) +
                       " elements of " + name);
    part_pieces.push_back({{"tensor", name},
                           {"shape", t.shape},
                           {"dtype", dtype_name(ref.dtype)},
                           {"key", ref.name},
                           {"begin", 0},
                           {"numel", ref.shape[0]},
                           {"crc32", crc32_update(0, whole.data_ptr(), whole.nbytes())}});
    return whole.data_ptr();
  };
  try {
    write_safetensors_streamed(path, refs, assemble, {{"format", "scaletrain"}, {"state_dict", "full"}});
  } catch (const SafetensorsError& e) {
    throw UsageError(std::string("checkpoint: ") + e.what());
  }
  int64_t bytes = 0;
  const uint32_t crc = crc32_file(path, &bytes);
  json part = {{"file", file}, {"rank", 0}, {"bytes", bytes}, {"crc32", crc}, {"pieces", part_pieces}};
  write_file_durably((fs::path(dir) / rank_name(0, "json")).string(), part.dump());
}

Index load_checkpoint(const std::string& dir, const Layout& layout, OptimizerState* opt) {
  Index index = read_index(dir);
  Reader reader(dir, index);
  for (const auto& slot : layout.slots) {
    std::vector<std::pair<std::string, at::Tensor>> targets{{"model", slot.tensor}};
    const bool with_opt = opt && slot.optim_index >= 0;
    if (with_opt) {
      // The states' fp32 values: the stored tensors themselves, or copies
      // that set_values() stores (Note [FP8 moments] in optim/adamw.h).
      const std::vector<std::string> kinds = opt->kinds();
      for (size_t k = 0; k < kinds.size(); ++k) targets.emplace_back(kinds[k], opt->value(k, slot.optim_index));
    }
    for (const auto& [kind, t] : targets) {
      at::Tensor flat = t.detach().view(-1);
      for (const auto& p : slot.pieces)
        reader.copy(kind + "/" + p.name, &p.shape, p.param_offset, flat.narrow(0, p.local_offset, p.numel));
    }
    if (with_opt) {
      std::vector<at::Tensor> values;
      for (size_t k = 1; k < targets.size(); ++k) values.push_back(targets[k].second);
      opt->set_values(slot.optim_index, values);
    }
  }
  if (opt) opt->set_steps(index.state.optimizer_steps);
  return index;
}

void read_tensors(const std::string& dir, const Index& index,
                  const std::vector<std::pair<std::string, at::Tensor>>& outs) {
  Reader reader(dir, index);
  for (const auto& [name, out] : outs) {
    auto it = index.tensors.find(name);
    if (it != index.tensors.end() && it->second.numel() != out.numel())
      throw UsageError("checkpoint " + dir + ": tensor " + name + " has " + std::to_string(it->second.numel()) +
                       " elements, expected " + std::to_string(out.numel()));
    reader.copy(name, nullptr, 0, out.detach().view(-1));
  }
}

namespace {

// A safetensors file whose bytes match its checksum can still be unusable (a
// file written malformed, a key the index names but the file lacks): parse
// its header and look up every piece the index places in it. "" when fine.
std::string check_tensor_file(const std::string& path, int file, const Index& index) {
  try {
    SafetensorsFile st(path);
    for (const auto& [name, t] : index.tensors)
      for (const auto& p : t.pieces) {
        if (p.file != file) continue;
        const TensorView* v = st.view().find(p.key);
        if (v == nullptr) return "holds no tensor '" + p.key + "', which the index names";
        if (v->numel() != p.numel)
          return "tensor '" + p.key + "' has " + std::to_string(v->numel()) + " elements, the index says " +
                 std::to_string(p.numel);
      }
  } catch (const SafetensorsError& e) {
    return std::string("malformed: ") + e.what();
  }
  return "";
}

}  // namespace

std::vector<std::string> verify_files(const std::string& dir, const Index& index) {
  std::vector<std::string> bad;
  for (size_t i = 0; i < index.files.size(); ++i) {
    const FileEntry& f = index.files[i];
    const std::string path = (fs::path(dir) / f.name).string();
    if (!fs::exists(path)) {
      bad.push_back(path + ": missing");
      continue;
    }
    int64_t bytes = 0;
    const uint32_t crc = crc32_file(path, &bytes);
    if (bytes != f.bytes) {
      bad.push_back(path + ": " + std::to_string(bytes) + " bytes, the index says " + std::to_string(f.bytes));
    } else if (crc != f.crc32) {
      bad.push_back(path + ": checksum mismatch");
    } else if (f.name.size() > 12 && f.name.compare(f.name.size() - 12, 12, ".safetensors") == 0) {
      const std::string problem = check_tensor_file(path, static_cast<int>(i), index);
      if (!problem.empty()) bad.push_back(path + ": " + problem);
    }
  }
  return bad;
}

std::string cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor s;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    s = gen.get_state();
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  const auto* b = s.data_ptr<uint8_t>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    out += hex[b[i] >> 4];
    out += hex[b[i] & 15];
  }
  return out;
}

void set_cpu_rng_state(const std::string& h) {
  if (h.empty()) return;
  if (h.size() % 2) throw UsageError("checkpoint: malformed rng_cpu state");
  at::Tensor s = at::empty({static_cast<int64_t>(h.size() / 2)}, at::kByte);
  auto* b = s.data_ptr<uint8_t>();
  for (size_t i = 0; i < h.size() / 2; ++i) b[i] = static_cast<uint8_t>(std::stoi(h.substr(2 * i, 2), nullptr, 16));
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

}  // namespace scaletrain::checkpoint

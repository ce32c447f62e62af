// Offloaded shards (Note [Offloaded shards], parallel/fsdp/flat_param.h):
// optimizer offload (ZeRO-Offload), parameter offload (ZeRO-3 / FSDP
// CPUOffload) and file-backed parameter shards (ZeRO-Infinity's nvme), each
// trained for several steps and compared with the single-process reference.
// On this CPU build "host" and "device" are one memory, so these runs check
// the logic: the shards are separate allocations from the offload allocator,
// gradients land there, gathers read them (or their device copy refreshed
// after each step), and file-backed shards are really mappings of files.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/optim/file_backed.h"
#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::test {
namespace offload_test {

using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::ShardedOptions;

constexpr int64_t kBatch = 12;  // divisible by 2 and 3 ranks
constexpr int kSteps = 4;
constexpr double kClip = 0.5, kLr = 1e-2;

models::GPT make_model() {
  torch::manual_seed(11);
  auto m = models::GPT(models::GPTConfig{61, 16, 3, 2, 24});
  m->to(at::kDouble);
  return m;
}

struct Counting {
  std::shared_ptr<std::atomic<int>> shards = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<int>> grads = std::make_shared<std::atomic<int>>(0);
};

// Host memory from the offload allocator, counted (or file-backed shards under `dir`).
void offload(ShardedOptions& o, const Counting& c, bool params, const std::string& dir = "") {
  o.offload_params = params;
  o.read_ahead = !dir.empty();
  o.offload_alloc = [c, dir](int64_t numel, at::ScalarType dtype, bool gradient) {
    (gradient ? *c.grads : *c.shards) += 1;
    if (!dir.empty() && !gradient) return optim::file_backed_zeros(dir, numel, dtype);
    return at::empty({numel}, at::TensorOptions().dtype(dtype));
  };
}

struct Result {
  double diff = 0;             // parameters after kSteps against the reference
  int64_t offloaded = 0;       // bytes the engine holds off the device
  int64_t shard_bytes = 0;     // bytes of the optimizer's shards
  bool shards_file_backed = false;
};

// `alive` runs while the engine still exists.
Result train(ShardedOptions o, const std::function<void()>& alive = {}) {
  const auto data = make_batches(kSteps, kBatch, 16, 61, 5);
  const Reference ref = train_reference(make_model(), data, kSteps, kClip, kLr);
  auto model = make_model();
  ShardedDataParallel engine(model.ptr(), *model, world(), *world().group(), nullptr, o);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  const int64_t local = kBatch / world().size();
  for (int s = 0; s < kSteps; ++s) {
    auto x = data[s].x.narrow(0, world().rank() * local, local), y = data[s].y.narrow(0, world().rank() * local, local);
    engine.forward([&] { return model->loss(x, y); }).backward();
    engine.clip_grad_norm(kClip);
    opt.step(kLr);
    engine.after_step();
    engine.zero_grad();
  }
  if (alive) alive();
  Result r;
  r.offloaded = engine.offloaded_bytes();
  for (const auto& t : engine.shards()) r.shard_bytes += static_cast<int64_t>(t.nbytes());
  std::vector<at::Tensor> want;
  for (auto& item : model->named_parameters()) want.push_back(ref.param.at(item.key()));
  r.diff = relative_diff(engine.full_parameters(), want, /*per_tensor=*/true);
  return r;
}

std::string scratch_dir() {
  const char* base = std::getenv("TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/st_offload_XXXXXX";
  if (!::mkdtemp(dir.data())) throw std::runtime_error("mkdtemp failed");
  return dir;
}

TEST(Offload, OptimizerOffloadMatchesTheReference) {
  for (const char* s : {"zero1", "zero2", "zero3"}) {
    SCOPED_TRACE(s);
    Counting c;
    ShardedOptions o = sharded_options_for(s);
    offload(o, c, /*params=*/false);
    const Result r = train(o);
    EXPECT_LE(r.diff, 1e-10);
    // Every trainable flat's shard came from the allocator, and so did its gradient.
    EXPECT_GT(c.shards->load(), 0);
    EXPECT_EQ(c.grads->load(), c.shards->load());
    // Offloaded bytes are the shards and their gradients (same dtype and size).
    EXPECT_EQ(r.offloaded, 2 * r.shard_bytes);
  }
}

TEST(Offload, ParameterOffloadMatchesTheReference) {
  for (const char* s : {"zero3", "FULL_SHARD", "SHARD_GRAD_OP"}) {
    SCOPED_TRACE(s);
    Counting c;
    ShardedOptions o = sharded_options_for(s);
    offload(o, c, /*params=*/true);
    const Result r = train(o);
    EXPECT_LE(r.diff, 1e-10);
    EXPECT_GT(c.shards->load(), 0);
    EXPECT_EQ(r.offloaded, 2 * r.shard_bytes);
  }
}

TEST(Offload, FileBackedParameterShardsMatchTheReference) {
  const std::string dir = scratch_dir();
  Counting c;
  ShardedOptions o = sharded_options_for("zero3");
  offload(o, c, /*params=*/true, dir);
  int mapped = 0;
  const Result r = train(o, [&] {
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);) mapped += line.find(dir) != std::string::npos ? 1 : 0;
  });
  EXPECT_LE(r.diff, 1e-10);
  EXPECT_GT(c.shards->load(), 0);
  EXPECT_EQ(mapped, c.shards->load()) << "every parameter shard is a mapping of a file under " << dir;
  // The files are unlinked once mapped: the directory is empty again.
  EXPECT_EQ(::rmdir(dir.c_str()), 0) << dir << " is not empty";
}

}  // namespace offload_test
}  // namespace scaletrain::test

// Sharded checkpoints reload under another strategy and world size: a run
// saved by strategy S on N ranks (CheckpointSave.*, one ctest) is loaded by
// strategy T on M ranks (CheckpointLoad.*, a later ctest of the same fixture;
// a launched binary only has one world size). After loading, each rank's
// parameters and AdamW states equal what the single-process reference holds
// after the same steps, and one more step still matches it (DESIGN: the
// invariant). fp64, so the comparison checks the bytes moved, not rounding.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/zero/zero.h"

namespace scaletrain::test {
namespace checkpoint_test {

namespace fs = std::filesystem;
using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::Sharding;

constexpr int64_t kGlobalBatch = 24;  // divisible by 1..4 ranks
constexpr int kSaved = 3;             // steps before the checkpoint
constexpr double kLr = 1e-2;

models::GPTConfig odd_gpt() { return models::GPTConfig{61, 16, 3, 2, 26}; }  // no flat buffer divides by 3 or 4

std::vector<Batch> make_data() { return make_batches(kSaved + 1, kGlobalBatch, 16, 61, 4321); }

models::GPT make_model(uint64_t seed) {
  torch::manual_seed(seed);
  auto m = models::GPT(odd_gpt());
  m->to(at::kDouble);
  return m;
}

Reference reference(int steps) { return train_reference(make_model(42), make_data(), steps, 0.5, kLr); }

// One strategy on this world: the model, its engine, the optimizer.
struct Run {
  std::string strategy;  // ddp | zero1 | zero2 | zero3 | FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD
  models::GPT model{nullptr};
  std::unique_ptr<comm::Mesh> mesh;
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  std::unique_ptr<ShardedDataParallel> sharded;
  std::unique_ptr<optim::AdamW> opt;
  int dp_rank = 0;

  Run(const std::string& s, uint64_t seed) : strategy(s) {
    model = make_model(seed);
    const bool hybrid = s == "HYBRID_SHARD";
    mesh = std::make_unique<comm::Mesh>(world(), comm::MeshDims{1, hybrid ? 2 : 1, -1, 1}.resolved(world().size()));
    dp_rank = mesh->coord().dp(mesh->dims());
    if (s == "ddp") {
      ddp = std::make_unique<parallel::DistributedDataParallel>(model.ptr(), mesh->dp());
      auto params = model->parameters();
      opt = std::make_unique<optim::AdamW>(params, optim::decay_matrices(params));
      return;
    }
    const parallel::fsdp::ShardedOptions o = sharded_options_for(s);
    comm::Group& shard = hybrid ? mesh->dp_shard() : mesh->dp();
    sharded = std::make_unique<ShardedDataParallel>(model.ptr(), *model, world(), shard,
                                                    hybrid ? &mesh->dp_replicate() : nullptr, o);
    opt = std::make_unique<optim::AdamW>(sharded->shards(), sharded->shard_decay_numel());
  }

  checkpoint::Layout layout() const {
    return ddp ? checkpoint::replicated_layout(*model, world().rank() == 0) : train::sharded_layout(*sharded);
  }

  void step(const Batch& b) {
    const int dp = mesh->dims().dp();
    const int64_t local = kGlobalBatch / dp;
    auto x = b.x.narrow(0, dp_rank * local, local), y = b.y.narrow(0, dp_rank * local, local);
    if (ddp) {
      model->loss(x, y).backward();
      optim::clip_grad_norm(model->parameters(), 0.5);
      opt->step(kLr);
      opt->zero_grad();
      return;
    }
    sharded->forward([&] { return model->loss(x, y); }).backward();
    sharded->clip_grad_norm(0.5);
    opt->step(kLr);
    sharded->after_step();
    sharded->zero_grad();
  }
};

fs::path root() {
  const char* d = std::getenv("SCALETRAIN_CKPT_TEST_DIR");
  return d ? fs::path(d) : fs::temp_directory_path() / "scaletrain_ckpt_test";
}

double rel_diff(const at::Tensor& got, const at::Tensor& want) {
  const double scale = std::max(want.abs().max().item<double>(), 1e-30);
  return (got.to(at::kDouble) - want).abs().max().item<double>() / scale;
}

// Every piece this rank holds equals the reference's range (params, and states when `states`).
void expect_matches(const Run& run, const Reference& ref, bool states, const std::string& what) {
  double worst = 0;
  int64_t checked = 0;
  for (const auto& slot : run.layout().slots) {
    for (const auto& p : slot.pieces) {
      auto cmp = [&](const at::Tensor& mine, const std::map<std::string, at::Tensor>& r) {
        const at::Tensor got = mine.detach().reshape(-1).narrow(0, p.local_offset, p.numel);
        const at::Tensor want = r.at(p.name).reshape(-1).narrow(0, p.param_offset, p.numel);
        worst = std::max(worst, rel_diff(got, want));
        checked += p.numel;
      };
      cmp(slot.tensor, ref.param);
      if (states && slot.optim_index >= 0) {
        cmp(run.opt->exp_avg()[slot.optim_index], ref.exp_avg);
        cmp(run.opt->exp_avg_sq()[slot.optim_index], ref.exp_avg_sq);
      }
    }
  }
  EXPECT_GT(checked, 0) << what;
  EXPECT_LE(worst, 1e-9) << what << " on rank " << world().rank();
}

void save(const std::string& name, const std::string& strategy) {
  auto data = make_data();
  Run run(strategy, 42);
  for (int s = 0; s < kSaved; ++s) run.step(data[s]);
  expect_matches(run, reference(kSaved), true, name + " before saving");
  checkpoint::Checkpointer ckpt(*world().group(), {(root() / name).string(), 1, /*async=*/strategy == "zero3"});
  checkpoint::SaveState st;
  st.run.step = kSaved;
  st.run.optimizer_steps = run.opt->steps();
  checkpoint::Layout layout = run.layout();
  layout.mesh = run.mesh->dims().describe();
  const checkpoint::OptimizerMoments<optim::AdamW> moments(*run.opt);
  ckpt.save(layout, &moments, st);
  ckpt.finish();
  world().group()->barrier().wait();
  if (world().rank() == 0) {
    auto newest = checkpoint::newest_checkpoint((root() / name).string());
    ASSERT_TRUE(newest.has_value());
    auto index = checkpoint::read_index(*newest);
    EXPECT_EQ(index.world_size, world().size());
    EXPECT_TRUE(checkpoint::verify_files(*newest, index).empty());
  }
}

void load(const std::string& name, const std::string& strategy) {
  const auto dir = checkpoint::newest_checkpoint((root() / name).string());
  ASSERT_TRUE(dir.has_value()) << "run the CheckpointSave test of " << name << " first";
  Run run(strategy, 7);  // other initial weights: loading must overwrite every element
  checkpoint::OptimizerMoments<optim::AdamW> moments(*run.opt);
  const auto index = checkpoint::load_checkpoint(*dir, run.layout(), &moments);
  if (run.sharded) run.sharded->after_step();
  EXPECT_EQ(run.opt->steps(), kSaved);
  const std::string what = index.strategy + " on " + std::to_string(index.world_size) + " -> " + strategy + " on " +
                           std::to_string(world().size());
  expect_matches(run, reference(kSaved), true, what);
  run.step(make_data()[kSaved]);
  expect_matches(run, reference(kSaved + 1), true, what + ", one step later");
  if (run.sharded) {  // replicated parameters were refreshed too: the model as a whole matches
    auto full = run.sharded->full_parameters();
    const auto ref = reference(kSaved + 1);
    size_t i = 0;
    for (auto& item : run.model->named_parameters()) EXPECT_LE(rel_diff(full[i++], ref.param.at(item.key())), 1e-9);
  }
  if (world().rank() == 0) std::printf("[checkpoint] %s: state and next step match the reference\n", what.c_str());
}

TEST(CheckpointSave, Zero3) { save("zero3", "zero3"); }
TEST(CheckpointSave, FullShard) { save("full_shard", "FULL_SHARD"); }
TEST(CheckpointSave, Ddp) { save("ddp", "ddp"); }
TEST(CheckpointSave, Hybrid) { save("hybrid", "HYBRID_SHARD"); }

TEST(CheckpointLoad, Zero3IntoDdp) { load("zero3", "ddp"); }
TEST(CheckpointLoad, FullShardIntoZero1) { load("full_shard", "zero1"); }
TEST(CheckpointLoad, DdpIntoFullShard) { load("ddp", "FULL_SHARD"); }
TEST(CheckpointLoad, HybridIntoShardGradOp) { load("hybrid", "SHARD_GRAD_OP"); }
TEST(CheckpointLoad, HybridIntoOneProcess) { load("hybrid", "ddp"); }

}  // namespace checkpoint_test
}  // namespace scaletrain::test

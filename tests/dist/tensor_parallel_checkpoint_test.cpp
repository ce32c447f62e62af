// Checkpoints of tensor-parallel runs hold the single-process model's tensors
// (train::tensor_parallel_layout: each TP shard as pieces of the full
// tensor), so they reload under any layout, and any checkpoint reloads into
// a tensor-parallel layout. As in checkpoint_test.cpp, each save is one ctest
// (a fixture) and each load a later one on another world size; after loading,
// every piece a rank holds (parameters and AdamW states) equals the
// single-process reference after the same steps, and one more step still
// does. fp64, so the comparison checks the bytes moved, not rounding.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/parallel/zero/zero.h"

namespace scaletrain::test {
namespace tensor_parallel_checkpoint_test {

namespace fs = std::filesystem;
namespace tp = parallel::tensor;
using parallel::fsdp::ShardedDataParallel;

constexpr int64_t kBatch = 12, kSeq = 16, kVocab = 62;  // divisible by dp 1, 2 and 4
constexpr int kSaved = 3;                               // steps before the checkpoint
constexpr double kLr = 1e-2, kClip = 0.5;

// tp 2 divides the vocabulary and the heads; odd widths, so flat shards and
// tp shards cut parameters at different places.
models::GPTConfig gpt() { return models::GPTConfig{kVocab, kSeq, 3, 2, 26}; }

std::vector<Batch> data() { return make_batches(kSaved + 1, kBatch, kSeq, kVocab, 4321); }

models::GPT make_model(uint64_t seed) {
  torch::manual_seed(seed);
  auto m = models::GPT(gpt());
  m->to(at::kDouble);
  return m;
}

Reference reference(int steps) { return train_reference(make_model(42), data(), steps, kClip, kLr); }

// One layout on this world: tensor parallelism of degree `tp` (dp = world /
// tp), then DDP or the sharded engine over dp, and AdamW.
struct Run {
  std::string strategy;  // ddp | zero1 | zero2 | zero3 | FULL_SHARD
  models::GPT model{nullptr};
  std::unique_ptr<comm::Mesh> mesh;
  std::optional<tp::TensorParallelPlan> plan;
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  std::unique_ptr<ShardedDataParallel> sharded;
  std::unique_ptr<optim::AdamW> opt;
  parallel::fsdp::NormSplit split;

  Run(const std::string& s, int tp_degree, uint64_t seed) : strategy(s) {
    model = make_model(seed);
    mesh = std::make_unique<comm::Mesh>(world(), comm::MeshDims{1, 1, -1, tp_degree}.resolved(world().size()));
    if (tp_degree > 1) {
      plan = tp::parallelize_tensor(*model, mesh->tp());
      std::set<std::string> names;
      for (auto& l : plan->params)
        if (l.sharded()) names.insert(l.name);
      split = {&mesh->tp(), [names](const std::string& n) { return names.count(n) > 0; }};
    }
    if (s == "ddp") {
      ddp = std::make_unique<parallel::DistributedDataParallel>(model.ptr(), mesh->dp());
      auto params = model->parameters();
      opt = std::make_unique<optim::AdamW>(params, optim::decay_matrices(params));
      return;
    }
    const parallel::fsdp::ShardedOptions o = sharded_options_for(s, 6000);
    sharded = std::make_unique<ShardedDataParallel>(model.ptr(), *model, world(), mesh->dp(), nullptr, o);
    opt = std::make_unique<optim::AdamW>(sharded->shards(), sharded->shard_decay_numel());
  }

  std::string name() const { return strategy + (plan ? " tp" + std::to_string(plan->tp->size()) : ""); }

  checkpoint::Layout layout() const {
    checkpoint::Layout l =
        ddp ? checkpoint::replicated_layout(*model, mesh->dp().rank() == 0) : train::sharded_layout(*sharded);
    return plan ? train::tensor_parallel_layout(std::move(l), *plan) : l;
  }

  void step(const Batch& b) {
    const int64_t local = kBatch / mesh->dp().size(), start = mesh->dp().rank() * local;
    auto x = b.x.narrow(0, start, local), y = b.y.narrow(0, start, local);
    if (ddp) {
      model->loss(x, y).backward();
      if (plan)
        tp::clip_grad_norm(tp::grad_norm_params(*model, *plan), kClip, *plan->tp);
      else
        optim::clip_grad_norm(model->parameters(), kClip);
      opt->step(kLr);
      opt->zero_grad();
      return;
    }
    sharded->forward([&] { return model->loss(x, y); }).backward();
    sharded->clip_grad_norm(kClip, split);
    opt->step(kLr);
    sharded->after_step();
    sharded->zero_grad();
  }

  // The whole model (gathered over dp and tp), in named_parameters() order.
  std::vector<at::Tensor> full_parameters() {
    std::vector<at::Tensor> local = sharded ? sharded->full_parameters() : model->parameters();
    if (!plan) return local;
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < local.size(); ++i) out.push_back(tp::gather_parameter(local[i], plan->params[i], *plan->tp));
    return out;
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

// Every piece this rank holds (saved or not) equals the reference's range.
void expect_matches(const Run& run, const Reference& ref, const std::string& what) {
  double worst = 0;
  int64_t checked = 0;
  for (const auto& slot : run.layout().slots) {
    for (const auto& p : slot.pieces) {
      auto cmp = [&](const at::Tensor& mine, const std::map<std::string, at::Tensor>& r) {
        const at::Tensor want = r.at(p.name).reshape(-1);
        ASSERT_EQ(want.numel(), c10::multiply_integers(p.shape)) << p.name << ": not the full shape";
        const at::Tensor got = mine.detach().reshape(-1).narrow(0, p.local_offset, p.numel);
        // Scaled by the whole tensor, as relative_diff(per_tensor): c_attn's k
        // bias gets a zero gradient up to rounding, so a piece of it alone
        // measures rounding noise that Adam amplified, not the layout.
        const double d = (got - want.narrow(0, p.param_offset, p.numel)).abs().max().item<double>() /
                         std::max(want.abs().max().item<double>(), 1e-30);
        worst = std::max(worst, d);
        checked += p.numel;
      };
      cmp(slot.tensor, ref.param);
      if (slot.optim_index >= 0) {
        cmp(run.opt->exp_avg()[slot.optim_index], ref.exp_avg);
        cmp(run.opt->exp_avg_sq()[slot.optim_index], ref.exp_avg_sq);
      }
    }
  }
  EXPECT_GT(checked, 0) << what;
  EXPECT_LE(worst, 1e-9) << what << " on rank " << world().rank();
}

void save(const std::string& name, const std::string& strategy, int tp_degree) {
  auto batches = data();
  Run run(strategy, tp_degree, 42);
  for (int s = 0; s < kSaved; ++s) run.step(batches[s]);
  expect_matches(run, reference(kSaved), run.name() + " before saving");
  checkpoint::Checkpointer ckpt(*world().group(), {(root() / name).string(), 1, /*async=*/false});
  checkpoint::SaveState st;
  st.run.step = kSaved;
  st.run.optimizer_steps = run.opt->steps();
  checkpoint::Layout layout = run.layout();
  layout.mesh = run.mesh->dims().describe();
  const checkpoint::OptimizerMoments<optim::AdamW> moments(*run.opt);
  ckpt.save(layout, &moments, st);  // the index build checks that the pieces tile every tensor
  world().group()->barrier().wait();
  if (world().rank() == 0) {
    auto newest = checkpoint::newest_checkpoint((root() / name).string());
    ASSERT_TRUE(newest.has_value());
    auto index = checkpoint::read_index(*newest);
    EXPECT_TRUE(checkpoint::verify_files(*newest, index).empty());
    // The full shapes, not a tp rank's.
    EXPECT_EQ(index.tensors.at("model/wte.weight").shape, (std::vector<int64_t>{kVocab, 26}));
    EXPECT_EQ(index.tensors.at("model/h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{78, 26}));
  }
}

void load(const std::string& name, const std::string& strategy, int tp_degree) {
  const auto dir = checkpoint::newest_checkpoint((root() / name).string());
  ASSERT_TRUE(dir.has_value()) << "run the save test of " << name << " first";
  Run run(strategy, tp_degree, 7);  // other initial weights: loading must overwrite every element
  checkpoint::OptimizerMoments<optim::AdamW> moments(*run.opt);
  const auto index = checkpoint::load_checkpoint(*dir, run.layout(), &moments);
  if (run.sharded) run.sharded->after_step();
  EXPECT_EQ(run.opt->steps(), kSaved);
  const std::string what =
      index.strategy + " (" + index.mesh + ") -> " + run.name() + " on " + std::to_string(world().size());
  expect_matches(run, reference(kSaved), what);
  run.step(data()[kSaved]);
  const auto next = reference(kSaved + 1);
  expect_matches(run, next, what + ", one step later");
  auto full = run.full_parameters();
  double worst = 0;
  size_t i = 0;
  for (auto& item : run.model->named_parameters())
    worst = std::max(worst, rel_diff(full[i++], next.param.at(item.key())));
  EXPECT_LE(worst, 1e-9) << what;
  if (world().rank() == 0)
    std::printf("[checkpoint] %s: state and next step match the reference (max relative diff %.3g)\n", what.c_str(),
                worst);
}

TEST(TpCheckpointSave, Zero3Tp2) {
  if (world().size() != 4) GTEST_SKIP() << "saves on DP2 x TP2";
  save("tp_zero3", "zero3", 2);
}
// DDP without tensor parallelism, and DDP with TP2 on dp 1 (replicated
// parameters saved by tp rank 0 only).
TEST(TpCheckpointSave, DdpAndDdpTp2) {
  if (world().size() != 2) GTEST_SKIP() << "saves on 2 ranks";
  save("plain_ddp", "ddp", 1);
  save("ddp_tp2", "ddp", 2);
}

TEST(TpCheckpointLoad, Zero3Tp2IntoDdp) { load("tp_zero3", "ddp", 1); }
TEST(TpCheckpointLoad, IntoOneProcess) {
  load("tp_zero3", "ddp", 1);
  load("ddp_tp2", "ddp", 1);
}
TEST(TpCheckpointLoad, IntoDpTimesTp) {
  if (world().size() != 4) GTEST_SKIP() << "loads on DP2 x TP2";
  load("plain_ddp", "ddp", 2);
  load("plain_ddp", "zero1", 2);
  load("ddp_tp2", "zero3", 2);
  load("tp_zero3", "FULL_SHARD", 2);
}

}  // namespace tensor_parallel_checkpoint_test
}  // namespace scaletrain::test

// Pipelines over stages the user gives: a CNN as a torch::nn::Sequential
// (4-d feature maps, then a 2-d batch of features between stages) cut by a
// balance into p*v chunks, under GPipe, 1F1B, interleaved and layer-wise
// model parallelism (one micro-batch), against one process (fp64, 1e-10).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/pipeline/module_pipeline.h"

namespace scaletrain::test {
namespace module_pipeline_test {

namespace pl = parallel::pipeline;

torch::nn::Sequential make_cnn() {
  torch::manual_seed(11);
  torch::nn::Sequential s(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)), torch::nn::ReLU(),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)), torch::nn::ReLU(),
                          torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(), torch::nn::Linear(8, 16),
                          torch::nn::Tanh(), torch::nn::Linear(16, 10));
  s->to(at::kDouble);
  return s;
}

// 9 children over n chunks, the first ones one larger.
std::vector<int64_t> balance_for(int n) {
  std::vector<int64_t> b(static_cast<size_t>(n), 9 / n);
  for (int i = 0; i < 9 % n; ++i) ++b[static_cast<size_t>(i)];
  return b;
}

constexpr int64_t kBatch = 16;
constexpr int kSteps = 3;

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto g = at::detail::createCPUGenerator(90 + step);
  return {at::randn({kBatch, 3, 6, 6}, g, at::kDouble), at::randint(10, {kBatch}, g, at::kLong)};
}

at::Tensor loss_fn(const at::Tensor& out, const at::Tensor& y) { return torch::nll_loss(torch::log_softmax(out, 1), y); }

void expect_parity(pl::Schedule schedule, int m, int v, const std::string& what) {
  const int p = world().size();
  auto whole = make_cnn();
  auto pieces = pl::split(whole, balance_for(p * v));
  std::vector<pl::StageModule> mine;
  for (int j = 0; j < v; ++j) mine.push_back(pl::stage(pieces[static_cast<size_t>(j * p + world().rank())]));
  pl::ModulePipelineOptions o;
  o.schedule = schedule;
  o.microbatches = m;
  o.virtual_stages = v;
  pl::ModulePipeline pipe(mine, *world().group(), o);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1));

  auto ref = make_cnn();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    pipe.zero_grad();
    const double loss = pipe.step(x, y, loss_fn);
    opt.step();
    ref_opt.zero_grad();
    auto ref_loss = loss_fn(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-12) << what << " step " << s;
  }
  // This rank's chunks against the same children of the reference.
  const auto balance = balance_for(p * v);
  auto whole_params = whole->named_parameters(), ref_params = ref->named_parameters();
  int compared = 0;
  for (int j = 0; j < v; ++j) {
    const int c = j * p + world().rank();
    const int64_t first = std::accumulate(balance.begin(), balance.begin() + c, int64_t{0});
    for (int64_t k = first; k < first + balance[static_cast<size_t>(c)]; ++k) {
      const std::string prefix = std::to_string(k) + ".";
      for (auto& item : whole_params) {
        if (item.key().rfind(prefix, 0) != 0) continue;
        const at::Tensor& want = ref_params[item.key()];
        EXPECT_LE(relative_diff({item.value()}, {want}, true), 1e-10) << what << " " << item.key();
        EXPECT_GT((want - make_cnn()->named_parameters()[item.key()]).abs().max().item<double>(), 1e-4)
            << what << " " << item.key() << " did not move";
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, static_cast<int>(pipe.parameters().size())) << what;
}

TEST(ModulePipeline, SequentialStagesMatchOneProcessUnderEverySchedule) {
  expect_parity(pl::Schedule::OneFOneB, 1, 1, "layer-wise (1 micro-batch)");
  expect_parity(pl::Schedule::GPipe, 4, 1, "gpipe m=4");
  expect_parity(pl::Schedule::OneFOneB, 4, 1, "1f1b m=4");
  if (world().size() <= 4) expect_parity(pl::Schedule::Interleaved, 2 * world().size(), 2, "interleaved v=2");
}

// PP2 x DP2: each stage under DDP over its data-parallel pair, reducing
// only in its last backward of the step (DdpStageRunner).
// pp 2 x dp 2: 4 ranks only (the w2 entry filters it out).
TEST(ModulePipelineDp, DdpPerStageMatchesOneProcess) {
  static comm::Mesh mesh(world(), comm::MeshDims{2, 1, 2, 1});
  const int stage = mesh.coord().pp, dp_rank = mesh.coord().dp(mesh.dims());
  auto whole = make_cnn();
  auto pieces = pl::split(whole, balance_for(2));
  auto chunk = pl::stage(pieces[static_cast<size_t>(stage)]);
  auto ddp = std::make_shared<parallel::DistributedDataParallel>(chunk.module, mesh.dp());
  chunk.runner = std::make_shared<pl::DdpStageRunner>(ddp);
  pl::ModulePipelineOptions o;
  o.microbatches = 2;
  pl::ModulePipeline pipe({chunk}, mesh.pp(), o);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.1));
  auto ref = make_cnn();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const int64_t half = kBatch / 2;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    pipe.zero_grad();
    pipe.step(x.narrow(0, dp_rank * half, half), y.narrow(0, dp_rank * half, half), loss_fn);
    opt.step();
    ref_opt.zero_grad();
    loss_fn(ref->forward(x), y).backward();
    ref_opt.step();
  }
  const int64_t first = stage == 0 ? 0 : balance_for(2)[0];
  auto got = whole->named_parameters(), want = ref->named_parameters();
  for (auto& item : got) {
    const int64_t child = std::stoll(item.key().substr(0, item.key().find('.')));
    if (child < first || child >= first + balance_for(2)[static_cast<size_t>(stage)]) continue;
    EXPECT_LE(relative_diff({item.value()}, {want[item.key()]}, true), 1e-10) << item.key();
  }
}

// fully_shard per stage on pp 2 x dp 2, 1F1B over 4 micro-batches: a
// unit's forward of one micro-batch runs between the backward passes of
// others, and only the last backward of the step reduces.
TEST(ModulePipelineDp, FullyShardPerStageMatchesOneProcess) {
  static comm::Mesh mesh(world(), comm::MeshDims{2, 1, 2, 1});
  const int stage = mesh.coord().pp, dp_rank = mesh.coord().dp(mesh.dims());
  for (auto sharding : {parallel::fsdp::Sharding::Zero2, parallel::fsdp::Sharding::FullShard}) {
    auto whole = make_cnn();
    auto pieces = pl::split(whole, balance_for(2));
    auto chunk = pl::stage(pieces[static_cast<size_t>(stage)]);
    parallel::fsdp::ModuleUnits units;
    units.min_num_params = 100;  // every Conv2d and Linear
    parallel::fsdp::ShardedOptions so;
    so.sharding = sharding;
    std::shared_ptr<parallel::fsdp::ShardedDataParallel> engine =
        parallel::fsdp::fully_shard(chunk.module, world(), mesh.dp(), units, so);
    chunk.runner = std::make_shared<pl::ShardedStageRunner>(engine);
    pl::ModulePipelineOptions o;
    o.microbatches = 4;
    pl::ModulePipeline pipe({chunk}, mesh.pp(), o);
    torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
    auto ref = make_cnn();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    const int64_t half = kBatch / 2;
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = batch(s);
      engine->zero_grad();
      pipe.step(x.narrow(0, dp_rank * half, half), y.narrow(0, dp_rank * half, half), loss_fn);
      opt.step();
      engine->after_step();
      ref_opt.zero_grad();
      loss_fn(ref->forward(x), y).backward();
      ref_opt.step();
    }
    auto got = engine->full_parameters();
    auto names = chunk.module->named_parameters();
    auto want = ref->named_parameters();  // a piece keeps the Sequential's child names
    ASSERT_EQ(got.size(), names.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LE(relative_diff({got[i]}, {want[names[i].key()]}, true), 1e-10)
          << parallel::fsdp::to_string(sharding) << " " << names[i].key();
  }
}

TEST(ModulePipeline, ZeroGradAndEvaluation) {
  const int p = world().size();
  auto whole = make_cnn();
  auto pieces = pl::split(whole, balance_for(p));
  pl::ModulePipeline pipe({pl::stage(pieces[static_cast<size_t>(world().rank())])}, *world().group());
  auto [x, y] = batch(0);
  pipe.step(x, y, loss_fn);
  for (auto& t : pipe.parameters()) EXPECT_TRUE(t.grad().defined());
  pipe.zero_grad();
  for (auto& t : pipe.parameters()) EXPECT_FALSE(t.grad().defined()) << "zero_grad left a gradient";
  const at::Tensor out = pipe.forward(x);
  if (world().rank() == p - 1) {
    EXPECT_LE((out - make_cnn()->forward(x)).abs().max().item<double>(), 1e-12);
  } else {
    EXPECT_FALSE(out.defined());
  }
}

TEST(ModulePipeline, BadSplitsAreNamed) {
  auto s = make_cnn();
  try {
    pl::split(s, {4, 4});
    ADD_FAILURE() << "a balance of 8 accepted for 9 children";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4 + 4 = 8 does not add up to the Sequential's 9 children"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(pl::split(s, {9, 0}), std::invalid_argument);
  pl::ModulePipelineOptions o;
  o.virtual_stages = 2;
  o.schedule = pl::Schedule::Interleaved;
  o.microbatches = 2 * world().size();
  EXPECT_THROW(pl::ModulePipeline({pl::stage(s)}, *world().group(), o), std::invalid_argument);
}

// Chunks whose shapes do not meet: the chunk, its rank and the input it got
// are named. Both chunks are on this rank (a pipeline of one stage, two
// virtual stages), so the failing chunk's peers wait for nothing.
TEST(ModulePipeline, MismatchedChunksAreNamed) {
  static comm::Mesh mesh(world(), comm::MeshDims{1, 1, world().size(), 1});
  torch::manual_seed(3);
  torch::nn::Sequential s(torch::nn::Linear(4, 8), torch::nn::Linear(6, 2));  // 8 out, 6 in
  s->to(at::kDouble);
  auto pieces = pl::split(s, {1, 1});
  pl::ModulePipelineOptions o;
  o.virtual_stages = 2;
  o.schedule = pl::Schedule::Interleaved;
  o.microbatches = 2;
  pl::ModulePipeline pipe({pl::stage(pieces[0]), pl::stage(pieces[1])}, mesh.pp(), o);
  auto mse = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
  try {
    pipe.step(at::randn({4, 4}, at::kDouble), at::randn({4, 2}, at::kDouble), mse);
    ADD_FAILURE() << "chunks of 8 and 6 features ran";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline chunk 1 (rank 0) failed on an input of"), std::string::npos)
        << e.what();
  }
}

}  // namespace module_pipeline_test
}  // namespace scaletrain::test

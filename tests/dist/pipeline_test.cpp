// Pipeline parallelism against the single-process reference (DESIGN: the
// invariant). Every rank trains a full copy of the model on the whole global
// batch locally (the reference) and the pipeline on its share; after 5 AdamW
// steps, with clipping that acts, each rank's stage parameters (gathered over
// tp and dp shards where split) must equal the reference's of the same name.
// Runs in fp64 (see tensor_parallel_test.cpp: Adam amplifies rounding), so
// the comparison tests the algorithm: schedules, cuts, the tied head across
// stages, gradient accumulation over micro-batches, the global norm.
//
// 2 ranks: PP=2 with each schedule. 4 ranks: PP=4 with each schedule, and
// DP2 x PP2 (DDP), TP2 x PP2, ZeRO-3 inside PP2.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/pipeline/data_parallel.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace {

namespace pl = parallel::pipeline;

constexpr int kSteps = 5;
constexpr int64_t kSeq = 16, kVocab = 64, kMicro = 2;
constexpr double kMaxNorm = 0.25, kTol = 1e-5;

// 8 blocks: enough for 4 stages x 2 virtual stages.
models::GPTConfig small_gpt() { return models::GPTConfig{kVocab, kSeq, 8, 4, 32}; }

enum class Dp { None, Ddp, Zero3 };

struct Case {
  pl::Schedule schedule;
  int m;      // micro-batches per step (per data-parallel replica)
  int v = 1;  // virtual stages
  int pp = 0; // 0: the world
  int dp = 1;
  int tp = 1;
  Dp mode = Dp::None;
};

std::string describe(const Case& c) {
  return pl::to_string(c.schedule) + " pp=" + std::to_string(c.pp) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v) + " dp=" + std::to_string(c.dp) + " tp=" + std::to_string(c.tp) +
         (c.mode == Dp::Zero3 ? " zero3" : c.mode == Dp::Ddp ? " ddp" : "");
}

optim::AdamWOptions adam() {
  optim::AdamWOptions o;
  o.lr = 1e-2;
  return o;
}

// The reference: one process, whole global batches, named final parameters.
std::map<std::string, at::Tensor> reference(const std::vector<Batch>& data) {
  torch::manual_seed(7);
  models::GPT gpt(small_gpt());
  gpt->to(torch::kDouble);
  std::vector<at::Tensor> params = gpt->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), adam());
  for (const Batch& b : data) {
    gpt->zero_grad();
    gpt->loss(b.x, b.y).backward();
    optim::clip_grad_norm(params, kMaxNorm);
    opt.step(adam().lr);
  }
  std::map<std::string, at::Tensor> out;
  for (auto& item : gpt->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void run_case(const Case& c0) {
  Case c = c0;
  const int world_size = world().size();
  if (c.pp == 0) c.pp = world_size / (c.dp * c.tp);
  SCOPED_TRACE(describe(c));
  comm::Mesh mesh(world(), comm::MeshDims{c.pp, 1, c.dp, c.tp});
  const int64_t global = static_cast<int64_t>(c.dp) * c.m * kMicro;
  const auto data = make_batches(kSteps, global, kSeq, kVocab, 99);
  const auto ref = reference(data);

  torch::manual_seed(7);
  models::GPT gpt(small_gpt());
  gpt->to(torch::kDouble);
  std::optional<parallel::tensor::TensorParallelPlan> plan;
  if (c.tp > 1) plan = parallel::tensor::parallelize_tensor(*gpt, mesh.tp());
  pl::PipelineOptions po;
  po.schedule = c.schedule;
  po.microbatches = c.m;
  po.virtual_stages = c.v;
  po.micro_batch = kMicro;
  pl::Pipeline pipe(gpt.ptr(), mesh.pp(), &mesh.dp(), po, world().group().get());

  std::vector<std::shared_ptr<pl::ShardedRunner>> sharded;
  if (c.mode == Dp::Ddp) {
    std::vector<std::shared_ptr<pl::ChunkRunner>> rs;
    for (const auto& ch : pipe.chunks()) rs.push_back(std::make_shared<pl::DdpRunner>(ch, mesh.dp(), parallel::DDPOptions{}));
    pipe.set_runners(rs);
  } else if (c.mode == Dp::Zero3) {
    std::vector<std::shared_ptr<pl::ChunkRunner>> rs;
    for (const auto& ch : pipe.chunks()) {
      parallel::fsdp::ShardedOptions so;
      so.sharding = parallel::fsdp::Sharding::Zero3;
      sharded.push_back(std::make_shared<pl::ShardedRunner>(ch, world(), mesh.dp(), nullptr, so));
      rs.push_back(sharded.back());
    }
    pipe.set_runners(rs);
  }

  // What the optimizer updates, and how each enters the global norm.
  std::vector<at::Tensor> params, counted, shared;
  std::vector<int64_t> decay;
  if (c.mode == Dp::Zero3) {
    for (auto& r : sharded) {
      for (auto& s : r->engine().shards()) params.push_back(s);
      for (auto d : r->engine().shard_decay_numel()) decay.push_back(d);
    }
    counted = params;  // shards partition each stage's gradient over dp
  } else {
    for (const auto& ch : pipe.chunks())
      for (auto& item : ch->named_parameters()) {
        const at::Tensor& p = item.value();
        params.push_back(p);
        decay.push_back(p.dim() >= 2 ? p.numel() : 0);
        bool split = false;
        if (plan)
          for (auto& l : plan->params)
            if (l.name == item.key()) split = l.sharded();
        (plan && !split ? shared : counted).push_back(p);
      }
  }
  std::vector<comm::Group*> norm_groups{&mesh.pp()};
  if (c.tp > 1) norm_groups.push_back(&mesh.tp());
  if (c.mode == Dp::Zero3) norm_groups.push_back(&mesh.dp());
  optim::AdamW opt(params, decay, adam());

  const int d = mesh.coord().dp(mesh.dims());
  int clipped = 0;
  for (const Batch& b : data) {
    std::vector<at::Tensor> xs, ys;
    for (int k = 0; k < c.m; ++k) {
      const int64_t at = (static_cast<int64_t>(d) * c.m + k) * kMicro;
      xs.push_back(b.x.narrow(0, at, kMicro).contiguous());
      ys.push_back(b.y.narrow(0, at, kMicro).contiguous());
    }
    const double loss = pipe.step(xs, ys);
    EXPECT_TRUE(std::isfinite(loss));
    const double norm = pl::clip_grad_norm(counted, shared, c.tp, norm_groups, kMaxNorm);
    clipped += norm > kMaxNorm;
    opt.step(adam().lr);
    for (auto& r : sharded) r->engine().after_step();
    for (auto& p : params) p.mutable_grad().reset();
    for (auto& r : sharded) r->engine().zero_grad();
    pipe.zero_grad();
  }

  EXPECT_GE(clipped, 3) << "clipping must act for the test to cover it";
  // This stage's final parameters, whole, against the reference's.
  std::vector<at::Tensor> mine, theirs;
  for (size_t j = 0; j < pipe.chunks().size(); ++j) {
    const auto& ch = pipe.chunks()[j];
    auto named = ch->named_parameters();
    std::vector<at::Tensor> values;
    if (c.mode == Dp::Zero3) values = sharded[j]->engine().full_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      at::Tensor v = c.mode == Dp::Zero3 ? values[i] : named[i].value().detach();
      if (plan)
        for (auto& l : plan->params)
          if (l.name == named[i].key() && l.sharded()) v = parallel::tensor::gather_parameter(v, l, mesh.tp());
      ASSERT_TRUE(ref.count(named[i].key())) << named[i].key();
      mine.push_back(v);
      theirs.push_back(ref.at(named[i].key()));
    }
  }
  ASSERT_FALSE(mine.empty());
  const double diff = relative_diff(mine, theirs, /*per_tensor=*/true);
  if (world().rank() == 0 || mesh.coord().pp == c.pp - 1)
    std::printf("[pipeline] %s stage %d: max relative difference %.2e over %zu tensors\n", describe(c).c_str(),
                mesh.coord().pp, diff, mine.size());
  EXPECT_LE(diff, kTol);
}

TEST(Pipeline, EverySchedule) {
  for (const Case& c : {Case{pl::Schedule::GPipe, 4}, Case{pl::Schedule::OneFOneB, 4},
                        Case{pl::Schedule::OneFOneB, 1},  // plain layer-wise model parallelism
                        Case{pl::Schedule::OneFOneB, 6}, Case{pl::Schedule::Interleaved, 4, 2}})
    run_case(c);
}

TEST(Pipeline, WithDataAndTensorParallel) {
  ASSERT_EQ(world().size(), 4) << "registered on 4 ranks only";
  run_case({pl::Schedule::OneFOneB, 4, 1, 2, 2, 1, Dp::Ddp});
  run_case({pl::Schedule::Interleaved, 2, 2, 2, 2, 1, Dp::Ddp});
  run_case({pl::Schedule::OneFOneB, 4, 1, 2, 1, 2, Dp::None});
  run_case({pl::Schedule::GPipe, 4, 1, 2, 2, 1, Dp::Zero3});
  run_case({pl::Schedule::OneFOneB, 4, 1, 2, 2, 1, Dp::Zero3});
}

TEST(Pipeline, StagesThatDisagreeFailTogether) {
  comm::Mesh mesh(world(), comm::MeshDims{world().size(), 1, 1, 1});
  torch::manual_seed(7);
  models::GPT gpt(small_gpt());
  pl::PipelineOptions po;
  po.microbatches = 2;
  po.micro_batch = mesh.coord().pp == 1 ? 3 : kMicro;  // one stage expects another shape
  pl::Pipeline pipe(gpt.ptr(), mesh.pp(), nullptr, po);
  std::vector<at::Tensor> xs(2, torch::zeros({po.micro_batch, kSeq}, torch::kLong)), ys = xs;
  try {
    pipe.step(xs, ys);
    FAIL() << "a shape mismatch between stages must be an error";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("disagree"), std::string::npos) << e.what();
  }
}

TEST(Pipeline, TooFewMicroBatchesForInterleaved) {
  comm::Mesh mesh(world(), comm::MeshDims{world().size(), 1, 1, 1});
  models::GPT gpt(small_gpt());
  pl::PipelineOptions po;
  po.schedule = pl::Schedule::Interleaved;
  po.virtual_stages = 2;
  po.microbatches = world().size() + 1;
  EXPECT_THROW(pl::Pipeline(gpt.ptr(), mesh.pp(), nullptr, po), UsageError);
}

}  // namespace
}  // namespace scaletrain::test

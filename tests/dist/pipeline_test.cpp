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
#include "parity.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/pipeline/data_parallel.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace pipeline_test {

namespace pl = parallel::pipeline;

constexpr int64_t kSeq = 16, kVocab = 64, kMicro = pipeline_parity::kMicro;

// 8 blocks: enough for 4 stages x 2 virtual stages.
models::GPTConfig small_gpt() { return models::GPTConfig{kVocab, kSeq, 8, 4, 32}; }

using pipeline_parity::Case;
using pipeline_parity::Dp;

models::ModelPtr make_gpt() {
  torch::manual_seed(7);
  models::GPT gpt(small_gpt());
  gpt->to(torch::kDouble);
  return gpt.ptr();
}

void run_case(const Case& c) { pipeline_parity::run_case(make_gpt, c, kSeq, kVocab); }

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

// zero_grad means what it says: after it no gradient of this stage's chunks
// (nor of the tied head's copy on the last stage) holds anything.
TEST(Pipeline, ZeroGradClearsEveryStageGradient) {
  comm::Mesh mesh(world(), comm::MeshDims{world().size(), 1, 1, 1});
  models::ModelPtr gpt = make_gpt();
  pl::PipelineOptions po;
  po.microbatches = 2;
  po.micro_batch = kMicro;
  pl::Pipeline pipe(gpt, mesh.pp(), nullptr, po);
  auto g = at::detail::createCPUGenerator(3);
  std::vector<at::Tensor> xs, ys;
  for (int k = 0; k < 2; ++k) {
    xs.push_back(at::randint(kVocab, {kMicro, kSeq}, g, at::kLong));
    ys.push_back(at::randint(kVocab, {kMicro, kSeq}, g, at::kLong));
  }
  pipe.step(xs, ys);
  auto grad_sum = [&] {
    double sum = 0;
    for (const auto& chunk : pipe.chunks())
      for (const auto& p : chunk->parameters())
        if (p.grad().defined()) sum += p.grad().abs().sum().item<double>();
    return sum;
  };
  EXPECT_GT(grad_sum(), 0);
  pipe.zero_grad();
  EXPECT_EQ(grad_sum(), 0) << "zero_grad left gradients in the stage's chunks";
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

}  // namespace pipeline_test
}  // namespace scaletrain::test

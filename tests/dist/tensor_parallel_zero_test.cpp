// ZeRO-1/2/3 and the FSDP strategies composed with tensor parallelism on a
// DP2 x TP2 mesh (4 ranks) against the single-process reference (DESIGN: the
// invariant): the sharded engine shards each tp rank's part of the model over
// its data-parallel group (Note [Sharding tensor-parallel parameters] in
// parallel/fsdp/fsdp.h). After 5 AdamW steps with clipping that acts, the
// parameters, gathered over dp (the engine) and over tp (the plan), equal
// the single-process ones; the clipped norm equals the single-process norm.
// fp64 for the reason in tensor_parallel_test.cpp. Also: deferred
// initialization splits exactly like an eager build, and sampling a
// tensor-parallel model gives the single-process text.
//
// Suite names avoid "TensorParallel" and "Sharded": other ctest filters
// ("TensorParallel*", "*Sharded*") run on world sizes this mesh does not fit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/parallel/zero/zero.h"

namespace scaletrain::test {
namespace tensor_parallel_zero_test {

namespace tp = parallel::tensor;
using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::ShardedOptions;
using parallel::fsdp::Sharding;

constexpr int64_t kBatch = 12, kSeq = 16, kVocab = 62;  // batch: dp 2 x 2 micro-batches x 3
constexpr int kSteps = 5;
constexpr double kLr = 1e-2, kMaxNorm = 0.5, kTol = 1e-5;

// tp 2 divides the vocabulary (62) and the heads (2); no flat buffer of a tp
// rank's part divides evenly by dp 2 (odd widths).
models::GPTConfig gpt() { return models::GPTConfig{kVocab, kSeq, 3, 2, 26}; }

comm::Mesh& mesh() {
  // Group names are per layout: one mesh for the whole binary.
  static comm::Mesh m(world(), comm::MeshDims{1, 1, 2, 2});
  return m;
}

bool on_mesh() { return world().size() == 4; }

models::GPT make_model(at::ScalarType dtype) {
  torch::manual_seed(42);
  auto m = models::GPT(gpt());
  m->to(dtype);
  return m;
}

struct Trained {
  std::vector<at::Tensor> params;  // full, in named_parameters() order
  std::vector<double> norms;       // before clipping, per step
};

Trained train_reference(const std::vector<Batch>& data) {
  auto model = make_model(at::kDouble);
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  Trained out;
  for (auto& b : data) {
    model->loss(b.x, b.y).backward();
    out.norms.push_back(optim::clip_grad_norm(params, kMaxNorm));
    opt.step(kLr);
    opt.zero_grad();
  }
  out.params = model->parameters();
  return out;
}

// Which parameters tp splits: their squared norms add over tp.
parallel::fsdp::NormSplit norm_split(const tp::TensorParallelPlan& plan) {
  std::set<std::string> split;
  for (auto& l : plan.params)
    if (l.sharded()) split.insert(l.name);
  return {plan.tp, [split](const std::string& name) { return split.count(name) > 0; }};
}

struct Spec {
  ShardedOptions options;
  bool sp = false;      // sequence parallelism
  int accum = 1;        // micro-batches per step
  bool no_sync = true;  // accumulate locally before the last micro-batch
};

// Tensor parallelism first, then the sharded engine over this tp rank's dp group.
Trained train_dp_tp(const std::vector<Batch>& data, const Spec& spec) {
  auto model = make_model(at::kDouble);
  tp::TensorParallelOptions to;
  to.sequence_parallel = spec.sp;
  const auto plan = tp::parallelize_tensor(*model, mesh().tp(), to);
  ShardedDataParallel engine(model.ptr(), *model, world(), mesh().dp(), nullptr, spec.options);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  const auto split = norm_split(plan);
  const int64_t local = kBatch / mesh().dp().size(), micro = local / spec.accum;
  Trained out;
  for (auto& b : data) {
    for (int k = 0; k < spec.accum; ++k) {
      const int64_t start = mesh().dp().rank() * local + k * micro;
      auto x = b.x.narrow(0, start, micro), y = b.y.narrow(0, start, micro);
      auto loss = engine.forward([&] { return model->loss(x, y); }) / spec.accum;
      if (k + 1 < spec.accum && spec.no_sync) {
        auto guard = engine.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    out.norms.push_back(engine.clip_grad_norm(kMaxNorm, split));
    opt.step(kLr);
    engine.after_step();
    engine.zero_grad();
  }
  auto local_full = engine.full_parameters();  // whole over dp, this tp rank's part
  for (size_t i = 0; i < local_full.size(); ++i)
    out.params.push_back(tp::gather_parameter(local_full[i], plan.params[i], mesh().tp()));
  return out;
}

void expect_parity(const Spec& spec, const std::string& what) {
  auto data = make_batches(kSteps, kBatch, kSeq, kVocab, 4321);
  const Trained ref = train_reference(data);
  const Trained got = train_dp_tp(data, spec);
  ASSERT_EQ(got.params.size(), ref.params.size());
  const double diff = relative_diff(got.params, ref.params, /*per_tensor=*/true);
  EXPECT_LE(diff, kTol) << what;
  ASSERT_EQ(got.norms.size(), ref.norms.size());
  for (size_t s = 0; s < ref.norms.size(); ++s)
    EXPECT_NEAR(got.norms[s], ref.norms[s], 1e-9 * ref.norms[s]) << what << " step " << s + 1;
  // Clipping acted (a wrong global norm would show), and the weights moved.
  EXPECT_GT(ref.norms[0], kMaxNorm);
  expect_weights_moved(got.params, make_model(at::kDouble)->parameters(), kLr, kSteps, what);
  if (world().rank() == 0) std::printf("[parity] dp2 x tp2 %-36s max relative diff %.3g\n", what.c_str(), diff);
}

ShardedOptions zero(int stage) {
  parallel::zero::ZeroOptions z;
  z.stage = stage;
  z.reduce_bucket_numel = 6000;  // stage 1/2: several buckets, the last blocks in the root
  return parallel::zero::sharded_options(z);
}

ShardedOptions fsdp(Sharding s) {
  ShardedOptions o;
  o.sharding = s;
  return o;
}

// Each strategy with and without sequence parallelism, one micro-batch, and
// with two as the trainer runs them (ZeRO-2/3 reduce every micro-batch).
void expect_parity_all(const ShardedOptions& o, const std::string& name, bool reduce_every_micro) {
  for (bool sp : {false, true}) {
    Spec spec{o, sp};
    const std::string label = name + (sp ? " sequence-parallel" : "");
    expect_parity(spec, label);
    spec.accum = 2;
    spec.no_sync = !reduce_every_micro;
    expect_parity(spec, label + " accumulation 2");
  }
}

TEST(TpZero, Zero1MatchesSingleProcess) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  expect_parity_all(zero(1), "zero1", false);
}

TEST(TpZero, Zero2MatchesSingleProcess) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  expect_parity_all(zero(2), "zero2", true);
}

TEST(TpZero, Zero3MatchesSingleProcess) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  expect_parity_all(zero(3), "zero3", true);
}

TEST(TpZero, FsdpStrategiesMatchSingleProcess) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  expect_parity_all(fsdp(Sharding::FullShard), "FULL_SHARD", false);
  expect_parity_all(fsdp(Sharding::ShardGradOp), "SHARD_GRAD_OP", false);
}

// The clipped norm without the split (every square counted once per tp rank)
// differs: the test above would notice a NormSplit that did nothing.
TEST(TpZero, NormWithoutTheSplitIsWrong) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  auto data = make_batches(1, kBatch, kSeq, kVocab, 4321);
  const double want = train_reference(data).norms[0];
  auto model = make_model(at::kDouble);
  const auto plan = tp::parallelize_tensor(*model, mesh().tp());
  ShardedDataParallel engine(model.ptr(), *model, world(), mesh().dp(), nullptr, zero(3));
  const int64_t local = kBatch / 2, start = mesh().dp().rank() * local;
  engine.forward([&] { return model->loss(data[0].x.narrow(0, start, local), data[0].y.narrow(0, start, local)); })
      .backward();
  const double dp_only = engine.clip_grad_norm(0);
  const double with_split = engine.clip_grad_norm(0, norm_split(plan));
  EXPECT_NEAR(with_split, want, 1e-9 * want);
  EXPECT_GT(std::abs(dp_only - want), 1e-3 * want);
}

// Deferred initialization (the trainer's zero3): the model never exists
// whole, is split in shape, and each full tensor is drawn and split as it is
// initialized; every rank ends with exactly the eager model's part.
TEST(TpZero, DeferredInitializationSplitsLikeTheEagerModel) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  const auto eager = make_model(at::kFloat)->parameters();
  for (bool sync : {true, false}) {
    torch::manual_seed(42);
    auto model = models::GPT(gpt(), /*materialize=*/false);
    tp::TensorParallelOptions to;
    to.deferred = true;
    const auto plan = tp::parallelize_tensor(*model, mesh().tp(), to);
    ShardedOptions o = zero(3);
    o.sync_module_states = sync;
    o.deferred_init = tp::tensor_parallel_init(
        [raw = model.get()](const std::string& name, at::Tensor& t) { raw->init_parameter(name, t); }, plan);
    ShardedDataParallel engine(model.ptr(), *model, world(), mesh().dp(), nullptr, o);
    auto local = engine.full_parameters();
    ASSERT_EQ(local.size(), eager.size());
    for (size_t i = 0; i < local.size(); ++i) {
      const auto& l = plan.params[i];
      EXPECT_TRUE(torch::equal(local[i], tp::split_parameter(eager[i], l, mesh().tp().rank(), 2)))
          << l.name << " sync " << sync;
      EXPECT_TRUE(torch::equal(tp::gather_parameter(local[i], l, mesh().tp()), eager[i])) << l.name;
    }
  }
  // A materialized model refuses the deferred option, and the other way round.
  auto whole = make_model(at::kFloat);
  tp::TensorParallelOptions to;
  to.deferred = true;
  EXPECT_THROW(tp::parallelize_tensor(*whole, mesh().tp(), to), std::exception);
}

// Sampling: tp ranks compute together (the logits hook gathers the
// vocabulary) and continue with tp rank 0's token; the text equals the
// single-process model's for the same seed. Under sequence parallelism the
// context may have any length (generate() uses the plain TP hooks). Also
// through the sharded engine's FullParams, as the trainer samples.
TEST(TpSampling, TextEqualsTheSingleProcessModel) {
  if (!on_mesh()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  auto prompt = torch::tensor(std::vector<int64_t>{3, 14, 15, 9}, torch::kLong).view({1, -1});
  auto sample = [&](models::GPT& m) {
    m->eval();
    torch::manual_seed(7);
    return m->generate(prompt, 24, 0.8, 10);
  };
  auto ref_model = make_model(at::kFloat);
  const at::Tensor want = sample(ref_model);
  ASSERT_EQ(want.size(1), 28);
  for (bool sp : {false, true}) {
    for (bool engine : {false, true}) {
      SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "1" : "0") + " engine=" + (engine ? "1" : "0"));
      auto model = make_model(at::kFloat);
      tp::TensorParallelOptions to;
      to.sequence_parallel = sp;
      tp::parallelize_tensor(*model, mesh().tp(), to);
      at::Tensor got;
      if (engine) {
        ShardedDataParallel e(model.ptr(), *model, world(), mesh().dp(), nullptr, zero(3));
        ShardedDataParallel::FullParams full(e);
        got = sample(model);
      } else {
        got = sample(model);
      }
      EXPECT_TRUE(torch::equal(got, want)) << got << "\nwant\n" << want;
      // The training hooks are back: a sequence-parallel forward still splits T.
      if (sp) EXPECT_THROW(model->forward(torch::zeros({1, 3}, torch::kLong)), std::exception);
    }
  }
}

}  // namespace tensor_parallel_zero_test
}  // namespace scaletrain::test

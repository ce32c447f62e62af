// Tensor parallelism against the single-process reference (DESIGN: the
// invariant). Run on 2 ranks (TP=2) and 4 ranks (TP=4, and DP2 x TP2 on a
// mesh): the world group is the tp group unless a test says otherwise.
//
// Every rank builds the same full tensors from the same seed, computes the
// reference locally, and checks its own shard (or the gathered whole)
// against it. Forward and gradient parity run in fp32 at 1e-5 relative; the
// 5-step training runs in fp64, for the reason in ddp_test.cpp's Note [Adam
// amplifies summation order]: TP sums partial products in another order
// (~1e-7 relative in fp32), and Adam divides each update by the gradient's
// own RMS, which turns that rounding into visible update differences where
// gradients are near zero. fp64 makes the comparison test the algorithm.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "parity.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/tensor/layers.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/parallel/tensor/tp_comm.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace tensor_parallel_test {

namespace tp = parallel::tensor;

constexpr double kTol = 1e-5;
constexpr int64_t kBatch = 8, kSeq = 16, kVocab = 64;

comm::Group& tp_group() { return *world().group(); }

// vocab 64, block 16, 2 layers, 4 heads, width 32: divisible by tp = 2 and 4.
models::GPTConfig small_gpt() { return models::GPTConfig{kVocab, kSeq, 2, 4, 32}; }

// max|a - b| / max|b|.
double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-12);
}

at::Tensor randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(shape, gen, dtype);
}

at::Tensor mine(const at::Tensor& x, int64_t dim) { return tp::chunk_of(x, dim, tp_group().rank(), tp_group().size()); }

at::Tensor leaf(const at::Tensor& x) { return x.detach().clone().requires_grad_(true); }

TEST(TensorParallelComm, OperatorsAndTheirAdjoints) {
  auto& g = tp_group();
  const int r = g.rank(), n = g.size();
  auto x = leaf(torch::full({2, 4 * n, 3}, static_cast<float>(r + 1)));
  // f: identity forward, all-reduce backward.
  auto y = tp::copy_to_tp_region(x, g);
  EXPECT_TRUE(torch::equal(y, x));
  (y * (r + 1)).sum().backward();
  EXPECT_FLOAT_EQ(x.grad()[0][0][0].item<float>(), n * (n + 1) / 2.0f);
  // g: all-reduce forward, identity backward.
  x.mutable_grad() = at::Tensor();
  auto z = tp::reduce_from_tp_region(x, g);
  EXPECT_FLOAT_EQ(z[0][0][0].item<float>(), n * (n + 1) / 2.0f);
  z.sum().backward();
  EXPECT_FLOAT_EQ(x.grad()[1][2][2].item<float>(), 1.0f);
  // gather_from_sequence: rank i's chunk lands at [i * 4n, (i+1) * 4n) along dim 1.
  x.mutable_grad() = at::Tensor();
  auto gathered = tp::gather_from_sequence(x, g, 1);
  ASSERT_EQ(gathered.size(1), 4 * n * n);
  for (int i = 0; i < n; ++i) EXPECT_FLOAT_EQ(gathered[1][i * 4 * n][2].item<float>(), i + 1.0f);
  (gathered * (r + 1)).sum().backward();  // backward reduce-scatters: sum over ranks of (r + 1)
  EXPECT_FLOAT_EQ(x.grad()[0][1][0].item<float>(), n * (n + 1) / 2.0f);
  // reduce_scatter_to_sequence: sum, and this rank's quarter of dim 1.
  x.mutable_grad() = at::Tensor();
  auto scattered = tp::reduce_scatter_to_sequence(x, g, 1);
  ASSERT_EQ(scattered.size(1), 4);
  EXPECT_FLOAT_EQ(scattered[0][0][0].item<float>(), n * (n + 1) / 2.0f);
  (scattered * (r + 1)).sum().backward();  // backward all-gathers: chunk i carries (i + 1)
  for (int i = 0; i < n; ++i) EXPECT_FLOAT_EQ(x.grad()[0][4 * i][0].item<float>(), i + 1.0f);
  // scatter / gather along the last dimension are inverses.
  auto full = randn({3, 2 * n}, 7);
  EXPECT_TRUE(torch::equal(tp::gather_from_tp_region(tp::scatter_to_tp_region(full, g, -1), g, -1), full));
  // Uneven splits fail with one line naming the degree.
  if (n > 1) {
    try {
      (void)tp::reduce_scatter_to_sequence(torch::ones({1, 4 * n + 1, 2}), g, 1);
      ADD_FAILURE() << "no error for an uneven sequence";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("tp=" + std::to_string(n)), std::string::npos) << e.what();
    }
  }
}

TEST(TensorParallelLayers, ColumnParallelLinearMatchesFull) {
  auto& g = tp_group();
  const int64_t in = 12, out = 8 * g.size();
  auto W = leaf(randn({out, in}, 1)), b = leaf(randn({out}, 2)), x = leaf(randn({2, kSeq, in}, 3));
  auto R = randn({2, kSeq, out}, 4);  // d loss / d output
  (torch::linear(x, W, b) * R).sum().backward();
  for (bool sp : {false, true}) {
    for (bool gather : {false, true}) {
      SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "1" : "0") + " gather_output=" + (gather ? "1" : "0"));
      auto w = leaf(mine(W, 0)), bb = leaf(mine(b, 0)), xi = leaf(sp ? mine(x, 1) : x);
      auto y = tp::column_parallel_linear(xi, w, bb, g, sp, gather);
      auto want = torch::linear(x, W, b);
      EXPECT_LE(rel(y, gather ? want : mine(want, -1)), kTol);
      // Sharded outputs: each rank's loss is its part of the full loss.
      // Gathered outputs are replicated: every rank holds the whole loss.
      (y * (gather ? R : mine(R, -1))).sum().backward();
      EXPECT_LE(rel(w.grad(), mine(W.grad(), 0)), kTol);
      EXPECT_LE(rel(bb.grad(), mine(b.grad(), 0)), kTol);
      EXPECT_LE(rel(xi.grad(), sp ? mine(x.grad(), 1) : x.grad()), kTol);
    }
  }
}

TEST(TensorParallelLayers, RowParallelLinearMatchesFull) {
  auto& g = tp_group();
  const int64_t in = 8 * g.size(), out = 12;
  auto W = leaf(randn({out, in}, 5)), b = leaf(randn({out}, 6)), x = leaf(randn({2, kSeq, in}, 7));
  auto R = randn({2, kSeq, out}, 8);
  auto want = torch::linear(x, W, b);
  (want * R).sum().backward();
  for (bool sp : {false, true}) {
    SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "1" : "0"));
    auto w = leaf(mine(W, 1)), bb = leaf(b), xi = leaf(mine(x, -1));
    auto y = tp::row_parallel_linear(xi, w, bb, g, sp);
    EXPECT_LE(rel(y, sp ? mine(want, 1) : want), kTol);
    // Replicated output: every rank holds the whole loss (identity backward).
    (y * (sp ? mine(R, 1) : R)).sum().backward();
    EXPECT_LE(rel(w.grad(), mine(W.grad(), 1)), kTol);
    EXPECT_LE(rel(xi.grad(), mine(x.grad(), -1)), kTol);
    // Under SP the bias sees this rank's tokens only: its gradient is partial.
    auto gb = bb.grad().clone();
    if (sp) tp::all_reduce_(gb, g);
    EXPECT_LE(rel(gb, b.grad()), kTol);
  }
}

TEST(TensorParallelLayers, VocabParallelEmbeddingMatchesFull) {
  auto& g = tp_group();
  auto E = leaf(randn({kVocab, 10}, 9));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(10);
  auto idx = torch::randint(0, kVocab, {3, kSeq}, gen, torch::kLong);
  auto R = randn({3, kSeq, 10}, 11);
  auto want = torch::embedding(E, idx);
  (want * R).sum().backward();
  for (bool sp : {false, true}) {
    SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "1" : "0"));
    auto e = leaf(mine(E, 0));
    auto y = tp::vocab_parallel_embedding(idx, e, g, sp);
    EXPECT_LE(rel(y, sp ? mine(want, 1) : want), kTol);
    (y * (sp ? mine(R, 1) : R)).sum().backward();
    EXPECT_LE(rel(e.grad(), mine(E.grad(), 0)), kTol);
  }
}

TEST(TensorParallelLayers, VocabParallelCrossEntropyMatchesFull) {
  auto& g = tp_group();
  auto Z = leaf(randn({5, 7, kVocab}, 12) * 4);  // spread logits: a peaked softmax
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  auto t = torch::randint(0, kVocab, {5, 7}, gen, torch::kLong);
  auto R = randn({5, 7}, 14);
  auto want =
      torch::nn::functional::cross_entropy(Z.view({-1, kVocab}), t.view({-1}),
                                           torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
          .view({5, 7});
  (want * R).sum().backward();
  auto z = leaf(mine(Z, -1));
  auto loss = tp::vocab_parallel_cross_entropy(z, t, g);
  EXPECT_LE(rel(loss, want), kTol);
  (loss * R).sum().backward();
  EXPECT_LE(rel(z.grad(), mine(Z.grad(), -1)), kTol);
}

std::vector<Batch> make_data(int steps) { return make_batches(steps, kBatch, kSeq, kVocab, 1234); }

models::GPT make_model(at::ScalarType dtype, bool fused = true) {
  torch::manual_seed(42);
  auto config = small_gpt();
  config.fused = fused;
  auto m = models::GPT(config);
  m->to(dtype);
  return m;
}

// The fused head + loss reduces over the vocabulary split (Note [A
// vocabulary split across ranks]); the unfused one calls the hooks' loss.
// Both against the unfused single process.
TEST(TensorParallelGPT, OutputsAndGradientsMatchSingleProcess) {
  auto data = make_data(1);
  auto ref = make_model(at::kFloat, false);
  auto ref_logits = ref->forward(data[0].x);
  auto ref_loss = ref->loss(data[0].x, data[0].y);
  ref_loss.backward();
  auto ref_params = ref->named_parameters();
  for (bool sp : {false, true})
    for (bool fused : {true, false}) {
      SCOPED_TRACE(std::string("sequence_parallel=") + (sp ? "1" : "0") + " fused=" + (fused ? "1" : "0"));
      auto model = make_model(at::kFloat, fused);
      tp::TensorParallelOptions o;
      o.sequence_parallel = sp;
      auto plan = tp::parallelize_tensor(*model, tp_group(), o);
      // Each rank computes heads n_head / tp.
      EXPECT_EQ((*model->h)[0]->as<models::Block>()->attn->local_heads(), small_gpt().n_head / tp_group().size());
      EXPECT_LE(rel(model->forward(data[0].x), ref_logits), kTol);
      auto loss = model->loss(data[0].x, data[0].y);
      EXPECT_LE(rel(loss, ref_loss), kTol);
      loss.backward();
      auto params = model->named_parameters();
      ASSERT_EQ(params.size(), ref_params.size());
      double worst = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        auto grad = tp::gather_parameter(params[i].value().grad(), plan.params[i], tp_group());
        const double d = rel(grad, ref_params[i].value().grad());
        EXPECT_LE(d, kTol) << params[i].key();
        worst = std::max(worst, d);
      }
      if (world().rank() == 0)
        std::printf("[parity] fp32 tp=%d%s%s: gradients max relative diff %.3g\n", tp_group().size(),
                    sp ? " sequence-parallel" : "", fused ? " fused head" : "", worst);
    }
}

constexpr int kSteps = 5;
constexpr double kLr = 1e-2, kMaxNorm = 0.5;

// 5 AdamW steps with clipping in fp64 (parity.h). tp == nullptr: one
// process, full batch. dp: data parallelism over the batch (DDP), composed with tp.
Trained train(const std::vector<Batch>& data, comm::Group* tpg, comm::Group* dp, bool sp) {
  return train_tensor_parallel(make_model(at::kDouble).ptr(), data, tpg, dp, sp, kMaxNorm, kLr);
}

void expect_same_training(const Trained& got, const Trained& ref, const std::string& what) {
  ASSERT_EQ(got.params.size(), ref.params.size());
  double worst = 0;
  for (size_t i = 0; i < got.params.size(); ++i) worst = std::max(worst, rel(got.params[i], ref.params[i]));
  EXPECT_LE(worst, kTol) << what;
  for (size_t s = 0; s < ref.norms.size(); ++s) EXPECT_NEAR(got.norms[s], ref.norms[s], 1e-9 * ref.norms[s]) << what;
  // Clipping was active, and the weights moved: the comparison is not empty.
  EXPECT_GT(ref.norms[0], kMaxNorm);
  expect_weights_moved(got.params, make_model(at::kDouble)->parameters(), kLr, kSteps, what);
  if (world().rank() == 0) std::printf("[parity] %s: max relative diff %.3g\n", what.c_str(), worst);
}

TEST(TensorParallelGPT, FiveAdamWStepsMatchSingleProcess) {
  auto data = make_data(kSteps);
  auto ref = train(data, nullptr, nullptr, false);
  for (bool sp : {false, true})
    expect_same_training(train(data, &tp_group(), nullptr, sp), ref,
                         "tp=" + std::to_string(tp_group().size()) + (sp ? " sequence-parallel" : ""));
}

TEST(TensorParallelGPT, DataTimesTensorParallelMatchesSingleProcess) {
  if (world().size() != 4) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  // Note: mesh group names ("mesh/tp/0", ...) are per layout; build this one once.
  static comm::Mesh mesh(world(), comm::MeshDims{1, 1, 2, 2});
  ASSERT_EQ(mesh.tp().size(), 2);
  ASSERT_EQ(mesh.dp().size(), 2);
  auto data = make_data(kSteps);
  auto ref = train(data, nullptr, nullptr, false);
  for (bool sp : {false, true})
    expect_same_training(train(data, &mesh.tp(), &mesh.dp(), sp), ref,
                         std::string("dp2 x tp2") + (sp ? " sequence-parallel" : ""));
}

TEST(TensorParallelGPT, ImpossibleLayoutFailsWithOneLine) {
  const int n = tp_group().size();
  auto expect_error = [&](models::GPTConfig c, const std::string& dimension) {
    torch::manual_seed(0);
    auto model = models::GPT(c);
    try {
      tp::parallelize_tensor(*model, tp_group());
      ADD_FAILURE() << "no error for " << dimension;
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tp=" + std::to_string(n)), std::string::npos) << msg;
      EXPECT_NE(msg.find(dimension), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  };
  if (n > 1) {
    expect_error(models::GPTConfig{kVocab, kSeq, 1, 3, 24}, "model.n_head=3");
    expect_error(models::GPTConfig{kVocab + 1, kSeq, 1, 4, 32}, "model.vocab_size=65");
  }
  EXPECT_THROW(scaletrain::models::check_tensor_parallel(small_gpt(), 3), UsageError);
  EXPECT_NO_THROW(scaletrain::models::check_tensor_parallel(small_gpt(), 4));
  // Sequence parallelism with a sequence tp does not divide.
  if (n > 1) {
    auto model = make_model(at::kFloat);
    tp::TensorParallelOptions o;
    o.sequence_parallel = true;
    tp::parallelize_tensor(*model, tp_group(), o);
    auto idx = torch::zeros({1, n + 1}, torch::kLong);
    EXPECT_THROW(model->forward(idx), UsageError);
  }
}

}  // namespace tensor_parallel_test
}  // namespace scaletrain::test

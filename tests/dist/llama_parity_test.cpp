// The Llama family against the single-process reference (DESIGN: the
// invariant), in fp64, with the loops the GPT-2 tests run (parity.h): same
// initial weights and the same global batch give the same parameters after 5
// AdamW steps with clipping that acts, to 1e-5 relative per tensor.
//
// What Llama adds over GPT-2 and these cover: grouped-query attention (k and v
// have fewer heads than q; tensor parallelism must keep each rank's kv heads
// with the query heads they serve), separate q/k/v and a gated MLP (three
// column-parallel and two row-parallel linears per block), RMSNorm and rotary
// embeddings (replicated, partial gradients under sequence parallelism),
// optional biases, and a head that is its own matrix or the token embedding
// (tied: shared by the first and last pipeline stage).
//
// Suites: LlamaShard (ZeRO-1/2/3, FULL_SHARD, SHARD_GRAD_OP; activation
// checkpointing) on 2, 3 and 4 ranks; LlamaTp (TP=2 and TP=4 with and without
// sequence parallelism, DP2 x TP2, the layout TP=4 cannot split) on 2 and 4;
// LlamaPipeline (every schedule, tied and untied head; DP2 x PP2, TP2 x PP2,
// ZeRO-3 in PP2) on 2 and 4. The names avoid "Sharded", "TensorParallel" and
// "Pipeline" at the start: other ctest filters select those.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "parity.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace llama_parity_test {

using parallel::fsdp::Sharding;
namespace tp = parallel::tensor;

constexpr int kSteps = 5;
constexpr double kLr = 1e-2, kTol = 1e-5;

struct Llama {
  int64_t vocab, seq, layers, heads, kv_heads, width, mlp;
  bool tied = false;
  bool attention_bias = false;  // q, k, v and o
  bool mlp_bias = false;        // gate, up and down

  models::ModelConfig config() const {
    models::ModelConfig c;
    c.family = "llama";
    c.vocab_size = vocab;
    c.block_size = seq;
    c.n_layer = layers;
    c.n_head = heads;
    c.n_kv_head = kv_heads;
    c.n_embd = width;
    c.intermediate_size = mlp;
    c.tie_word_embeddings = tied;
    c.attention_bias = attention_bias;
    c.mlp_bias = mlp_bias;
    return c;
  }
  // The same fp64 weights on every call and every rank.
  ModelFactory factory(uint64_t seed = 42) const {
    const auto c = config();
    return [c, seed] {
      torch::manual_seed(seed);
      auto m = models::make_model(c);
      m->to(at::kDouble);
      return m;
    };
  }
};

// The single-process run, checked against: parameters to kTol per tensor, the
// global norm of every step to 1e-9, clipping acting, the weights moving.
void expect_same(const Trained& got, const Trained& ref, const ModelFactory& make, double clip,
                 const std::string& what) {
  ASSERT_EQ(got.params.size(), ref.params.size()) << what;
  const double diff = relative_diff(got.params, ref.params, /*per_tensor=*/true);
  EXPECT_LE(diff, kTol) << what << " on " << world().size() << " ranks";
  ASSERT_EQ(got.norms.size(), ref.norms.size()) << what;
  int clipped = 0;
  for (size_t s = 0; s < ref.norms.size(); ++s) {
    EXPECT_NEAR(got.norms[s], ref.norms[s], 1e-9 * ref.norms[s]) << what << " step " << s + 1;
    clipped += ref.norms[s] > clip;
  }
  EXPECT_GT(clipped, 0) << what << ": clipping never acted: the test would not notice a wrong global norm";
  expect_weights_moved(got.params, make()->parameters(), kLr, kSteps, what);
  if (world().rank() == 0)
    std::printf("[parity] llama %-44s world %d: max relative diff %.3g\n", what.c_str(), world().size(), diff);
}

// ---------------------------------------------------------------------------
// Sharded engine: ZeRO-1/2/3 and the FSDP strategies.

constexpr int64_t kShardBatch = 24;  // divisible by 1..4 ranks x 1 or 2 micro-batches
constexpr double kShardClip = 0.5;

// Odd MLP width with biases: no block's flat buffer (4538 elements) divides
// evenly by 3 or 4 ranks. The root unit (embedding, final norm, head) is a
// multiple of the width, which the even head width makes a multiple of 8.
// 4 query heads share 2 kv heads; the head is its own matrix.
Llama shard_llama(bool tied = false) { return Llama{61, 16, 3, 4, 2, 24, 37, tied, false, true}; }

std::vector<Batch> shard_data() { return make_batches(kSteps, kShardBatch, 16, 61, 4321); }

void expect_sharded_parity(const Llama& l, ShardedRun run, const std::string& what,
                           models::ActivationCheckpointing ac = models::ActivationCheckpointing::None) {
  const auto make = l.factory();
  const auto data = shard_data();
  const Trained ref = train_one_process(make(), data, kShardClip, kLr);
  auto model = make();
  model->set_activation_checkpointing(ac);
  Trained got;
  got.params = train_sharded(model, data, run, kShardClip, kLr);
  got.norms = run.norms;
  expect_same(got, ref, make, kShardClip, what);
}

parallel::fsdp::ShardedOptions with(Sharding s) {
  parallel::fsdp::ShardedOptions o;
  o.sharding = s;
  return o;
}

class LlamaShard : public ::testing::TestWithParam<std::tuple<Sharding, int>> {};

TEST_P(LlamaShard, MatchesSingleProcessAfterFiveSteps) {
  ShardedRun run;
  run.options = with(std::get<0>(GetParam()));
  run.accum = std::get<1>(GetParam());
  expect_sharded_parity(shard_llama(), run,
                        parallel::fsdp::to_string(run.options.sharding) + " accumulation " + std::to_string(run.accum));
}

INSTANTIATE_TEST_SUITE_P(StrategyAccumulation, LlamaShard,
                         ::testing::Combine(::testing::Values(Sharding::Zero1, Sharding::Zero2, Sharding::Zero3,
                                                              Sharding::FullShard, Sharding::ShardGradOp),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<LlamaShard::ParamType>& info) {
                           return parallel::fsdp::to_string(std::get<0>(info.param)) + "_accumulation" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The tied head: the embedding's gradient sums its use as a lookup and as the
// head, inside one flat buffer.
TEST(LlamaShardTied, TiedEmbeddingMatches) {
  for (Sharding s : {Sharding::Zero1, Sharding::Zero3, Sharding::FullShard}) {
    ShardedRun run;
    run.options = with(s);
    run.accum = 2;
    expect_sharded_parity(shard_llama(/*tied=*/true), run, parallel::fsdp::to_string(s) + " tied, accumulation 2");
  }
}

// Activation checkpointing recomputes each block in backward: ZeRO-3 and
// FULL_SHARD must gather the block's unit again for the recomputation; the
// others keep the parameters. Also with reduction per micro-batch.
TEST(LlamaShardCheckpointing, FullCheckpointingMatches) {
  for (Sharding s : {Sharding::Zero2, Sharding::Zero3, Sharding::FullShard, Sharding::ShardGradOp}) {
    for (bool no_sync : {true, false}) {
      ShardedRun run;
      run.options = with(s);
      run.accum = 2;
      run.no_sync = no_sync;
      expect_sharded_parity(shard_llama(), run,
                            parallel::fsdp::to_string(s) + " checkpointing, accumulation 2" +
                                (no_sync ? "" : " reduce each"),
                            models::ActivationCheckpointing::Full);
    }
  }
}

// ---------------------------------------------------------------------------
// Tensor parallelism (q/k/v, gate/up column-parallel; o, down row-parallel;
// the embedding and head over the vocabulary; kv heads split over tp).

constexpr int64_t kTpBatch = 8, kTpSeq = 16, kTpVocab = 64;
constexpr double kTpClip = 0.5;

// 4 query heads on 2 kv heads, q/k/v/o biases (column-parallel q/k/v biases,
// a replicated o bias), untied head: TP=2 only.
Llama gqa_llama() { return Llama{kTpVocab, kTpSeq, 2, 4, 2, 32, 44, false, true, false}; }
// 8 query heads on 4 kv heads, MLP biases, tied head: TP=2 and TP=4.
Llama gqa4_llama() { return Llama{kTpVocab, kTpSeq, 2, 8, 4, 32, 44, true, false, true}; }

std::vector<Batch> tp_data() { return make_batches(kSteps, kTpBatch, kTpSeq, kTpVocab, 1234); }

void expect_tp_parity(const Llama& l, comm::Group& tpg, comm::Group* dp, const std::string& what) {
  const auto make = l.factory();
  const auto data = tp_data();
  const Trained ref = train_one_process(make(), data, kTpClip, kLr);
  for (bool sp : {false, true})
    expect_same(train_tensor_parallel(make(), data, &tpg, dp, sp, kTpClip, kLr), ref, make, kTpClip,
                what + (sp ? " sequence-parallel" : ""));
}

TEST(LlamaTp, GroupedQueryAttentionOnTwoRanks) {
  if (world().size() != 2) GTEST_SKIP() << "tp=2 over the world (2 ranks); 4 ranks run DP2 x TP2";
  expect_tp_parity(gqa_llama(), *world().group(), nullptr, "tp=2 4 heads / 2 kv heads");
}

TEST(LlamaTp, EachRankKeepsWholeKvHeads) {
  const int n = world().size();
  auto model = gqa4_llama().factory()();
  auto plan = tp::parallelize_tensor(*model, *world().group());
  const auto& c = gqa4_llama().config();
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    const auto& l = plan.layout(name);
    if (name.find("k_proj.weight") != std::string::npos || name.find("v_proj.weight") != std::string::npos)
      EXPECT_EQ(item.value().size(0), c.kv_heads() / n * c.head_dim()) << name;
    if (name.find("q_proj.weight") != std::string::npos)
      EXPECT_EQ(item.value().size(0), c.n_head / n * c.head_dim()) << name;
    if (name.find("o_proj.weight") != std::string::npos || name.find("down_proj.weight") != std::string::npos)
      EXPECT_EQ(l.dim, 1) << name;
    if (name.find("norm") != std::string::npos) EXPECT_FALSE(l.sharded()) << name;
  }
}

TEST(LlamaTp, EightHeadsOnFourKvHeadsOverTheWorld) {
  expect_tp_parity(gqa4_llama(), *world().group(), nullptr,
                   "tp=" + std::to_string(world().size()) + " 8 heads / 4 kv heads, tied");
}

TEST(LlamaTp, DataTimesTensorParallel) {
  if (world().size() != 4) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  static comm::Mesh mesh(world(), comm::MeshDims{1, 1, 2, 2});
  expect_tp_parity(gqa_llama(), mesh.tp(), &mesh.dp(), "dp2 x tp2 4 heads / 2 kv heads");
}

// tp=4 with 2 kv heads would have to replicate a kv head on two ranks, which
// the plan refuses: a one-line error naming the degree and the kv heads,
// before any model is built and from parallelize_tensor.
TEST(LlamaTp, MoreRanksThanKvHeadsIsAnError) {
  const auto c = gqa_llama().config();
  EXPECT_NO_THROW(scaletrain::models::check_tensor_parallel(c, 2));
  for (int degree : {4, 8}) {
    try {
      scaletrain::models::check_tensor_parallel(c, degree);
      ADD_FAILURE() << "no error for tp=" << degree << " over 2 kv heads";
    } catch (const UsageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tp=" + std::to_string(degree)), std::string::npos) << msg;
      EXPECT_NE(msg.find("2 key/value heads"), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  if (world().size() != 4) return;
  auto model = gqa_llama().factory()();
  try {
    tp::parallelize_tensor(*model, *world().group());
    ADD_FAILURE() << "parallelize_tensor split 2 kv heads over 4 ranks";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("tp=4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("key/value heads"), std::string::npos) << msg;
  }
}

// ---------------------------------------------------------------------------
// Pipeline parallelism (parity.h's pipeline_parity::run_case).

namespace pp = pipeline_parity;
using pl = parallel::pipeline::Schedule;

constexpr int64_t kPpSeq = 16, kPpVocab = 64;

// 8 blocks (4 stages x 2 virtual stages), 4 heads on 2 kv heads (TP2 splits them).
Llama pipe_llama(bool tied) { return Llama{kPpVocab, kPpSeq, 8, 4, 2, 16, 22, tied, false, false}; }

void run_pipeline(const pp::Case& c, bool tied) {
  pp::run_case(pipe_llama(tied).factory(7), c, kPpSeq, kPpVocab, tied ? "llama tied " : "llama ");
}

TEST(LlamaPipeline, EveryScheduleUntiedHead) {
  for (const pp::Case& c : {pp::Case{pl::GPipe, 4}, pp::Case{pl::OneFOneB, 4}, pp::Case{pl::OneFOneB, 1},
                            pp::Case{pl::OneFOneB, 6}, pp::Case{pl::Interleaved, 4, 2}})
    run_pipeline(c, false);
}

// The tied head lives on the first stage (embedding) and the last (head):
// its two gradients must be summed across stages, and the copies stay equal.
TEST(LlamaPipeline, EveryScheduleTiedHead) {
  for (const pp::Case& c : {pp::Case{pl::GPipe, 4}, pp::Case{pl::OneFOneB, 4}, pp::Case{pl::Interleaved, 4, 2}})
    run_pipeline(c, true);
}

TEST(LlamaPipeline, WithDataAndTensorParallel) {
  if (world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  run_pipeline({pl::OneFOneB, 4, 1, 2, 2, 1, pp::Dp::Ddp}, false);
  run_pipeline({pl::Interleaved, 2, 2, 2, 2, 1, pp::Dp::Ddp}, true);
  run_pipeline({pl::OneFOneB, 4, 1, 2, 1, 2, pp::Dp::None}, false);
  run_pipeline({pl::OneFOneB, 4, 1, 2, 1, 2, pp::Dp::None}, true);
  run_pipeline({pl::GPipe, 4, 1, 2, 2, 1, pp::Dp::Zero3}, false);
  run_pipeline({pl::OneFOneB, 4, 1, 2, 2, 1, pp::Dp::Zero3}, true);
}

}  // namespace llama_parity_test
}  // namespace scaletrain::test

// LoRA under the data-parallel strategies against the single-process
// reference (DESIGN: the invariant), fp64: the same base weights and adapters
// and the same global batches give the same adapters after 5 AdamW steps
// with clipping that acts, to 1e-5 relative per tensor; the frozen base
// weights do not move; and the gradient bytes each strategy communicates
// are the adapters' (frozen parameters have no gradient to send).
//
// QLoRA (the base in NF4, dequantized to fp64 layer by layer) is one of the
// cases: its uint8 flats shard, gather and stay bit-identical like any
// frozen parameter.
//
// Suites: LoraDdp, LoraShard (ZeRO-1/2/3, FULL_SHARD, SHARD_GRAD_OP, with
// and without activation checkpointing), on 2 and 3 ranks; on 4 ranks
// AdapterTp (adapters split with their layers, Note [LoRA under tensor
// parallelism]: DP2 x TP2 under DDP and ZeRO-3, with and without sequence
// parallelism, and TP4) and AdapterPipeline (PP2 with DDP, ZeRO-3 and TP2,
// PP4; tied and untied heads; QLoRA in PP2).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dist_env.h"
#include "parity.h"
#include "reference.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/models/qlora.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"

namespace scaletrain::test {
namespace lora_parity_test {

using parallel::fsdp::Sharding;

constexpr int kSteps = 5;
constexpr int64_t kBatch = 12;  // divisible by 2 and 3 ranks x 1 or 2 micro-batches
constexpr double kLr = 1e-2, kTol = 1e-5, kClip = 0.05;

struct Case {
  std::string preset;
  std::vector<std::string> targets;
  bool qlora = false;  // base weights in NF4 (models/qlora.h): uint8 flats shard beside the adapters
  int64_t layers = 2, vocab = 61;
};

std::string label(const Case& c) { return c.preset + (c.qlora ? " qlora" : ""); }

// Base weights from the model's seed, adapters from the LoRA seed; the
// adapters' B is set away from zero so A trains from the first step.
ModelFactory factory(const Case& c) {
  return [c] {
    models::ModelConfig mc = models::model_preset(c.preset);
    mc.n_layer = c.layers;
    mc.vocab_size = c.vocab;
    mc.block_size = 16;
    torch::manual_seed(42);
    auto m = models::make_model(mc);
    m->to(at::kDouble);
    if (c.qlora) models::quantize_base(*m, {});
    models::LoraOptions o;
    o.r = 4;
    o.alpha = 8;
    o.target_modules = c.targets;
    o.seed = 7;
    models::apply_lora(*m, o);
    torch::NoGradGuard g;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    for (auto& item : m->named_parameters())
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.02, gen);
    return m;
  };
}

std::vector<Batch> data(int64_t vocab = 61) { return make_batches(kSteps, kBatch, 16, vocab, 99); }

int64_t adapter_bytes(const models::CausalLM& m) {
  int64_t b = 0;
  for (const auto& item : m.named_parameters())
    if (models::is_adapter_parameter(item.key())) b += static_cast<int64_t>(item.value().nbytes());
  return b;
}

void expect_same(const std::vector<at::Tensor>& got, const Trained& ref, const ModelFactory& make,
                 const std::string& what) {
  ASSERT_EQ(got.size(), ref.params.size()) << what;
  EXPECT_LE(relative_diff(got, ref.params, /*per_tensor=*/true), kTol) << what;
  int clipped = 0;
  for (double n : ref.norms) clipped += n > kClip;
  EXPECT_GT(clipped, 0) << what << ": clipping never acted";
  // Frozen tensors keep their exact values; the adapters move.
  auto init = make();
  std::vector<bool> frozen;
  int i = 0;
  for (const auto& item : init->named_parameters()) {
    const bool adapter = models::is_adapter_parameter(item.key());
    frozen.push_back(!adapter);
    if (!adapter) EXPECT_TRUE(torch::equal(got[i], item.value())) << what << ": frozen " << item.key() << " moved";
    ++i;
  }
  expect_weights_moved(got, init->parameters(), kLr, kSteps, what, frozen);
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"llama-tiny", {"all-linear"}}, {"tiny", {"c_attn", "c_fc"}}, {"llama-tiny", {"all-linear"}, true}};
  return c;
}

// DDP: each rank its share of the batch; the bucketed all-reduce carries the
// adapters' gradients only.
TEST(LoraDdp, MatchesSingleProcessAndSendsOnlyAdapterGradients) {
  for (const Case& c : cases()) {
    const auto make = factory(c);
    const auto batches = data();
    const Trained ref = train_one_process(make(), batches, kClip, kLr);
    auto model = make();
    parallel::DistributedDataParallel ddp(model, *world().group());
    auto params = trainable_parameters(*model);
    optim::AdamW opt(params, optim::decay_matrices(params), {});
    const int64_t n = kBatch / world().size(), start = world().rank() * n;
    for (const auto& b : batches) {
      ddp.reset_stats();
      model->loss(b.x.narrow(0, start, n), b.y.narrow(0, start, n)).backward();
      EXPECT_EQ(ddp.bytes_reduced(), adapter_bytes(*model)) << label(c);
      optim::clip_grad_norm(params, kClip);
      opt.step(kLr);
      opt.zero_grad();
    }
    expect_same(model->parameters(), ref, make, "ddp " + label(c));
  }
}

class LoraShard : public ::testing::TestWithParam<std::tuple<Sharding, bool>> {};

TEST_P(LoraShard, MatchesSingleProcessAndReducesOnlyAdapterGradients) {
  const auto [sharding, checkpointing] = GetParam();
  for (const Case& c : cases()) {
    const auto make = factory(c);
    const auto batches = data();
    const Trained ref = train_one_process(make(), batches, kClip, kLr);
    auto model = make();
    if (checkpointing) model->set_activation_checkpointing(models::ActivationCheckpointing::Full);
    const int64_t adapters = adapter_bytes(*model);
    ShardedRun run;
    run.options.sharding = sharding;
    run.accum = 2;
    const auto got = train_sharded(model, batches, run, kClip, kLr);
    const int64_t reduced = run.grad_bytes_reduced;
    const std::string what = parallel::fsdp::to_string(sharding) + (checkpointing ? " checkpointing " : " ") + label(c);
    expect_same(got, ref, make, what);
    // One reduce per micro-batch at most (ZeRO-2/3 reduce each), in padded
    // flat buffers: the adapters' bytes, never the base's.
    const int64_t per_step = reduced / kSteps;
    EXPECT_GE(per_step, adapters) << what;
    EXPECT_LE(per_step, run.accum * (adapters + 64 * world().size() * 8)) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Lora, LoraShard,
                         ::testing::Combine(::testing::Values(Sharding::Zero1, Sharding::Zero2, Sharding::Zero3,
                                                              Sharding::FullShard, Sharding::ShardGradOp),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<LoraShard::ParamType>& info) {
                           return parallel::fsdp::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_checkpointing" : "");
                         });

// ---------------------------------------------------------------------------
// 4 ranks: tensor and pipeline parallelism. The vocabulary (64) divides by tp.

bool four_ranks() { return world().size() == 4; }

comm::Mesh& dp2_tp2() {
  static comm::Mesh m(world(), comm::MeshDims{1, 1, 2, 2});  // group names are per layout: one per binary
  return m;
}

// Llama's seven layers (column q, k, v, gate, up; row o, down) and GPT-2's
// fused q|k|v (column, split in three blocks) with its row-parallel c_proj.
const std::vector<Case>& tp_cases() {
  static const std::vector<Case> c = {{"llama-tiny", {"all-linear"}, false, 2, 64},
                                      {"tiny", {"c_attn", "c_proj"}, false, 2, 64}};
  return c;
}

// This tp rank's adapter bytes: what data parallelism reduces per step.
int64_t local_adapter_bytes(const models::CausalLM& full, int tp) {
  int64_t b = 0;
  for (const auto& item : full.named_parameters())
    if (models::is_adapter_parameter(item.key()))
      b += static_cast<int64_t>(item.value().nbytes()) / (full.parameter_split(item.key()).dim >= 0 ? tp : 1);
  return b;
}

// DDP over dp, TP over tp: the gathered adapters equal the reference's, the
// base never moves, and DDP reduces exactly this tp rank's adapter bytes.
TEST(AdapterTp, DataTimesTensorParallelUnderDdp) {
  if (!four_ranks()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  for (const Case& c : tp_cases())
    for (bool sp : {false, true}) {
      const auto make = factory(c);
      const auto batches = data(c.vocab);
      const std::string what = "dp2 x tp2 ddp" + std::string(sp ? " sp " : " ") + label(c);
      const Trained ref = train_one_process(make(), batches, kClip, kLr);
      const Trained got = train_tensor_parallel(make(), batches, &dp2_tp2().tp(), &dp2_tp2().dp(), sp, kClip, kLr);
      expect_same(got.params, ref, make, what);
      for (size_t s = 0; s < ref.norms.size(); ++s)
        EXPECT_NEAR(got.norms[s], ref.norms[s], 1e-9 * ref.norms[s]) << what << " step " << s + 1;
      const int64_t bytes = local_adapter_bytes(*make(), 2);
      ASSERT_EQ(got.bytes_reduced.size(), static_cast<size_t>(kSteps)) << what;
      for (int64_t b : got.bytes_reduced) EXPECT_EQ(b, bytes) << what;
    }
}

TEST(AdapterTp, FourWayTensorParallel) {
  if (!four_ranks()) GTEST_SKIP() << "tp=4 over the world (4 ranks)";
  const Case c{"tiny", {"all-linear"}, false, 2, 64};  // 4 heads, MLP 512: tp 4 divides both
  for (bool sp : {false, true}) {
    const auto make = factory(c);
    const auto batches = data(c.vocab);
    const Trained ref = train_one_process(make(), batches, kClip, kLr);
    const Trained got = train_tensor_parallel(make(), batches, world().group().get(), nullptr, sp, kClip, kLr);
    expect_same(got.params, ref, make, std::string("tp4") + (sp ? " sp " : " ") + label(c));
  }
}

// ZeRO-3 over each tp rank's dp group (Note [Sharding tensor-parallel
// parameters]): adapters and frozen flats shard as in LoraShard; the gradient
// norm adds split adapters over tp and counts replicated ones once.
TEST(AdapterTp, DataTimesTensorParallelUnderZero3) {
  if (!four_ranks()) GTEST_SKIP() << "needs a 2 x 2 mesh (4 ranks)";
  namespace tp = parallel::tensor;
  for (const Case& c : tp_cases())
    for (bool sp : {false, true}) {
      const auto make = factory(c);
      const auto batches = data(c.vocab);
      const std::string what = "dp2 x tp2 zero3" + std::string(sp ? " sp " : " ") + label(c);
      const Trained ref = train_one_process(make(), batches, kClip, kLr);
      auto model = make();
      tp::TensorParallelOptions to;
      to.sequence_parallel = sp;
      const auto plan = tp::parallelize_tensor(*model, dp2_tp2().tp(), to);
      std::set<std::string> split;
      for (const auto& l : plan.params)
        if (l.sharded()) split.insert(l.name);
      parallel::fsdp::NormSplit norm{plan.tp, [split](const std::string& n) { return split.count(n) > 0; }};
      parallel::fsdp::ShardedOptions so;
      so.sharding = Sharding::Zero3;
      parallel::fsdp::ShardedDataParallel engine(model, *model, world(), dp2_tp2().dp(), nullptr, so);
      optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
      const int64_t local = kBatch / 2, start = dp2_tp2().dp().rank() * local;
      std::vector<double> norms;
      for (const auto& b : batches) {
        engine.forward([&] { return model->loss(b.x.narrow(0, start, local), b.y.narrow(0, start, local)); })
            .backward();
        norms.push_back(engine.clip_grad_norm(kClip, norm));
        opt.step(kLr);
        engine.after_step();
        engine.zero_grad();
      }
      std::vector<at::Tensor> full;
      const auto mine = engine.full_parameters();
      for (size_t i = 0; i < mine.size(); ++i) full.push_back(tp::gather_parameter(mine[i], plan.params[i], *plan.tp));
      expect_same(full, ref, make, what);
      for (size_t s = 0; s < ref.norms.size(); ++s)
        EXPECT_NEAR(norms[s], ref.norms[s], 1e-9 * ref.norms[s]) << what << " step " << s + 1;
      // One reduce-scatter per step of the padded adapter flats: never the base.
      const int64_t per_step = engine.stats().grad_bytes_reduced / kSteps, bytes = local_adapter_bytes(*make(), 2);
      EXPECT_GE(per_step, bytes) << what;
      EXPECT_LE(per_step, bytes + 64 * 2 * 8) << what;
    }
}

// The plan's layout of each adapter: B follows a column layer's rows (in
// three blocks for a fused q|k|v), A a row layer's columns; the other factor
// is replicated, a column layer's A with its gradient summed over tp.
TEST(AdapterTp, AdaptersSplitWithTheirLayers) {
  if (!four_ranks()) GTEST_SKIP() << "dp2 x tp2 (4 ranks)";
  for (const Case& c : tp_cases()) {
    auto model = factory(c)();
    const auto plan = parallel::tensor::parallelize_tensor(*model, dp2_tp2().tp());
    int adapters = 0;
    for (const auto& l : plan.params) {
      if (!models::is_adapter_parameter(l.name)) continue;
      ++adapters;
      const bool a = l.name.find("lora_A") != std::string::npos;
      const bool row = l.name.find("o_proj") != std::string::npos || l.name.find("down_proj") != std::string::npos ||
                       l.name.find("c_proj") != std::string::npos;
      const bool qkv = l.name.find("c_attn") != std::string::npos;
      if (row) {
        EXPECT_EQ(l.dim, a ? 1 : -1) << l.name;
        EXPECT_FALSE(l.partial_grad) << l.name;
      } else {
        EXPECT_EQ(l.dim, a ? -1 : 0) << l.name;
        EXPECT_EQ(l.partial_grad, a) << l.name;
        if (!a) EXPECT_EQ(l.blocks, qkv ? 3 : 1) << l.name;
      }
    }
    EXPECT_GT(adapters, 0) << label(c);
  }
}

namespace pp = pipeline_parity;
using Schedule = parallel::pipeline::Schedule;

// Pipelines: each stage's chunks own their blocks' adapters; a frozen tied
// head (GPT-2's) is neither refreshed nor sent back between stages.
TEST(AdapterPipeline, WithDataTensorAndZero3) {
  if (!four_ranks()) GTEST_SKIP() << "needs 4 ranks";
  const Case llama{"llama-tiny", {"all-linear"}, false, 4, 64};
  const Case gpt{"tiny", {"c_attn", "c_proj"}, false, 4, 64};  // tied head
  const Case qlora{"llama-tiny", {"all-linear"}, true, 4, 64};
  struct Run {
    Case model;
    pp::Case layout;
  };
  const std::vector<Run> runs = {
      {llama, {Schedule::OneFOneB, 2, 1, 2, 2, 1, pp::Dp::Ddp, kClip}},
      {gpt, {Schedule::OneFOneB, 2, 1, 2, 2, 1, pp::Dp::Ddp, kClip}},
      {gpt, {Schedule::GPipe, 2, 1, 2, 2, 1, pp::Dp::Zero3, kClip}},
      {llama, {Schedule::OneFOneB, 2, 1, 2, 1, 2, pp::Dp::None, kClip}},
      {gpt, {Schedule::Interleaved, 4, 2, 2, 1, 2, pp::Dp::None, kClip}},
      {llama, {Schedule::OneFOneB, 4, 1, 4, 1, 1, pp::Dp::None, kClip}},
      {qlora, {Schedule::OneFOneB, 2, 1, 2, 2, 1, pp::Dp::Ddp, kClip}},
  };
  for (const Run& r : runs) pp::run_case(factory(r.model), r.layout, 16, r.model.vocab, label(r.model) + " ");
}

}  // namespace lora_parity_test
}  // namespace scaletrain::test

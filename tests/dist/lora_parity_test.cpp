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
// and without activation checkpointing), on 2 and 3 ranks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "parity.h"
#include "reference.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/models/qlora.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::test {
namespace {

using parallel::fsdp::Sharding;

constexpr int kSteps = 5;
constexpr int64_t kBatch = 12;  // divisible by 2 and 3 ranks x 1 or 2 micro-batches
constexpr double kLr = 1e-2, kTol = 1e-5, kClip = 0.05;

struct Case {
  std::string preset;
  std::vector<std::string> targets;
  bool qlora = false;  // base weights in NF4 (models/qlora.h): uint8 flats shard beside the adapters
};

std::string label(const Case& c) { return c.preset + (c.qlora ? " qlora" : ""); }

// Base weights from the model's seed, adapters from the LoRA seed; the
// adapters' B is set away from zero so A trains from the first step.
ModelFactory factory(const Case& c) {
  return [c] {
    models::ModelConfig mc = models::model_preset(c.preset);
    mc.n_layer = 2;
    mc.vocab_size = 61;
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

std::vector<Batch> data() { return make_batches(kSteps, kBatch, 16, 61, 99); }

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

}  // namespace
}  // namespace scaletrain::test

// The trainer end to end, through the real CLI on launched ranks: every
// data-parallel strategy follows DDP's loss curve step for step (the
// invariant, including deferred initialization, the sampler, accumulation,
// clipping and the schedule), and impossible combinations are one-line errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"

namespace scaletrain::test {
namespace {

fs::path strategy_config() {
  return write("strategies.yaml",
               "model:\n  preset: tiny\n  n_layer: 2\n  n_embd: 32\n  n_head: 2\n"
               "  block_size: 32\ndata:\n  path: " +
                   tokens().string() +
                   "\ntrain:\n  steps: 6\n  global_batch: 8\n  micro_batch: 2\n  lr: 3.0e-3\n"
                   "  warmup_steps: 2\n  grad_clip: 0.5\n  sample_tokens: 8\n"
                   "metrics:\n  peak_flops: 1.0e11\n  progress: false\n");
}

std::vector<double> losses(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

std::vector<double> train(int nproc, const std::string& name, const std::string& flags, int port) {
  const fs::path metrics = scratch() / (name + ".jsonl");
  fs::remove(metrics);
  Run r = run("launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 --master-port " +
              std::to_string(port) + " -- " + SCALETRAIN_BIN + " train " + strategy_config().string() + " " + flags +
              " --metrics.path=" + metrics.string());
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return losses(metrics);
}

// fp32 sums taken in another order (reduce-scatter chunks vs all-reduce
// buckets) move the loss by ~1e-7 relative per step; 1e-5 leaves room for six
// steps of that and would still catch any algorithmic difference (a wrong
// shard, a missed reduction, a skipped clip change the loss at 1e-3 or more).
void expect_same_curve(const std::vector<double>& got, const std::vector<double>& ref, const std::string& name) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  ASSERT_EQ(ref.size(), 6u);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << name << " step " << i + 1;
}

TEST(TrainerStrategies, EveryStrategyFollowsTheDdpLossCurve) {
  int port = 29860;
  const auto ref = train(2, "ddp", "--parallel.strategy=ddp", port++);
  ASSERT_EQ(ref.size(), 6u);
  EXPECT_LT(ref.back(), ref.front()) << "the reference run did not learn";
  const std::vector<std::pair<std::string, std::string>> runs{
      {"zero1", "--parallel.strategy=zero1"},
      {"zero2", "--parallel.strategy=zero2"},
      {"zero3", "--parallel.strategy=zero3"},
      {"full_shard", "--parallel.strategy=fsdp"},
      {"full_shard_deferred",
       "--parallel.strategy=fsdp --parallel.fsdp.cpu_ram_efficient_loading=true "
       "--parallel.fsdp.forward_prefetch=true"},
      {"shard_grad_op", "--parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=SHARD_GRAD_OP"},
      {"no_shard", "--parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=NO_SHARD"},
  };
  for (auto& [name, flags] : runs) expect_same_curve(train(2, name, flags, port++), ref, name);
}

TEST(TrainerStrategies, HybridShardOnTwoSimulatedNodes) {
  const auto ref = train(4, "ddp4", "--parallel.strategy=ddp", 29870);
  const auto got = train(4, "hybrid",
                         "--parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=HYBRID_SHARD "
                         "--parallel.dp_replicate=2",
                         29871);
  expect_same_curve(got, ref, "HYBRID_SHARD 2x2");
}

TEST(TrainerStrategies, UnsupportedCombinationsAreOneLineErrors) {
  const std::string cfg = "train " + strategy_config().string();
  expect_usage_error(run(cfg + " --parallel.strategy=zero3 --parallel.zero.offload_param=cpu"), "offload_param");
  expect_usage_error(run(cfg + " --parallel.strategy=zero2 --parallel.zero.offload_optimizer=cpu"),
                     "offload_optimizer");
  expect_usage_error(run(cfg + " --parallel.strategy=fsdp --parallel.fsdp.offload_params=true"), "offload_params");
  expect_usage_error(run(cfg + " --parallel.strategy=fsdp --parallel.fsdp.transformer_layer_cls=LlamaDecoderLayer"),
                     "LlamaDecoderLayer");
  expect_usage_error(run(cfg + " --parallel.strategy=fsdp --parallel.fsdp.sharding_strategy=HYBRID_SHARD"),
                     "dp_replicate");
  expect_usage_error(run(cfg + " --precision.param_dtype=bf16 --precision.mode=bf16"), "master weights");
}

}  // namespace
}  // namespace scaletrain::test

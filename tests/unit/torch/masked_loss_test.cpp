// data.loss_on end to end through the real CLI (Note [Masked loss] in
// train/batches.h): the loss a step reports is the mean over the target
// tokens of its global batch, equal to an independent fp64 computation of
// it (tests/reference/hf_causal_lm.py --targets, torch's ignore_index)
// on the exported checkpoint; and every layout and micro-batch split follows
// the single-process curve, which a per-micro-batch mean would not (the
// micro-batches hold different numbers of targets).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"

namespace scaletrain::test {
namespace masked_loss_test {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// Prompt/completion records of uneven lengths, bytes as tokens.
fs::path records_tokens() {
  static const fs::path out = [] {
    std::string jsonl;
    for (int i = 0; i < 48; ++i) {
      const std::string prompt = "Q" + std::string(static_cast<size_t>(3 + (i * 7) % 19), "abcdefghij"[i % 10]) + "?";
      const std::string answer = " " + std::to_string(i * i) + std::string(static_cast<size_t>(1 + (i * 5) % 11), '!');
      jsonl += nlohmann::json{{"prompt", prompt}, {"completion", answer}}.dump() + "\n";
    }
    const fs::path tok = scratch() / "masked_records.tok";
    EXPECT_EQ(run("prepare " + write("masked_records.jsonl", jsonl).string() + " -o " + tok.string()).code, 0);
    return tok;
  }();
  return out;
}

fs::path masked_config() {
  return write("masked.yaml",
               "model:\n  preset: tiny\n  n_layer: 2\n  n_embd: 16\n  n_head: 2\n  block_size: 24\n"
               "data:\n  path: " +
                   records_tokens().string() +
                   "\n  loss_on: completion\n"
                   "train:\n  steps: 4\n  global_batch: 8\n  micro_batch: 8\n  lr: 1.0e-2\n"
                   "  warmup_steps: 1\n  sample_tokens: 0\n"
                   "metrics:\n  peak_flops: 1.0e11\n  progress: false\n");
}

std::vector<double> train(int nproc, const std::string& name, const std::string& flags) {
  const fs::path metrics = scratch() / (name + ".jsonl"), logs = scratch() / (name + "_logs");
  fs::remove(metrics);
  fs::remove_all(logs);
  const Run r = run("launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 --log-dir " +
                    logs.string() + " -- " + SCALETRAIN_BIN + " train " + masked_config().string() + " " + flags +
                    " --metrics.path=" + metrics.string());
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return metric_losses(metrics);
}

// The inputs and targets (kIgnoreIndex where not scored) of the samples
// `indices`, as the trainer reads them: [samples][block] each.
std::pair<nlohmann::json, nlohmann::json> reference_rows(bool packing, const std::vector<int64_t>& indices) {
  data::DatasetOptions o;
  o.block_size = 24;
  o.use_mask = true;
  o.packing = packing;
  const data::TokenDataset ds(records_tokens().string(), o);
  nlohmann::json ids = nlohmann::json::array(), targets = nlohmann::json::array();
  for (int64_t i : indices) {
    std::vector<int64_t> x(24), y(24);
    ds.copy_sample(i, x.data(), y.data());
    ids.push_back(x);
    targets.push_back(y);
  }
  return {ids, targets};
}

// Step 2's reported loss against the independent reference evaluated on the
// checkpoint of step 1 and step 2's global batch (packed and one record per sample).
TEST(MaskedLoss, StepLossIsTheMeanOverTheGlobalBatchTargets) {
  for (bool packing : {true, false}) {
    const std::string name = packing ? "masked_packed" : "masked_unpacked";
    const fs::path ckpt = scratch() / (name + "_ckpt"), hf = scratch() / (name + "_hf");
    fs::remove_all(ckpt);
    fs::remove_all(hf);
    const auto losses = train(1, name,
                              "--train.steps=2 --checkpoint.every=1 --checkpoint.dir=" + ckpt.string() +
                                  " --data.packing=" + (packing ? "true" : "false"));
    ASSERT_EQ(losses.size(), 2u) << name;
    ASSERT_EQ(run("checkpoint export " + (ckpt / "step-000001").string() + " -o " + hf.string()).code, 0);
    const data::TokenDataset probe(records_tokens().string(), data::DatasetOptions{24, true, packing});
    data::SamplerOptions so;
    so.seed = 1337;
    so.global_batch = 8;
    const data::DistributedSampler sampler(probe.num_samples(), so);
    const auto [ids, targets] = reference_rows(packing, sampler.global_batch(1));
    const fs::path ids_json = scratch() / (name + "_ids.json"), targets_json = scratch() / (name + "_targets.json"),
                   res = scratch() / (name + "_ref.json");
    std::ofstream(ids_json) << ids.dump();
    std::ofstream(targets_json) << targets.dump();
    const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                            "/tests/reference/hf_causal_lm.py loss " + hf.string() + " " + ids_json.string() + " " +
                            res.string() + " --dtype float64 --targets " + targets_json.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const nlohmann::json ref = read_json(res);
    EXPECT_EQ(ref.at("n_predicted").get<int64_t>(), probe.count_targets(sampler.global_batch(1))) << name;
    EXPECT_LT(ref.at("n_predicted").get<int64_t>(), 8 * 24) << name << ": the mask should leave prompts out";
    EXPECT_NEAR(losses[1], ref.at("loss").get<double>(), 1e-5 * losses[1]) << name;
  }
}

// Micro-batches of 1, 2 and 8 samples, two ranks under DDP, ZeRO-3, a 1F1B
// pipeline and tensor parallelism: the loss curve of one process on the
// whole batch, with masks and pads (no packing) making every micro-batch's
// target count different.
TEST(MaskedLoss, EveryLayoutFollowsOneProcess) {
  const std::string common = "--data.packing=false ";
  const auto ref = train(1, "masked_ref", common);
  ASSERT_EQ(ref.size(), 4u);
  EXPECT_LT(ref.back(), ref.front()) << "the reference run did not learn";
  const std::vector<std::tuple<std::string, int, std::string>> runs{
      {"masked_accum8", 1, "--train.micro_batch=1"},
      {"masked_ddp", 2, "--train.micro_batch=1"},
      {"masked_zero3", 2, "--train.micro_batch=2 --parallel.strategy=zero3"},
      {"masked_pp", 2, "--train.micro_batch=1 --parallel.pp=2 --parallel.schedule=1f1b"},
      {"masked_tp", 2, "--train.micro_batch=2 --parallel.tp=2"},
  };
  for (const auto& [name, nproc, flags] : runs) {
    const auto got = train(nproc, name, common + flags);
    ASSERT_EQ(got.size(), ref.size()) << name;
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << name << " step " << i + 1;
  }
}

// data.loss_on that the file cannot honour, and data.packing=false on text.
TEST(MaskedLoss, MismatchedFilesAreOneLineErrors) {
  const fs::path cfg = masked_config();
  expect_usage_error(run("train " + cfg.string() + " --data.loss_on=assistant"),
                     "data.loss_on=assistant needs a token file prepared from messages records, but");
  expect_usage_error(run("train " + cfg.string() + " --data.loss_on=completion --data.path=" + tokens().string()),
                     "holds plain text");
  expect_usage_error(
      run("train " + cfg.string() + " --data.loss_on=all --data.packing=false --data.path=" + tokens().string()),
      "data.packing=false needs records");
  expect_usage_error(run("train " + cfg.string() + " --data.loss_on=everything"), "data.loss_on");
  expect_usage_error(run("train " + cfg.string() + " --data.path= --data.mixture=" + records_tokens().string() + "=-2"),
                     "the weight must be a finite number > 0, got '-2'");
  expect_usage_error(run("train " + cfg.string() + " --data.mixture=" + records_tokens().string() + "=1"),
                     "data.path and data.mixture are both set");
}

}  // namespace masked_loss_test
}  // namespace scaletrain::test

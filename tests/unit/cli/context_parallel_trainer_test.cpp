// Context parallelism through the real CLI on launched ranks: every layout
// with parallel.cp > 1 follows the single process's loss curve step for step
// (the invariant: the sequence split, positions, the weighting of the loss
// and the reductions over dp x cp), beside DDP, ZeRO, FSDP and TP, for both
// families and both modes, with packed documents; checkpoints resume under
// another cp; and what cannot split is a one-line error.
#include <gtest/gtest.h>

#include "cli_util.h"

namespace scaletrain::test {
namespace context_parallel_trainer_test {

std::vector<double> train_cp(int nproc, const std::string& name, const std::string& flags) {
  const fs::path metrics = scratch() / ("cp_" + name + ".jsonl");
  fs::remove(metrics);
  const Run r =
      run("launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 -- " + SCALETRAIN_BIN +
          " train " + small_train_config("cp.yaml", 0).string() + " " + flags + " --metrics.path=" + metrics.string());
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return metric_losses(metrics);
}

// fp32 sums in another order move the loss by ~1e-7 per step; a wrong chunk,
// position or weight moves it by 1e-3 or more.
void expect_same_curve(const std::vector<double>& got, const std::vector<double>& ref, const std::string& name) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  ASSERT_EQ(ref.size(), 6u) << name;
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * ref[i]) << name << " step " << i + 1;
}

using Runs = std::vector<std::tuple<int, std::string, std::string>>;

void expect_runs_follow(const std::vector<double>& ref, const Runs& runs) {
  ASSERT_EQ(ref.size(), 6u);
  EXPECT_LT(ref.back(), ref.front()) << "the reference run did not learn";
  for (auto& [n, name, flags] : runs) expect_same_curve(train_cp(n, name, flags), ref, name);
}

TEST(ContextParallelTrainer, Gpt2FollowsTheSingleProcessCurve) {
  const auto ref = train_cp(1, "gpt2_ref", "");
  const Runs runs{
      {2, "gpt2_ring", "--parallel.cp=2"},
      {2, "gpt2_all_to_all", "--parallel.cp=2 --parallel.cp_mode=all_to_all"},
      {2, "gpt2_ring_naive", "--parallel.cp=2 --model.attention=naive"},
      {2, "gpt2_zero3", "--parallel.cp=2 --parallel.strategy=zero3"},
      {4, "gpt2_dp2_fsdp", "--parallel.cp=2 --parallel.strategy=fsdp"},
      {4, "gpt2_cp4", "--parallel.cp=4"},
      {4, "gpt2_tp2", "--parallel.cp=2 --parallel.tp=2 --parallel.strategy=zero1"},
  };
  expect_runs_follow(ref, runs);
}

const std::string kLlama = " --model.preset=llama-tiny --model.n_head=4 --model.n_kv_head=2";

TEST(ContextParallelTrainer, LlamaFollowsTheSingleProcessCurve) {
  const auto ref = train_cp(1, "llama_ref", kLlama);
  const Runs runs{
      {2, "llama_ring", "--parallel.cp=2" + kLlama},
      {2, "llama_all_to_all", "--parallel.cp=2 --parallel.cp_mode=all_to_all" + kLlama},
      {4, "llama_cp4_ckpt", "--parallel.cp=4 --model.activation_checkpointing=full" + kLlama},
      {4, "llama_dp2_zero2", "--parallel.cp=2 --parallel.strategy=zero2" + kLlama},
      {4, "llama_tp2", "--parallel.cp=2 --parallel.tp=2" + kLlama},
  };
  expect_runs_follow(ref, runs);
}

TEST(ContextParallelTrainer, PackedDocumentsFollowTheSingleProcessCurve) {
  const std::string docs = " --data.pack=documents --data.document_separator=32";
  const auto ref = train_cp(1, "docs_ref", docs + kLlama);
  const Runs runs{
      {2, "docs_ring", "--parallel.cp=2" + docs + kLlama},
      {2, "docs_all_to_all", "--parallel.cp=2 --parallel.cp_mode=all_to_all" + docs + kLlama},
  };
  expect_runs_follow(ref, runs);
}

// Pipelines (Note [Context-parallel groups] per stage): every stage's ranks
// split each sequence over cp and exchange their parts of the activations;
// GPT-2's tied head crosses the stages, the ZeRO-3 run shards each stage over
// dp x cp, and packed documents need each micro-batch's layout set before
// every piece of it that a stage runs (with and without cp).
TEST(ContextParallelTrainer, PipelinesFollowTheSingleProcessCurve) {
  const auto ref = train_cp(1, "pp_gpt2_ref", "");
  expect_runs_follow(ref, {{4, "pp_gpt2_cp2", "--parallel.cp=2 --parallel.pp=2"}});
  const std::string docs = " --data.pack=documents --data.document_separator=32";
  const auto docs_ref = train_cp(1, "pp_docs_ref", docs + kLlama);
  const Runs runs{
      {4, "pp_docs_cp2_zero3", "--parallel.cp=2 --parallel.pp=2 --parallel.strategy=zero3" + docs + kLlama},
      {2, "pp_docs_1f1b", "--parallel.pp=2" + docs + kLlama},
  };
  expect_runs_follow(docs_ref, runs);
}

// A run saved under cp = 2 (zero3, states sharded over dp x cp) resumes with
// cp = 1 and cp = 4 on the single process's curve, and one saved without cp
// resumes under cp = 2.
TEST(ContextParallelTrainer, CheckpointsResumeUnderAnyCp) {
  const auto ref = train_cp(1, "ckpt_ref", kLlama);
  const fs::path cp_dir = scratch() / "cp_ckpt", one_dir = scratch() / "cp_one_ckpt";
  fs::remove_all(cp_dir);
  fs::remove_all(one_dir);
  const std::string stop = " --train.stop_at=3 --checkpoint.dir=";
  ASSERT_EQ(
      train_cp(2, "ckpt_cp2", "--parallel.cp=2 --parallel.strategy=zero3" + stop + cp_dir.string() + kLlama).size(),
      3u);
  // Each resumed run saves its own last step: the cp = 4 run resumes from a copy.
  const fs::path cp4_dir = scratch() / "cp_ckpt_for_cp4";
  fs::remove_all(cp4_dir);
  fs::copy(cp_dir, cp4_dir, fs::copy_options::recursive);
  const auto one = train_cp(1, "ckpt_into_one", "--checkpoint.dir=" + cp_dir.string() + kLlama);
  const auto cp4 = train_cp(4, "ckpt_into_cp4", "--parallel.cp=4 --checkpoint.dir=" + cp4_dir.string() + kLlama);
  ASSERT_EQ(train_cp(1, "ckpt_one", stop + one_dir.string() + kLlama).size(), 3u);
  const auto cp2 = train_cp(2, "ckpt_into_cp2", "--parallel.cp=2 --checkpoint.dir=" + one_dir.string() + kLlama);
  ASSERT_EQ(ref.size(), 6u);
  const std::vector<std::pair<const char*, const std::vector<double>*>> resumed{
      {"cp2 -> one process", &one}, {"cp2 -> cp4", &cp4}, {"one process -> cp2", &cp2}};
  for (const auto& [what, got] : resumed) {
    ASSERT_EQ(got->size(), 3u) << what;
    for (int i = 0; i < 3; ++i) EXPECT_NEAR((*got)[i], ref[i + 3], 1e-5 * ref[i + 3]) << what << ", step " << i + 4;
  }
}

TEST(ContextParallelTrainer, WhatCannotSplitIsAOneLineError) {
  auto refused = [](const std::string& flags, const std::string& says) {
    const auto r = run("train " + small_train_config("cp.yaml", 0).string() + " " + flags);
    EXPECT_EQ(r.code, 2) << flags;
    EXPECT_NE(r.err.find(says), std::string::npos) << flags << ": " << r.err;
  };
  // One process: the mesh check comes with the others, every problem at once.
  refused("--parallel.cp=3", "divisible by 2 x cp = 6");
  refused("--parallel.cp=2 --parallel.cp_mode=all_to_all --model.n_head=1 --model.n_embd=32", "must both divide by it");
  refused("--parallel.cp=2 --model.dropout=0.1 --model.attention=naive", "model.dropout > 0 is not available");
  refused("--parallel.cp_mode=all_to_all", "it applies with context parallelism");
  refused("--parallel.cp=0", "parallel.cp must be at least 1");
}

}  // namespace context_parallel_trainer_test
}  // namespace scaletrain::test

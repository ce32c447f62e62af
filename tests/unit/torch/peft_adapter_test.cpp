// LoRA and QLoRA through the real CLI, with PEFT's adapter directories:
// a finetune run's checkpoints hold the adapters only and resume; `checkpoint
// export --adapter` writes PEFT's layout; `lora merge` folds the adapter into
// the base, and the merged model's loss equals the adapted model's, ours and
// the independent Python reference's (tests/reference/peft_lora.py);
// finetune.adapter_from starts a run from an adapter; a QLoRA run learns,
// and on 2 ZeRO-3 ranks reading the Hub directory slice by slice, or in a
// 2-stage pipeline, follows the 1-rank curve; LoRA under tensor and pipeline
// parallelism trains the 1-rank adapters; bad input as one-line errors that write nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "scaletrain/hub/hub_read.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/lora.h"

namespace scaletrain::test {
namespace peft_adapter_test {

const std::string kLlama = " --model.preset=llama-tiny --model.n_head=4 --model.n_kv_head=2";

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

std::string launch(int nproc, const fs::path& logs) {
  return "launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 --log-dir " + logs.string() +
         " -- " + SCALETRAIN_BIN + " ";
}

// `train` of the shared small config (cli_util.h) with `flags`, on `nproc`
// launched ranks (1: no launcher); returns the per-step losses.
std::vector<double> train(const std::string& name, const std::string& flags, int nproc = 1) {
  const fs::path metrics = scratch() / (name + ".jsonl"), logs = scratch() / (name + "_logs");
  fs::remove(metrics);
  const fs::path cfg = small_train_config(name + ".yaml", 0);
  const std::string args = "train " + cfg.string() + " --metrics.path=" + metrics.string() + " " + flags;
  const Run r = run(nproc == 1 ? args : launch(nproc, logs) + args);
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return metric_losses(metrics);
}

// A llama Hub directory to fine-tune: 2 steps of full training, exported.
fs::path base_dir() {
  static fs::path dir = [] {
    const fs::path root = scratch() / "base_ckpt", out = scratch() / "base_hub";
    fs::remove_all(root);
    fs::remove_all(out);
    train("base", kLlama + " --train.steps=2 --checkpoint.dir=" + root.string());
    const Run r =
        run("checkpoint export " + checkpoint::newest_checkpoint(root.string()).value_or("") + " -o " + out.string());
    EXPECT_EQ(r.code, 0) << r.err;
    return out;
  }();
  return dir;
}

// A LoRA run on base_dir() under zero3 on 2 ranks, its newest checkpoint
// exported as a PEFT directory.
struct Finetuned {
  fs::path ckpt, adapter;
};
const Finetuned& finetuned() {
  static Finetuned f = [] {
    Finetuned out;
    const fs::path root = scratch() / "lora_ckpt";
    fs::remove_all(root);
    train("lora",
          kLlama + " --model.init_from=" + base_dir().string() +
              " --finetune.method=lora --finetune.r=4 --finetune.alpha=16 --finetune.target_modules=all-linear"
              " --train.steps=3 --parallel.strategy=zero3 --checkpoint.dir=" +
              root.string(),
          2);
    out.ckpt = checkpoint::newest_checkpoint(root.string()).value_or("");
    out.adapter = scratch() / "lora_adapter";
    fs::remove_all(out.adapter);
    const Run r = run("checkpoint export " + out.ckpt.string() + " --adapter -o " + out.adapter.string());
    EXPECT_EQ(r.code, 0) << r.err;
    return out;
  }();
  return f;
}

at::Tensor ids_batch(int64_t vocab) {
  torch::manual_seed(21);
  return torch::randint(vocab, {2, 24}, torch::kLong);
}

// Our loss of a Hub directory on `ids`, with the adapter at `adapter` applied when given.
double our_loss(const fs::path& hub, const at::Tensor& ids, const fs::path& adapter = {}) {
  const models::ModelConfig c = models::read_hf_config(hub.string());
  auto m = models::make_model(c);
  if (c.family == "gpt2") {
    models::GPT gpt(std::dynamic_pointer_cast<models::GPTImpl>(m));
    hub::import_hf_gpt2(gpt, hub.string());
  } else {
    hub::load_hub_weights(*m, hub.string());
  }
  if (!adapter.empty()) {
    const hub::Adapter a = hub::read_adapter(adapter.string(), c.family);
    models::apply_lora(*m, a.settings.lora_options(0));
    hub::check_adapter_fits(a, *m, adapter.string());
    torch::NoGradGuard g;
    for (auto& item : m->named_parameters())
      if (models::is_adapter_parameter(item.key())) item.value().copy_(a.tensors.at(item.key()));
  }
  m->eval();
  torch::NoGradGuard g;
  const auto x = ids.narrow(1, 0, ids.size(1) - 1), y = ids.narrow(1, 1, ids.size(1) - 1);
  return m->loss(x, y).item<double>();
}

fs::path ids_json(const at::Tensor& ids) {
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t b = 0; b < ids.size(0); ++b) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t t = 0; t < ids.size(1); ++t) row.push_back(ids[b][t].item<int64_t>());
    rows.push_back(row);
  }
  return write("peft_ids.json", rows.dump());
}

double python_loss(const std::string& script_args) {
  const fs::path res = scratch() / "peft_ref.json";
  fs::remove(res);
  const std::string cmd =
      std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/" + script_args + " " + res.string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return read_json(res).at("loss").get<double>();
}

TEST(PeftReference, Selftest) {
  const std::string cmd =
      std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/peft_lora.py selftest >/dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

// The checkpoint of a LoRA run holds the adapters and their AdamW state, and
// records what they adapt; the exported directory is PEFT's.
TEST(PeftAdapter, CheckpointHoldsAdaptersOnlyAndExportsPeftLayout) {
  const Finetuned& f = finetuned();
  const checkpoint::Index x = checkpoint::read_index(f.ckpt.string());
  ASSERT_FALSE(x.model.finetune.empty());
  const auto rec = nlohmann::json::parse(x.model.finetune);
  EXPECT_EQ(rec.at("method"), "lora");
  EXPECT_EQ(rec.at("base"), base_dir().string());
  int adapters = 0;
  for (const auto& [key, t] : x.tensors) {
    EXPECT_NE(key.find("lora_"), std::string::npos) << key << " is not an adapter tensor";
    adapters += key.rfind("model/", 0) == 0;
  }
  EXPECT_EQ(adapters, 2 * 7 * 2);              // 2 blocks x 7 linear layers x (A, B)
  EXPECT_EQ(x.tensors.size(), 3u * adapters);  // parameters, exp_avg, exp_avg_sq

  const auto cfg = read_json(f.adapter / "adapter_config.json");
  EXPECT_EQ(cfg.at("peft_type"), "LORA");
  EXPECT_EQ(cfg.at("task_type"), "CAUSAL_LM");
  EXPECT_EQ(cfg.at("r"), 4);
  EXPECT_EQ(cfg.at("lora_alpha").get<double>(), 16.0);
  EXPECT_EQ(cfg.at("use_rslora"), false);
  EXPECT_EQ(cfg.at("base_model_name_or_path"), base_dir().string());
  EXPECT_EQ(cfg.at("target_modules").get<std::vector<std::string>>(),
            (std::vector<std::string>{"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}));
  const checkpoint::SafetensorsFile w((f.adapter / "adapter_model.safetensors").string());
  EXPECT_EQ(w.tensors().size(), 28u);
  const auto& a = w.at("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4, 32}));
  const auto& b = w.at("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight");
  EXPECT_EQ(b.shape, (std::vector<int64_t>{32, 4}));
  // B trained away from its zero start.
  hub::HubWeights hw((f.adapter / "adapter_model.safetensors").string());
  EXPECT_GT(
      hw.read("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight", at::kFloat).abs().max().item<double>(), 0);
}

// Merged = adapted, three ways: our adapted model, our merged directory, and
// the Python reference applying the adapter to the base by PEFT's rules.
TEST(PeftAdapter, MergedModelComputesWhatTheAdaptedModelDoes) {
  const Finetuned& f = finetuned();
  const fs::path merged = scratch() / "merged_hub";
  fs::remove_all(merged);
  const auto r = run("lora merge " + base_dir().string() + " " + f.adapter.string() + " -o " + merged.string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(merged / "config.json"));
  const at::Tensor ids = ids_batch(models::read_hf_config(base_dir().string()).vocab_size);
  const double base = our_loss(base_dir(), ids), adapted = our_loss(base_dir(), ids, f.adapter),
               merged_loss = our_loss(merged, ids);
  EXPECT_NEAR(merged_loss, adapted, 1e-5 * adapted);
  EXPECT_GT(std::abs(adapted - base), 1e-4) << "the adapter changed nothing";
  const fs::path j = ids_json(ids);
  const double ref_adapted =
      python_loss("peft_lora.py loss " + base_dir().string() + " " + f.adapter.string() + " " + j.string());
  const double ref_merged = python_loss("hf_causal_lm.py loss " + merged.string() + " " + j.string());
  EXPECT_NEAR(ref_adapted, adapted, 1e-5 * adapted);
  EXPECT_NEAR(ref_merged, adapted, 1e-5 * adapted);
}

// A run started from the adapter (zero3, deferred adapters filled from the
// file) computes at its first step what a fresh adapter on the merged model
// does: both are the same function.
TEST(PeftAdapter, AdapterFromStartsWhereTheAdapterIs) {
  const Finetuned& f = finetuned();
  const fs::path merged = scratch() / "merged_for_from";
  fs::remove_all(merged);
  ASSERT_EQ(run("lora merge " + base_dir().string() + " " + f.adapter.string() + " -o " + merged.string()).code, 0);
  const std::string common = kLlama + " --train.steps=1 --parallel.strategy=zero3 --finetune.method=lora";
  // Naming the layers the adapter has (here all of them) is accepted.
  const auto from = train("from_adapter",
                          common + " --model.init_from=" + base_dir().string() +
                              " --finetune.target_modules=all-linear --finetune.adapter_from=" + f.adapter.string(),
                          2);
  const auto fresh = train(
      "fresh_on_merged",
      common + " --model.init_from=" + merged.string() + " --finetune.r=4 --finetune.target_modules=all-linear", 2);
  ASSERT_EQ(from.size(), 1u);
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_NEAR(from[0], fresh[0], 1e-5 * fresh[0]);
  const auto plain = train("fresh_on_base", common + " --model.init_from=" + base_dir().string(), 2);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_GT(std::abs(plain[0] - from[0]), 1e-4) << "adapter_from changed nothing";
}

// A LoRA run resumed from its adapters-only checkpoint continues its curve.
TEST(PeftAdapter, ResumeFromAdaptersContinuesTheCurve) {
  const std::string flags = kLlama + " --model.init_from=" + base_dir().string() + " --finetune.method=lora";
  const auto whole = train("lora_whole", flags + " --train.steps=4");
  const fs::path root = scratch() / "lora_resume";
  fs::remove_all(root);
  train("lora_first", flags + " --train.steps=2 --checkpoint.dir=" + root.string());
  const auto second = train("lora_second", flags + " --train.steps=4 --checkpoint.dir=" + root.string());
  ASSERT_EQ(whole.size(), 4u);
  ASSERT_EQ(second.size(), 2u);
  EXPECT_NEAR(second[0], whole[2], 1e-6 * whole[2]);
  EXPECT_NEAR(second[1], whole[3], 1e-6 * whole[3]);
  // Not with another base, nor as a full run.
  expect_usage_error(run("train " + small_train_config("lora_other.yaml", 0).string() + kLlama +
                         " --finetune.method=lora --train.steps=4 --checkpoint.dir=" + root.string()),
                     "holds adapters of base");
  expect_usage_error(run("train " + small_train_config("lora_full.yaml", 0).string() + kLlama + " --model.init_from=" +
                         base_dir().string() + " --train.steps=4 --checkpoint.dir=" + root.string()),
                     "holds adapters only");
}

// QLoRA learns; on 2 ZeRO-3 ranks that read the Hub directory slice by slice
// and quantize layer by layer it follows the 1-rank curve.
TEST(PeftAdapter, QloraLearnsAndTwoZero3RanksMatchOne) {
  const std::string flags =
      kLlama + " --model.init_from=" + base_dir().string() +
      " --finetune.method=qlora --finetune.target_modules=all-linear --train.steps=6 --train.lr=1e-2";
  const auto one = train("qlora_one", flags);
  const auto two = train("qlora_two", flags + " --parallel.strategy=zero3", 2);
  const auto pipe = train("qlora_pp", flags + " --parallel.pp=2", 2);  // each stage quantizes its blocks
  ASSERT_EQ(one.size(), 6u);
  ASSERT_EQ(two.size(), 6u);
  ASSERT_EQ(pipe.size(), 6u);
  EXPECT_LT(one.back(), one.front() - 0.05) << "QLoRA did not learn";
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(two[i], one[i], 2e-5 * one[i]) << "zero3 step " << i + 1;
    EXPECT_NEAR(pipe[i], one[i], 2e-5 * one[i]) << "pp=2 step " << i + 1;
  }
  // The quantized base is another model than the base.
  const auto lora =
      train("lora_one", kLlama + " --model.init_from=" + base_dir().string() +
                            " --finetune.method=lora --finetune.target_modules=all-linear --train.steps=1");
  ASSERT_EQ(lora.size(), 1u);
  EXPECT_GT(std::abs(lora[0] - one[0]), 1e-5);
}

// The trainer's LoRA under tensor parallelism (adapters split with their
// layers) and under pipeline parallelism: the same losses as one process,
// and checkpoints that export the same adapter (pieces of split adapters
// saved in full-tensor coordinates, stages saving their own blocks').
TEST(PeftAdapter, TensorAndPipelineParallelTrainTheSameAdapters) {
  const std::string flags = kLlama + " --model.init_from=" + base_dir().string() +
                            " --finetune.method=lora --finetune.r=4 --finetune.alpha=16"
                            " --finetune.target_modules=all-linear --train.steps=4 --train.lr=1e-2";
  struct Layout {
    std::string name, flags;
    int nproc;
  };
  std::map<std::string, std::vector<double>> losses;
  std::map<std::string, fs::path> adapters;
  for (const Layout& l : {Layout{"one", "", 1}, Layout{"tp2", " --parallel.tp=2", 2},
                          Layout{"tp2_sp", " --parallel.tp=2 --parallel.sequence_parallel=true", 2},
                          Layout{"pp2", " --parallel.pp=2", 2}}) {
    const fs::path root = scratch() / ("lora_" + l.name + "_ckpt"), out = scratch() / ("lora_" + l.name + "_adapter");
    fs::remove_all(root);
    fs::remove_all(out);
    losses[l.name] = train("lora_" + l.name, flags + l.flags + " --checkpoint.dir=" + root.string(), l.nproc);
    const auto r = run("checkpoint export " + checkpoint::newest_checkpoint(root.string()).value_or("") +
                       " --adapter -o " + out.string());
    ASSERT_EQ(r.code, 0) << l.name << ": " << r.err;
    adapters[l.name] = out / "adapter_model.safetensors";
  }
  const auto& one = losses.at("one");
  ASSERT_EQ(one.size(), 4u);
  EXPECT_LT(one.back(), one.front()) << "LoRA did not learn";
  hub::HubWeights ref(adapters.at("one").string());
  for (const std::string name : {"tp2", "tp2_sp", "pp2"}) {
    const auto& got = losses.at(name);
    ASSERT_EQ(got.size(), one.size()) << name;
    for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(got[i], one[i], 2e-5 * one[i]) << name << " step " << i + 1;
    hub::HubWeights w(adapters.at(name).string());
    ASSERT_EQ(w.names(), ref.names()) << name;
    for (const auto& t : ref.names()) {
      const at::Tensor a = w.read(t, at::kFloat), b = ref.read(t, at::kFloat);
      // 4 AdamW steps of lr 1e-2 move an entry by up to 4e-2; fp32 rounding
      // of differently ordered sums stays far below 1e-3 of that.
      EXPECT_LE((a - b).abs().max().item<double>(), 4e-5) << name << " " << t;
    }
  }
}

// Adapters written by the Python reference (PEFT's layout, random A and B)
// merge as the reference merges them: a GPT-2 base (Conv1D weights stored
// [in, out], the delta transposed) and a llama base with rsLoRA scaling.
TEST(PeftAdapter, ReferenceAdaptersMergeAsTheReferenceMerges) {
  const fs::path gpt2_root = scratch() / "gpt2_ckpt", gpt2_hub = scratch() / "gpt2_hub";
  fs::remove_all(gpt2_root);
  fs::remove_all(gpt2_hub);
  train("gpt2_base", "--train.steps=1 --checkpoint.dir=" + gpt2_root.string());
  ASSERT_EQ(run("checkpoint export " + checkpoint::newest_checkpoint(gpt2_root.string()).value_or("") + " -o " +
                gpt2_hub.string())
                .code,
            0);
  const std::string py = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/peft_lora.py ";
  struct Case {
    fs::path base;
    std::string make;
  };
  for (const Case& c : {Case{gpt2_hub, "--r 4 --alpha 8 --targets c_attn,c_fc --seed 3"},
                        Case{base_dir(), "--r 4 --alpha 8 --rslora --targets q_proj,v_proj,down_proj --seed 4"}}) {
    const std::string tag = c.base.filename().string();
    const fs::path adapter = scratch() / (tag + "_ref_adapter"), ours = scratch() / (tag + "_merged_ours"),
                   theirs = scratch() / (tag + "_merged_ref");
    for (const auto& d : {adapter, ours, theirs}) fs::remove_all(d);
    ASSERT_EQ(std::system((py + "make " + c.base.string() + " " + adapter.string() + " " + c.make).c_str()), 0) << tag;
    ASSERT_EQ(std::system((py + "merge " + c.base.string() + " " + adapter.string() + " " + theirs.string()).c_str()),
              0);
    const auto r = run("lora merge " + c.base.string() + " " + adapter.string() + " -o " + ours.string());
    ASSERT_EQ(r.code, 0) << r.err;
    // Tensor by tensor: the same merged weights (both sum in fp64, store fp32).
    hub::HubWeights a(ours.string()), b(theirs.string());
    ASSERT_EQ(a.names(), b.names()) << tag;
    for (const auto& name : a.names())
      EXPECT_TRUE(torch::equal(a.read(name, at::kFloat), b.read(name, at::kFloat))) << tag << " " << name;
    const at::Tensor ids = ids_batch(models::read_hf_config(c.base.string()).vocab_size);
    const double adapted = our_loss(c.base, ids, adapter), merged = our_loss(ours, ids);
    EXPECT_NEAR(merged, adapted, 1e-5 * adapted) << tag;
    EXPECT_GT(std::abs(adapted - our_loss(c.base, ids)), 1e-4) << tag << ": the adapter changed nothing";
  }
}

TEST(PeftAdapter, BadInputIsOneLineAndWritesNothing) {
  const Finetuned& f = finetuned();
  const fs::path out = scratch() / "bad_out";
  fs::remove_all(out);
  // Another peft_type.
  const fs::path prefix = scratch() / "prefix_adapter";
  fs::remove_all(prefix);
  fs::create_directories(prefix);
  fs::copy_file(f.adapter / "adapter_model.safetensors", prefix / "adapter_model.safetensors");
  auto cfg = read_json(f.adapter / "adapter_config.json");
  cfg["peft_type"] = "PREFIX_TUNING";
  std::ofstream(prefix / "adapter_config.json") << cfg.dump();
  expect_usage_error(run("lora merge " + base_dir().string() + " " + prefix.string() + " -o " + out.string()),
                     "peft_type PREFIX_TUNING is not LORA");
  EXPECT_FALSE(fs::exists(out));
  // An adapter of a model of other shapes.
  const fs::path wide_root = scratch() / "wide_ckpt", wide_hub = scratch() / "wide_hub";
  fs::remove_all(wide_root);
  fs::remove_all(wide_hub);
  train("wide", kLlama + " --model.n_embd=48 --train.steps=1 --checkpoint.dir=" + wide_root.string());
  ASSERT_EQ(run("checkpoint export " + checkpoint::newest_checkpoint(wide_root.string()).value_or("") + " -o " +
                wide_hub.string())
                .code,
            0);
  expect_usage_error(run("lora merge " + wide_hub.string() + " " + f.adapter.string() + " -o " + out.string()),
                     "does not fit base");
  EXPECT_FALSE(fs::exists(out));
  expect_usage_error(run("train " + small_train_config("bad_from.yaml", 0).string() + kLlama +
                         " --model.n_embd=48 --finetune.method=lora --finetune.adapter_from=" + f.adapter.string()),
                     "an adapter of a model of other shapes");
  // Settings that contradict the adapter's.
  expect_usage_error(run("train " + small_train_config("bad_r.yaml", 0).string() + kLlama +
                         " --finetune.method=lora --finetune.r=2 --finetune.adapter_from=" + f.adapter.string()),
                     "finetune.r=2 differs from the adapter's r 4");
  expect_usage_error(run("train " + small_train_config("bad_t_from.yaml", 0).string() + kLlama +
                         " --finetune.method=lora --finetune.target_modules=q_proj,v_proj --finetune.adapter_from=" +
                         f.adapter.string()),
                     "adapts a layer that this run does not (finetune.target_modules)");
  // Exports of the wrong kind.
  expect_usage_error(run("checkpoint export " + f.ckpt.string() + " -o " + out.string()), "holds adapters only");
  expect_usage_error(run("checkpoint consolidate " + f.ckpt.string() + " -o " + (out / "x.safetensors").string()),
                     "holds adapters only");
  const fs::path full = checkpoint::newest_checkpoint((scratch() / "base_ckpt").string()).value_or("");
  expect_usage_error(run("checkpoint export " + full.string() + " --adapter -o " + out.string()),
                     "trains every parameter");
  expect_usage_error(run("checkpoint export " + f.ckpt.string() + " --adapter --dtype bf16 -o " + out.string()),
                     "no --dtype");
  EXPECT_FALSE(fs::exists(out));
  // Targets that name nothing; r < 1.
  expect_usage_error(run("train " + small_train_config("bad_t.yaml", 0).string() + kLlama +
                         " --finetune.method=qlora --finetune.target_modules=qproj"),
                     "'qproj' names no linear layer");
  expect_usage_error(
      run("train " + small_train_config("bad_r0.yaml", 0).string() + kLlama + " --finetune.method=lora --finetune.r=0"),
      "finetune.r must be at least 1");
  // NF4 blocks do not split over tensor-parallel ranks.
  expect_usage_error(run("train " + small_train_config("bad_qlora_tp.yaml", 0).string() + kLlama +
                         " --finetune.method=qlora --parallel.tp=2"),
                     "finetune.method=qlora with parallel.tp > 1 is not available");
}

// examples/lora.yaml as its header runs it, cut short (tests/examples/lora_example.sh).
TEST(Examples, LoraYamlFinetunesExportsAndMerges) {
  const std::string cmd = std::string("bash ") + SCALETRAIN_SOURCE_DIR + "/tests/examples/lora_example.sh " +
                          SCALETRAIN_BIN + " " + (scratch() / "example_lora").string() + " >" +
                          (scratch() / "example_lora.log").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(scratch() / "example_lora.log");
  std::stringstream log;
  log << in.rdbuf();
  EXPECT_EQ(status, 0) << log.str();
}

}  // namespace peft_adapter_test
}  // namespace scaletrain::test

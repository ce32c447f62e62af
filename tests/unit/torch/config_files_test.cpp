// Configuration files people already have (tests/fixtures/configs, real
// files kept unedited): the settings and start-up notices each one produces,
// and each one run for 2 steps through the real CLI. Also `scaletrain
// config` and model.init_from reading the model's dimensions from the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "cli_util.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/model_config.h"
#include "scaletrain/util/error.h"

namespace scaletrain {
namespace config_files_test {

namespace fs = std::filesystem;
using test::scratch;
using test::usage_error;
using config::Config;

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)
#define EXPECT_LACKS(haystack, needle) EXPECT_EQ((haystack).find(needle), std::string::npos) << (haystack)

std::string fixture(const std::string& name) {
  return std::string(SCALETRAIN_SOURCE_DIR) + "/tests/fixtures/configs/" + name;
}

std::string all_notices(const Config& c) {
  std::string out;
  for (const auto& n : c.notices) out += n + "\n";
  return out;
}

// Whether a run's output has the log line of step `n` ("step     2 | loss ...").
bool has_step(const std::string& text, int n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step %5d | loss", n);
  return text.find(buf) != std::string::npos;
}

// Number of notices that mention `needle`.
int count_notices(const Config& c, const std::string& needle) {
  int n = 0;
  for (const auto& line : c.notices) n += line.find(needle) != std::string::npos;
  return n;
}

// The YAML the DeepSpeed fixtures are applied over: model width 32.
Config base(const std::string& precision = "fp32") {
  auto p = test::write("ds_base_" + precision + ".yaml",
                       "model:\n  n_layer: 1\n  n_embd: 32\n  n_head: 2\n  block_size: 32\n"
                       "train:\n  global_batch: 4\n  micro_batch: 2\n  lr: 2.0e-3\n  warmup_steps: 3\n"
                       "precision:\n  mode: " +
                           precision + "\n");
  return train::load_config(p.string());
}

Config ds(const std::string& name, int dp = 1, Config c = base()) {
  train::apply_deepspeed_config(c, fixture(name), dp);
  return c;
}

constexpr double kMiB = 1024.0 * 1024.0;

// ---- DeepSpeed files: the settings and the notices -------------------------

TEST(ConfigFiles, TransformersZero2) {
  const Config c = ds("transformers_ds_config_zero2.json");
  EXPECT_EQ(c.parallel.strategy, "zero2");
  EXPECT_EQ(c.precision.mode, "fp32");  // fp16 "auto" over an fp32 YAML
  EXPECT_DOUBLE_EQ(c.parallel.zero.reduce_bucket_mb, 2e8 * 4 / kMiB);
  EXPECT_DOUBLE_EQ(c.parallel.zero.allgather_bucket_mb, 2e8 * 4 / kMiB);
  // offload_optimizer cpu: ZeRO-Offload (Note [Offloaded shards]).
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "cpu");
  EXPECT_FALSE(c.parallel.zero.offload_pin_memory);  // DeepSpeed's pin_memory never sets ours
  EXPECT_EQ(count_notices(c, "offload_optimizer.device"), 0) << all_notices(c);
  EXPECT_EQ(count_notices(c, "zero_optimization.offload_optimizer.pin_memory=true has no effect"), 1) << all_notices(c);
  // fp16 "auto" resolved off: its five loss-scaling keys act on nothing.
  EXPECT_EQ(count_notices(c, "fp16 is not enabled"), 5) << all_notices(c);
  EXPECT_EQ(c.precision.loss_scale_window, 2000);     // the YAML's, untouched
  EXPECT_EQ(c.notices.size(), 6u) << all_notices(c);  // wall_clock_breakdown false asks for nothing
  // "auto" resolved from the YAML, as the Hugging Face trainer does.
  EXPECT_EQ(c.train.lr, 2e-3);
  EXPECT_EQ(c.train.warmup_steps, 3);
  EXPECT_EQ(c.train.lr_schedule, "constant");  // WarmupLR
  EXPECT_EQ(c.train.warmup_start_ratio, 0.0);  // warmup_min_lr "auto" = 0
  EXPECT_EQ(c.train.global_batch, 4);
  EXPECT_EQ(c.train.micro_batch, 2);
}

TEST(ConfigFiles, TransformersZero3AutoSizesFromTheModelWidth) {
  const Config c = ds("transformers_ds_config_zero3.json");
  EXPECT_EQ(c.parallel.strategy, "zero3");
  const double hidden = 32;                         // model.n_embd of base()
  EXPECT_EQ(c.parallel.zero.reduce_bucket_mb, 25);  // stage 3 does not read it: a notice
  EXPECT_DOUBLE_EQ(c.parallel.zero.prefetch_bucket_mb, std::floor(0.9 * hidden * hidden) * 4 / kMiB);
  EXPECT_EQ(c.parallel.zero.max_live_parameters, 1000000000);
  EXPECT_EQ(c.parallel.zero.offload_param, "cpu");
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "cpu");
  const std::string n = all_notices(c);
  EXPECT_HAS(n, "stage3_param_persistence_threshold=320 has no effect");  // auto: 10 x hidden
  EXPECT_HAS(n, "zero_optimization.sub_group_size=100000000000000.0 has no effect");
  EXPECT_HAS(n, "zero_optimization.stage3_max_reuse_distance=1000000000.0 has no effect");
  EXPECT_HAS(n, "stage3_gather_fp16_weights_on_model_save=true has no effect");
  EXPECT_HAS(n, "zero_optimization.offload_param.pin_memory=true");
  EXPECT_HAS(n, "zero_optimization.reduce_bucket_size=\"auto\" has no effect");
  EXPECT_EQ(count_notices(c, "fp16 is not enabled"), 5) << n;
  // the five above, offload_optimizer's pin_memory, reduce_bucket_size and fp16's five
  EXPECT_EQ(c.notices.size(), 12u) << n;
  // A wider model, wider "auto" buckets.
  Config wide = base();
  wide.model.n_embd = 64;
  const Config w = ds("transformers_ds_config_zero3.json", 1, wide);
  EXPECT_DOUBLE_EQ(w.parallel.zero.prefetch_bucket_mb, std::floor(0.9 * 64 * 64) * 4 / kMiB);
  EXPECT_HAS(all_notices(w), "stage3_param_persistence_threshold=640");
}

TEST(ConfigFiles, TransformersZero3Bf16FollowsTheYamlPrecision) {
  const Config b = ds("transformers_ds_config_zero3_bf16.json", 1, base("bf16"));
  EXPECT_EQ(b.precision.mode, "bf16");
  EXPECT_EQ(b.precision.param_dtype, "bf16");  // DeepSpeed's bf16 mode: bf16 weights, fp32 master
  EXPECT_DOUBLE_EQ(b.parallel.zero.prefetch_bucket_mb, std::floor(0.9 * 32 * 32) * 2 / kMiB);  // 2-byte elements
  const Config f = ds("transformers_ds_config_zero3_bf16.json");
  EXPECT_EQ(f.precision.mode, "fp32");
  EXPECT_EQ(f.precision.param_dtype, "fp32");
}

TEST(ConfigFiles, DeepSpeedExamplesFiles) {
  const Config z3 = ds("dse_autotuning_ds_config_z3.json", 2);
  EXPECT_EQ(z3.parallel.strategy, "zero3");
  EXPECT_EQ(z3.train.micro_batch, 2);  // "auto": the YAML's
  EXPECT_TRUE(z3.notices.empty()) << all_notices(z3);

  const Config m = ds("dse_megatron_ds_zero2_config.json", 2);
  EXPECT_EQ(m.model.activation_checkpointing, "full");
  EXPECT_EQ(m.precision.mode, "fp16");
  EXPECT_EQ(m.train.global_batch, 16);
  EXPECT_EQ(m.train.micro_batch, 8);
  EXPECT_EQ(m.train.beta2, 0.999);  // DeepSpeed's default for the absent betas
  EXPECT_HAS(all_notices(m), "activation_checkpointing sets model.activation_checkpointing=full");
  EXPECT_HAS(all_notices(m), "activation_checkpointing.partition_activations=true has no effect");
  EXPECT_LACKS(all_notices(m), "contiguous_memory_optimization");  // false asks for nothing

  // The ZeRO-Infinity example misspells stage3_param_persistence_threshold:
  // refused, naming that key, like every unknown key.
  const std::string e = usage_error([] { ds("dse_ds_zero_stage_infinity_config.json"); });
  EXPECT_HAS(e, "unknown key 'zero_optimization.stage3_param_persitence_threshold'");
}

TEST(ConfigFiles, NvmeAioAndWallClockNotices) {
  // The infinity example without its misspelled key: everything else is accepted.
  std::ifstream in(fixture("dse_ds_zero_stage_infinity_config.json"));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const std::string bad = "    \"stage3_param_persitence_threshold\": 1e5,\n";
  ASSERT_NE(text.find(bad), std::string::npos);
  text.erase(text.find(bad), bad.size());
  Config c = base();
  train::apply_deepspeed_config(c, test::write("infinity_fixed.json", text).string(), 1);
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "nvme");
  EXPECT_EQ(c.parallel.zero.offload_param, "nvme");
  EXPECT_EQ(c.parallel.zero.offload_dir, "/nvme_data");
  EXPECT_DOUBLE_EQ(c.parallel.zero.prefetch_bucket_mb, 5e7 * 2 / kMiB);  // fp16: 2-byte elements
  EXPECT_EQ(c.parallel.zero.reduce_bucket_mb, 25);                       // stage 3 does not read it: a notice
  const std::string n = all_notices(c);
  EXPECT_HAS(n, "zero_optimization.reduce_bucket_size=90000000 has no effect");
  for (const char* key :
       {"zero_optimization.offload_optimizer.buffer_count=4", "zero_optimization.offload_optimizer.pin_memory=true",
        "zero_optimization.offload_param.max_in_cpu=1", "zero_optimization.offload_param.pin_memory=true", "aio={",
        "wall_clock_breakdown=true", "zero_optimization.sub_group_size=100000000.0"})
    EXPECT_HAS(n, key);
  EXPECT_LACKS(n, "pipeline_read");  // false
  EXPECT_LACKS(n, "zero_allow_untested_optimizer");
}

TEST(ConfigFiles, DisabledOffloadSectionIsNotCompared) {
  Config c = base();
  train::apply_deepspeed_config(c,
                                test::write("offload_off.json", R"({"zero_optimization": {"stage": 2,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
        "offload_param": {"device": "none", "nvme_path": "/b", "buffer_count": 5}}})")
                                    .string(),
                                1);
  EXPECT_EQ(c.parallel.zero.offload_dir, "/a");
  EXPECT_TRUE(c.notices.empty()) << all_notices(c);
}

TEST(ConfigFiles, EveryUnknownKeyInOneError) {
  const std::string ds_err = usage_error([] {
    Config c = base();
    train::apply_deepspeed_config(
        c,
        test::write("many_unknown.json",
                    R"({"tensorboard": {}, "zero_optimization": {"stage": 2, "bogus": 1}, "flops_profiler": {}})")
            .string(),
        1);
  });
  for (const char* k : {"'tensorboard'", "'flops_profiler'", "'zero_optimization.bogus'"}) EXPECT_HAS(ds_err, k);
  const std::string yaml_err = usage_error([] {
    train::load_config(test::write("many_unknown.yaml",
                                   "train:\n  stpes: 3\n  lr: 1e-3\nmodel:\n  nlayer: 2\nfsdp_config:\n"
                                   "  fsdp_bogus: 2\nwandb: {}\n")
                           .string());
  });
  for (const char* k : {"'train.stpes'", "'model.nlayer'", "'fsdp_config.fsdp_bogus'", "'wandb'"})
    EXPECT_HAS(yaml_err, k);
}

// ---- Accelerate files --------------------------------------------------------

Config acc(const std::string& name) { return train::load_config(fixture(name)); }

TEST(ConfigFiles, AccelerateFsdpTemplate) {
  const Config c = acc("accelerate_fsdp.yaml");
  EXPECT_EQ(c.parallel.strategy, "fsdp");
  EXPECT_EQ(c.precision.mode, "bf16");
  EXPECT_EQ(c.precision.param_dtype, "fp32");  // Accelerate's mixed precision: autocast over fp32 weights
  EXPECT_TRUE(c.parallel.fsdp.cpu_ram_efficient_loading);
  EXPECT_EQ(c.model.activation_checkpointing, "none");  // fsdp_activation_checkpointing: false
  ASSERT_EQ(c.notices.size(), 1u) << all_notices(c);    // fsdp_use_orig_params true is what we do
  EXPECT_HAS(c.notices[0], "num_processes are launcher settings");
}

TEST(ConfigFiles, AccelerateWrittenByAccelerateConfig) {
  const Config c = acc("accelerate_latest.yaml");
  EXPECT_EQ(c.parallel.strategy, "ddp");
  EXPECT_EQ(c.precision.mode, "fp32");
  const std::string n = all_notices(c);
  EXPECT_HAS(n, "use_cpu=false has no effect");
  EXPECT_HAS(n, "gpu_ids=all has no effect");
  EXPECT_HAS(n,
             "machine_rank, main_process_ip, main_process_port, num_machines, num_processes, rdzv_backend, "
             "same_network are launcher settings");
  EXPECT_EQ(c.notices.size(), 3u) << n;

  const Config m = acc("accelerate_mpi_multicpu.yaml");
  EXPECT_EQ(m.parallel.strategy, "ddp");
  EXPECT_HAS(all_notices(m), "ipex_config={ipex: true} has no effect");
  EXPECT_HAS(all_notices(m), "mpirun_config=");
  EXPECT_LACKS(all_notices(m), "use_cpu");  // true is what this build does

  const Config g = acc("trl_multi_gpu.yaml");
  EXPECT_EQ(g.parallel.strategy, "ddp");
  EXPECT_HAS(all_notices(g), "distributed_type=MULTI_GPU runs as data parallelism over CPU processes");
  const Config n2 = acc("accelerate_multi_node.yaml");
  EXPECT_EQ(n2.parallel.strategy, "ddp");
}

TEST(ConfigFiles, AccelerateDeepSpeedSection) {
  const Config z2 = acc("trl_deepspeed_zero2.yaml");
  EXPECT_EQ(z2.parallel.strategy, "zero2");
  EXPECT_EQ(z2.precision.mode, "bf16");
  EXPECT_EQ(z2.precision.param_dtype, "bf16");       // Accelerate fills DeepSpeed's bf16 section
  EXPECT_LACKS(all_notices(z2), "zero3_init_flag");  // stage 2

  const Config z3 = acc("trl_deepspeed_zero3.yaml");
  EXPECT_EQ(z3.parallel.strategy, "zero3");
  EXPECT_EQ(z3.train.global_batch, z3.train.micro_batch);  // gradient_accumulation_steps 1 x dp 1
  EXPECT_HAS(all_notices(z3), "stage3_gather_16bit_weights_on_model_save=true has no effect");

  // A deepspeed_config_file, resolved next to the YAML when not in the working directory.
  auto yaml = test::write("acc_ds_file.yaml",
                          "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                          "  deepspeed_config_file: zero3_here.json\n  zero3_init_flag: true\n");
  test::write("zero3_here.json", R"({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2})");
  EXPECT_HAS(usage_error([&] { train::load_config(yaml.string()); }),
             "deepspeed_config_file excludes deepspeed_config.zero3_init_flag");
  yaml = test::write("acc_ds_file2.yaml",
                     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: zero3_here.json\n");
  const Config f = train::load_config(yaml.string());
  EXPECT_EQ(f.parallel.strategy, "zero3");
  EXPECT_EQ(f.train.micro_batch, 2);
}

TEST(ConfigFiles, AccelerateFsdpKeys) {
  auto yaml = test::write("acc_keys.yaml",
                          "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: true\n"
                          "  fsdp_use_orig_params: false\n  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n");
  const Config c = train::load_config(yaml.string());
  EXPECT_EQ(c.model.activation_checkpointing, "full");
  EXPECT_EQ(c.parallel.fsdp.transformer_layer_cls, "Block");
  EXPECT_HAS(all_notices(c), "fsdp_config.fsdp_use_orig_params=false has no effect");
  auto bert = test::write("acc_bert.yaml", "fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: BertLayer\n");
  EXPECT_HAS(usage_error([&] { train::load_config(bert.string()); }), "'BertLayer' is not a layer class");
  auto tpu = test::write("acc_tpu.yaml", "distributed_type: XLA\n");
  EXPECT_HAS(usage_error([&] { train::load_config(tpu.string()); }), "distributed_type XLA is not supported");
  auto clash = test::write("acc_clash.yaml", "distributed_type: MULTI_CPU\nparallel:\n  strategy: zero2\n");
  EXPECT_HAS(usage_error([&] { train::load_config(clash.string()); }),
             "distributed_type MULTI_CPU implies parallel.strategy=ddp");
}

// ---- Each file runs, unedited, through the CLI --------------------------------

struct Output {
  int code;
  std::string text;  // stdout and stderr
};

Output run_cli(const std::string& args, const std::string& env = "") {
  const auto out = scratch() / "cli_out.txt";
  const std::string cmd = "env -u RANK -u WORLD_SIZE -u SCALETRAIN_ACCELERATE_CONFIG " + env + " " +
                          std::string(SCALETRAIN_BIN) + " " + args + " >" + out.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

// Tiny model, 2 steps: the flags every run of a fixture adds.
std::string tiny(int steps = 2) {
  return " --data.path=" + test::tokens().string() +
         " --model.n_layer=1 --model.n_embd=32 --model.n_head=2 --model.block_size=32 --train.steps=" +
         std::to_string(steps) +
         " --train.global_batch=4 --train.micro_batch=2 --train.sample_tokens=0 --metrics.progress=false "
         "--metrics.peak_flops=1e10";
}

fs::path empty_yaml() { return test::write("empty.yaml", "train:\n  steps: 2\n"); }

TEST(ConfigFilesRun, DeepSpeedFixturesTrainTwoSteps) {
  for (const char* f : {"transformers_ds_config_zero2.json", "transformers_ds_config_zero3.json",
                        "transformers_ds_config_zero3_bf16.json", "dse_autotuning_ds_config_z3.json"}) {
    const auto r = run_cli("train " + empty_yaml().string() + " --deepspeed " + fixture(f) + tiny());
    EXPECT_EQ(r.code, 0) << f << "\n" << r.text;
    EXPECT_TRUE(has_step(r.text, 2)) << r.text;
  }
  const auto r = run_cli("train " + empty_yaml().string() + " --deepspeed " +
                         fixture("transformers_ds_config_zero3.json") + tiny());
  EXPECT_HAS(r.text, "scaletrain: note: " + fixture("transformers_ds_config_zero3.json") +
                         ": zero_optimization.sub_group_size=100000000000000.0 has no effect");
  EXPECT_HAS(r.text, "strategy zero3");
  // Refused with one line where this CPU build cannot honour the file.
  const auto fp16 = run_cli("train " + empty_yaml().string() + " --deepspeed " +
                            fixture("dse_megatron_ds_zero2_config.json") + tiny());
  EXPECT_EQ(fp16.code, 2) << fp16.text;
  EXPECT_HAS(fp16.text, "fp16 needs CUDA");
}

TEST(ConfigFilesRun, AccelerateFixturesTrainTwoSteps) {
  for (const char* f :
       {"accelerate_latest.yaml", "accelerate_mpi_multicpu.yaml", "accelerate_multi_node.yaml", "trl_multi_gpu.yaml",
        "trl_deepspeed_zero2.yaml", "trl_deepspeed_zero3.yaml", "accelerate_fsdp.yaml"}) {
    const auto r = run_cli("train " + fixture(f) + tiny());
    EXPECT_EQ(r.code, 0) << f << "\n" << r.text;
    EXPECT_TRUE(has_step(r.text, 2)) << r.text;
    EXPECT_HAS(r.text, "scaletrain: note: ");
  }
}

TEST(ConfigFilesRun, LaunchConfigFileStartsNumProcessesAndHandsOverTheTrainingKeys) {
  // accelerate_fsdp.yaml: num_processes 2, FSDP, bf16.
  const auto r = run_cli("launch --config_file " + fixture("accelerate_fsdp.yaml") + " -- " + SCALETRAIN_BIN +
                         " train " + empty_yaml().string() + tiny());
  ASSERT_EQ(r.code, 0) << r.text;
  EXPECT_HAS(r.text, "world 2");
  EXPECT_HAS(r.text, "strategy fsdp");
  EXPECT_HAS(r.text, "bf16");
  // The file's num_machines (4) bounds an explicit --node-rank.
  const auto bad =
      run_cli("launch --config_file " + fixture("accelerate_mpi_multicpu.yaml") + " --node-rank 7 -- true");
  EXPECT_EQ(bad.code, 2) << bad.text;
  EXPECT_HAS(bad.text, "--node-rank must be in [0, 4), got 7");
}

TEST(ConfigFilesRun, ConfigCommandWritesAFileThatTrains) {
  const auto out = scratch() / "written.yaml";
  fs::remove(out);
  auto w = run_cli("config -o " + out.string() + " --strategy zero2 --num-processes 2 --precision bf16 --data " +
                       test::tokens().string() + " --steps 2 --global-batch 4 --micro-batch 2",
                   "");
  ASSERT_EQ(w.code, 0) << w.text;
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_HAS(ss.str(), "strategy: zero2");
  EXPECT_HAS(ss.str(), "num_processes: 2");
  const auto r = run_cli("launch --config_file " + out.string() + " -- " + SCALETRAIN_BIN + " train " + out.string() +
                         " --model.n_layer=1 --model.n_embd=32 --model.n_head=2 --model.block_size=32 "
                         "--train.sample_tokens=0 --metrics.progress=false --metrics.peak_flops=1e10");
  ASSERT_EQ(r.code, 0) << r.text;
  EXPECT_HAS(r.text, "world 2");
  EXPECT_HAS(r.text, "strategy zero2");
  EXPECT_TRUE(has_step(r.text, 2)) << r.text;
  // Bad answers are refused before anything is written; an existing file is kept.
  const auto bad = run_cli("config -o " + (scratch() / "config_bad.yaml").string() + " --strategy zero9");
  EXPECT_EQ(bad.code, 2) << bad.text;
  EXPECT_HAS(bad.text, "parallel.strategy must be one of");
  EXPECT_FALSE(fs::exists(scratch() / "config_bad.yaml"));
  EXPECT_EQ(run_cli("config -o " + out.string()).code, 2);
}

// On a terminal it asks, re-asks after a bad answer, and keeps defaults on Enter
// (a pseudo-terminal from util-linux's `script`).
TEST(ConfigFilesRun, ConfigCommandAsksOnATerminal) {
  if (std::system("command -v script >/dev/null 2>&1") != 0) GTEST_SKIP() << "util-linux script not installed";
  const auto out = scratch() / "asked.yaml";
  fs::remove(out);
  const std::string cmd = "printf 'zero9\\nzero1\\n\\nbf16\\n\\n/tmp/x.tok\\n7\\n\\n\\n\\n' | script -qc '" +
                          std::string(SCALETRAIN_BIN) + " config -o " + out.string() + "' /dev/null >" +
                          (scratch() / "asked.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(out), log(scratch() / "asked.txt");
  std::stringstream ss, ls;
  ss << in.rdbuf();
  ls << log.rdbuf();
  EXPECT_HAS(ls.str(), "parallel.strategy must be one of");  // zero9, then asked again
  EXPECT_HAS(ss.str(), "strategy: zero1");
  EXPECT_HAS(ss.str(), "mode: bf16");
  EXPECT_HAS(ss.str(), "steps: 7");
  EXPECT_HAS(ss.str(), "global_batch: 32");  // Enter: the default
}

// ---- model.init_from: dimensions from the file ---------------------------------

TEST(InitFrom, DimensionsFromTheFileAndItsConfigJson) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed";
  const fs::path dir = scratch() / "hf_random";
  fs::create_directories(dir);
  const std::string gen = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/unit/torch/hf_gpt2_random.py " + dir.string() + " 3 4 48 40 300";
  ASSERT_EQ(std::system(gen.c_str()), 0) << gen;
  const std::string file = (dir / "model.safetensors").string();
  config::ModelOptions m;
  m.init_from = file;
  const models::GPTConfig c = train::resolve_model_config(m);
  EXPECT_EQ(c.n_layer, 3);
  EXPECT_EQ(c.n_head, 4);  // only in config.json
  EXPECT_EQ(c.n_embd, 48);
  EXPECT_EQ(c.block_size, 40);
  EXPECT_EQ(c.vocab_size, 300);

  // A shorter block_size takes the first rows of wpe; the forward matches the
  // independent Python reference (which indexes wpe by position).
  m.block_size = 12;
  const models::GPTConfig s = train::resolve_model_config(m);
  EXPECT_EQ(s.block_size, 12);
  models::GPT model(s);
  hub::import_hf_gpt2(model, file);
  model->eval();
  const auto idx = torch::randint(0, 300, {2, 12}, torch::kLong);
  checkpoint::save_safetensors((dir / "ids.safetensors").string(), {{"ids", idx}});
  const std::string ref_cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                              "/tests/unit/torch/hf_gpt2_reference.py " + file + " " +
                              (dir / "ids.safetensors").string() + " 4 " + (dir / "logits.safetensors").string();
  ASSERT_EQ(std::system(ref_cmd.c_str()), 0) << ref_cmd;
  const at::Tensor ref = checkpoint::load_safetensors((dir / "logits.safetensors").string()).at("logits");
  torch::NoGradGuard no_grad;
  const at::Tensor ours = model->forward(idx);
  EXPECT_TRUE(torch::allclose(ours, ref, 1e-5, 1e-5)) << (ours - ref).abs().max().item<float>();

  // Explicit keys that disagree with the file: one line naming both.
  m.block_size = 0;
  m.n_layer = 2;
  EXPECT_HAS(usage_error([&] { train::resolve_model_config(m); }),
             "model.n_layer=2 disagrees with model.init_from " + file + " (3)");
  m.n_layer = 0;
  m.n_head = 6;
  EXPECT_HAS(usage_error([&] { train::resolve_model_config(m); }), "model.n_head=6 disagrees");
  m.n_head = 0;
  m.block_size = 41;
  EXPECT_HAS(usage_error([&] { train::resolve_model_config(m); }), "longer than model.init_from");

  // The CLI trains from it with no model.* key at all.
  const auto r = run_cli("train " + empty_yaml().string() + " --model.init_from=" + file +
                         " --data.path=" + test::tokens().string() +
                         " --train.steps=2 --train.global_batch=2 --train.micro_batch=1 --train.sample_tokens=0 "
                         "--model.block_size=16 --metrics.progress=false --metrics.peak_flops=1e10");
  EXPECT_EQ(r.code, 0) << r.text;
}

TEST(InitFrom, ConfigJsonSettingsWeCannotHonourAreRefused) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed";
  const fs::path dir = scratch() / "hf_eps";
  fs::create_directories(dir);
  const std::string gen = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/unit/torch/hf_gpt2_random.py " + dir.string() + " 1 2 16 8 50";
  ASSERT_EQ(std::system(gen.c_str()), 0);
  {
    std::ifstream in(dir / "config.json");
    auto j = nlohmann::json::parse(in);
    j["layer_norm_epsilon"] = 1e-6;
    std::ofstream(dir / "config.json") << j.dump();
  }
  config::ModelOptions m;
  m.init_from = (dir / "model.safetensors").string();
  EXPECT_HAS(usage_error([&] { train::resolve_model_config(m); }), "layer_norm_epsilon=1e-06 is not supported");
  fs::remove(dir / "config.json");  // no config.json: the head count must come from somewhere
  EXPECT_HAS(usage_error([&] { train::resolve_model_config(m); }), "set model.n_head");
  m.n_head = 2;
  EXPECT_EQ(train::resolve_model_config(m).n_layer, 1);
}

}  // namespace config_files_test
}  // namespace scaletrain

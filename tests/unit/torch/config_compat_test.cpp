// The config surface for ZeRO/FSDP/precision: new keys, their choices, the
// nested YAML form, Accelerate's fsdp_config and DeepSpeed's JSON config.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "cli_util.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/util/error.h"

namespace scaletrain {
namespace config_compat_test {

namespace fs = std::filesystem;
using config::Config;
using test::usage_error;

fs::path write(const std::string& name, const std::string& text) {
  static fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("scaletrain_cfg_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  auto p = dir / name;
  std::ofstream(p) << text;
  return p;
}


#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

TEST(ConfigCompat, Defaults) {
  Config c;
  EXPECT_EQ(c.parallel.strategy, "ddp");
  EXPECT_EQ(c.parallel.fsdp.sharding_strategy, "FULL_SHARD");
  EXPECT_EQ(c.parallel.fsdp.auto_wrap_policy, "transformer");
  EXPECT_EQ(c.parallel.fsdp.transformer_layer_cls, "");  // the model's own block class
  EXPECT_EQ(c.parallel.fsdp.min_num_params, 100000000);
  EXPECT_EQ(c.parallel.fsdp.backward_prefetch, "BACKWARD_PRE");
  EXPECT_FALSE(c.parallel.fsdp.forward_prefetch);
  EXPECT_TRUE(c.parallel.fsdp.limit_all_gathers);
  EXPECT_FALSE(c.parallel.fsdp.offload_params);
  EXPECT_TRUE(c.parallel.fsdp.sync_module_states);
  EXPECT_FALSE(c.parallel.fsdp.cpu_ram_efficient_loading);
  EXPECT_EQ(c.parallel.fsdp.state_dict_type, "SHARDED_STATE_DICT");
  EXPECT_EQ(c.parallel.zero.reduce_bucket_mb, 25);
  EXPECT_EQ(c.parallel.zero.allgather_bucket_mb, 25);
  EXPECT_TRUE(c.parallel.zero.overlap_comm);
  EXPECT_TRUE(c.parallel.zero.contiguous_gradients);
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "none");
  EXPECT_EQ(c.parallel.zero.offload_param, "none");
  EXPECT_EQ(c.parallel.zero.offload_dir, "");
  EXPECT_EQ(c.parallel.zero.prefetch_bucket_mb, 50);
  EXPECT_EQ(c.parallel.zero.max_live_parameters, 1000000000);
  EXPECT_EQ(c.precision.mode, "fp32");
  EXPECT_EQ(c.precision.param_dtype, "fp32");
  EXPECT_EQ(c.precision.reduce_dtype, "");
  EXPECT_EQ(c.precision.buffer_dtype, "");
  EXPECT_EQ(c.precision.loss_scale, 0);
  EXPECT_EQ(c.precision.initial_scale_power, 16);
  EXPECT_EQ(c.precision.loss_scale_window, 2000);
  EXPECT_EQ(c.precision.hysteresis, 2);
  EXPECT_EQ(c.precision.min_loss_scale, 1);
  EXPECT_FALSE(c.precision.scale_bf16);
  EXPECT_NO_THROW(config::validate_config(c));
}

TEST(ConfigCompat, EveryNewKeyOverrides) {
  Config c;
  for (const char* o : {"--parallel.strategy=zero3",
                        "--parallel.fsdp.sharding_strategy=HYBRID_SHARD",
                        "--parallel.fsdp.auto_wrap_policy=size",
                        "--parallel.fsdp.transformer_layer_cls=GPT2Block",
                        "--parallel.fsdp.min_num_params=1e6",
                        "--parallel.fsdp.backward_prefetch=BACKWARD_POST",
                        "--parallel.fsdp.forward_prefetch=true",
                        "--parallel.fsdp.limit_all_gathers=false",
                        "--parallel.fsdp.offload_params=true",
                        "--parallel.fsdp.sync_module_states=false",
                        "--parallel.fsdp.cpu_ram_efficient_loading=true",
                        "--parallel.fsdp.state_dict_type=FULL_STATE_DICT",
                        "--parallel.zero.reduce_bucket_mb=12.5",
                        "--parallel.zero.allgather_bucket_mb=7",
                        "--parallel.zero.overlap_comm=false",
                        "--parallel.zero.contiguous_gradients=false",
                        "--parallel.zero.reduce_scatter=false",
                        "--parallel.zero.allgather_partitions=false",
                        "--parallel.zero.offload_optimizer=nvme",
                        "--parallel.zero.offload_param=cpu",
                        "--parallel.zero.offload_dir=/tmp/nvme",
                        "--parallel.zero.offload_pin_memory=true",
                        "--parallel.zero.prefetch_bucket_mb=100",
                        "--parallel.zero.max_live_parameters=2000000",
                        "--precision.mode=bf16",
                        "--precision.param_dtype=bf16",
                        "--precision.reduce_dtype=fp32",
                        "--precision.buffer_dtype=fp32",
                        "--precision.loss_scale=128",
                        "--precision.initial_scale_power=12",
                        "--precision.loss_scale_window=500",
                        "--precision.hysteresis=4",
                        "--precision.min_loss_scale=0.5",
                        "--precision.scale_bf16=true",
                        "--train.eps=1e-6",
                        "--train.lr_schedule=linear",
                        "--train.warmup_type=log",
                        "--train.warmup_start_ratio=0.1"})
    config::apply_override(c, o);
  EXPECT_EQ(c.parallel.strategy, "zero3");
  const auto& f = c.parallel.fsdp;
  EXPECT_EQ(f.sharding_strategy, "HYBRID_SHARD");
  EXPECT_EQ(f.auto_wrap_policy, "size");
  EXPECT_EQ(f.transformer_layer_cls, "GPT2Block");
  EXPECT_EQ(f.min_num_params, 1000000);
  EXPECT_EQ(f.backward_prefetch, "BACKWARD_POST");
  EXPECT_TRUE(f.forward_prefetch);
  EXPECT_FALSE(f.limit_all_gathers);
  EXPECT_TRUE(f.offload_params);
  EXPECT_FALSE(f.sync_module_states);
  EXPECT_TRUE(f.cpu_ram_efficient_loading);
  EXPECT_EQ(f.state_dict_type, "FULL_STATE_DICT");
  const auto& z = c.parallel.zero;
  EXPECT_EQ(z.reduce_bucket_mb, 12.5);
  EXPECT_EQ(z.allgather_bucket_mb, 7);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_FALSE(z.reduce_scatter);
  EXPECT_FALSE(z.allgather_partitions);
  EXPECT_EQ(z.offload_optimizer, "nvme");
  EXPECT_EQ(z.offload_param, "cpu");
  EXPECT_EQ(z.offload_dir, "/tmp/nvme");
  EXPECT_TRUE(z.offload_pin_memory);
  EXPECT_EQ(z.prefetch_bucket_mb, 100);
  EXPECT_EQ(z.max_live_parameters, 2000000);
  const auto& p = c.precision;
  EXPECT_EQ(p.mode, "bf16");
  EXPECT_EQ(p.param_dtype, "bf16");
  EXPECT_EQ(p.reduce_dtype, "fp32");
  EXPECT_EQ(p.buffer_dtype, "fp32");
  EXPECT_EQ(p.loss_scale, 128);
  EXPECT_EQ(p.initial_scale_power, 12);
  EXPECT_EQ(p.loss_scale_window, 500);
  EXPECT_EQ(p.hysteresis, 4);
  EXPECT_EQ(p.min_loss_scale, 0.5);
  EXPECT_TRUE(p.scale_bf16);
  EXPECT_EQ(c.train.eps, 1e-6);
  EXPECT_EQ(c.train.lr_schedule, "linear");
  EXPECT_EQ(c.train.warmup_type, "log");
  EXPECT_EQ(c.train.warmup_start_ratio, 0.1);
  EXPECT_NO_THROW(config::validate_config(c));
}

TEST(ConfigCompat, NestedYamlSections) {
  auto cfg = write("nested.yaml",
                   "parallel:\n  strategy: fsdp\n  fsdp:\n    sharding_strategy: SHARD_GRAD_OP\n"
                   "    min_num_params: 1e7\n    forward_prefetch: true\n  zero:\n    offload_optimizer: cpu\n"
                   "precision:\n  mode: bf16\n  reduce_dtype: fp32\n");
  auto c = train::load_config(cfg.string(), {"--parallel.fsdp.sharding_strategy=NO_SHARD"});
  EXPECT_EQ(c.parallel.strategy, "fsdp");
  EXPECT_EQ(c.parallel.fsdp.sharding_strategy, "NO_SHARD");  // the override wins
  EXPECT_EQ(c.parallel.fsdp.min_num_params, 10000000);
  EXPECT_TRUE(c.parallel.fsdp.forward_prefetch);
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "cpu");
  EXPECT_EQ(c.precision.mode, "bf16");
  EXPECT_EQ(c.precision.reduce_dtype, "fp32");

  auto bad = write("nested_bad.yaml", "parallel:\n  fsdp:\n    sharding: FULL_SHARD\n");
  auto m = usage_error([&] { train::load_config(bad.string()); });
  EXPECT_HAS(m, "unknown config key 'parallel.fsdp.sharding'");
  EXPECT_HAS(m, "parallel.fsdp.sharding_strategy");  // lists the sub-section's keys
  EXPECT_HAS(m, bad.string());
  auto not_scalar = write("nested_map.yaml", "parallel:\n  fsdp:\n    min_num_params: {a: 1}\n");
  EXPECT_HAS(usage_error([&] { train::load_config(not_scalar.string()); }),
             "parallel.fsdp.min_num_params must be a single value");
  EXPECT_HAS(usage_error([&] {
               Config c2;
               config::apply_override(c2, "--parallel.zero.nope=1");
             }),
             "unknown config key 'parallel.zero.nope'");
  EXPECT_HAS(usage_error([&] {
               Config c2;
               config::apply_override(c2, "--parallel.fsdp.min_num_params=1.5");
             }),
             "parallel.fsdp.min_num_params: '1.5' is not an integer");
}

// YAML leaves a repeated key to the reader; ours refuses it, naming it,
// rather than quietly keeping one of the two values.
TEST(ConfigCompat, RepeatedKeysAndSectionsAreRefused) {
  auto m = usage_error([&] { train::load_config(write("dup_key.yaml", "train:\n  lr: 1e-3\n  lr: 1e-4\n").string()); });
  EXPECT_HAS(m, "train.lr is given twice");
  m = usage_error([&] {
    train::load_config(
        write("dup_nested.yaml", "parallel:\n  zero:\n    reduce_bucket_mb: 1\n    reduce_bucket_mb: 2\n").string());
  });
  EXPECT_HAS(m, "parallel.zero.reduce_bucket_mb is given twice");
  m = usage_error([&] {
    train::load_config(write("dup_section.yaml", "train:\n  lr: 1e-3\ntrain:\n  steps: 5\n").string());
  });
  EXPECT_HAS(m, "section 'train' is given twice");
  EXPECT_NO_THROW(train::load_config(write("no_dup.yaml", "train:\n  lr: 1e-3\n  steps: 5\n").string()));
}

TEST(ConfigCompat, EveryEnumRejectsBadValues) {
  for (const char* key : {"parallel.strategy", "parallel.fsdp.sharding_strategy", "parallel.fsdp.auto_wrap_policy",
                          "parallel.fsdp.backward_prefetch", "parallel.fsdp.state_dict_type",
                          "parallel.zero.offload_optimizer", "parallel.zero.offload_param", "precision.mode",
                          "precision.param_dtype", "precision.reduce_dtype", "precision.buffer_dtype",
                          "train.lr_schedule", "train.warmup_type", "parallel.comm_dtype", "parallel.backend"}) {
    Config c;
    auto m = usage_error([&] { config::apply_override(c, std::string(key) + "=bogus"); });
    EXPECT_HAS(m, std::string(key) + " must be one of");
    EXPECT_HAS(m, "'bogus'");
  }
  auto cfg = write("strategy.yaml", "parallel:\n  strategy: zero9\n");
  auto m = usage_error([&] { train::load_config(cfg.string()); });
  EXPECT_HAS(m, "parallel.strategy must be one of ddp | zero1 | zero2 | zero3 | fsdp, got 'zero9'");
  // Values set in code are checked too.
  Config c;
  c.precision.mode = "fp8";
  EXPECT_HAS(usage_error([&] { config::validate_config(c); }), "precision.mode must be one of fp32 | bf16 | fp16");
}

TEST(ConfigCompat, RangeChecks) {
  auto check = [](const std::string& o, const std::string& needle) {
    Config c;
    config::apply_override(c, o);
    EXPECT_HAS(usage_error([&] { config::validate_config(c); }), needle);
  };
  check("parallel.zero.offload_optimizer=nvme", "offload_dir must be set");
  check("parallel.zero.reduce_bucket_mb=0", "must be positive");
  check("precision.hysteresis=0", "precision.hysteresis");
  check("precision.loss_scale_window=0", "precision.loss_scale_window");
  check("precision.min_loss_scale=0", "precision.min_loss_scale");
  check("precision.loss_scale=-1", "precision.loss_scale");
  check("train.eps=0", "train.eps");
  check("parallel.last_bucket_mb=-1", "parallel.last_bucket_mb must be >= 0");
  // AdamW and the schedule.
  check("train.beta1=1", "train.beta1 must be in [0, 1), got 1");
  check("train.beta1=-0.1", "train.beta1 must be in [0, 1)");
  check("train.beta2=1.5", "train.beta2 must be in [0, 1), got 1.5");
  check("train.weight_decay=-0.01", "train.weight_decay must be >= 0");
  check("train.grad_clip=-1", "train.grad_clip must be >= 0 (0: no clipping), got -1");
  check("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1], got 1.5");
  check("train.warmup_steps=-3", "train.warmup_steps must be >= 0, got -3");
  check("train.sample_tokens=-1", "train.sample_tokens must be >= 0");
  // Every problem at once, in one line.
  Config c;
  config::apply_override(c, "train.beta1=2");
  config::apply_override(c, "train.grad_clip=-1");
  const std::string both = usage_error([&] { config::validate_config(c); });
  EXPECT_HAS(both, "train.beta1");
  EXPECT_HAS(both, "train.grad_clip");
  Config fine;
  config::apply_override(fine, "train.beta2=0");
  config::apply_override(fine, "train.grad_clip=0");
  config::apply_override(fine, "train.min_lr_ratio=1");
  EXPECT_NO_THROW(config::validate_config(fine));
}

// What `accelerate config` writes for FSDP2: fsdp_version and
// fsdp_reshard_after_forward instead of fsdp_sharding_strategy.
TEST(AccelerateConfig, Fsdp2Keys) {
  auto v2 = write("acc_fsdp2.yaml",
                  "distributed_type: FSDP\n"
                  "fsdp_config:\n"
                  "  fsdp_version: 2\n"
                  "  fsdp_reshard_after_forward: false\n"
                  "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                  "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
                  "  fsdp_state_dict_type: SHARDED_STATE_DICT\n");
  auto c = train::load_config(v2.string());
  EXPECT_EQ(c.parallel.strategy, "fsdp");
  EXPECT_EQ(c.parallel.fsdp.sharding_strategy, "SHARD_GRAD_OP");
  EXPECT_EQ(c.parallel.fsdp.transformer_layer_cls, "LlamaDecoderLayer");
  ASSERT_EQ(c.notices.size(), 1u);
  EXPECT_NE(c.notices[0].find("fsdp_version=2"), std::string::npos) << c.notices[0];
  auto v1 = write("acc_fsdp1.yaml", "fsdp_config:\n  fsdp_version: 1\n  fsdp_reshard_after_forward: true\n");
  auto c1 = train::load_config(v1.string());
  EXPECT_EQ(c1.parallel.fsdp.sharding_strategy, "FULL_SHARD");
  EXPECT_TRUE(c1.notices.empty());
  auto v3 = write("acc_fsdp3.yaml", "fsdp_config:\n  fsdp_version: 3\n");
  EXPECT_NE(usage_error([&] { train::load_config(v3.string()); }).find("fsdp_version must be 1 or 2"), std::string::npos);
}

TEST(AccelerateConfig, FsdpConfigAndMixedPrecision) {
  auto cfg = write("accelerate.yaml",
                   "mixed_precision: bf16\n"
                   "fsdp_config:\n"
                   "  fsdp_sharding_strategy: 2\n"
                   "  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n"
                   "  fsdp_transformer_layer_cls_to_wrap: GPT2Block\n"
                   "  fsdp_min_num_params: 2000000\n"
                   "  fsdp_backward_prefetch: NO_PREFETCH\n"
                   "  fsdp_forward_prefetch: true\n"
                   "  fsdp_offload_params: true\n"
                   "  fsdp_sync_module_states: false\n"
                   "  fsdp_cpu_ram_efficient_loading: true\n"
                   "  fsdp_state_dict_type: FULL_STATE_DICT\n");
  auto c = train::load_config(cfg.string());
  EXPECT_EQ(c.parallel.strategy, "fsdp");
  EXPECT_EQ(c.precision.mode, "bf16");
  const auto& f = c.parallel.fsdp;
  EXPECT_EQ(f.sharding_strategy, "SHARD_GRAD_OP");
  EXPECT_EQ(f.auto_wrap_policy, "size");
  EXPECT_EQ(f.transformer_layer_cls, "Block");  // Hugging Face GPT-2's class is our Block
  EXPECT_EQ(f.min_num_params, 2000000);
  EXPECT_EQ(f.backward_prefetch, "NONE");
  EXPECT_TRUE(f.forward_prefetch);
  EXPECT_TRUE(f.offload_params);
  EXPECT_FALSE(f.sync_module_states);
  EXPECT_TRUE(f.cpu_ram_efficient_loading);
  EXPECT_EQ(f.state_dict_type, "FULL_STATE_DICT");

  for (auto [value, expect] : {std::pair{"1", "FULL_SHARD"}, std::pair{"3", "NO_SHARD"}, std::pair{"4", "HYBRID_SHARD"},
                               std::pair{"HYBRID_SHARD", "HYBRID_SHARD"}}) {
    auto p = write("acc_ss.yaml", std::string("fsdp_config:\n  fsdp_sharding_strategy: ") + value + "\n");
    EXPECT_EQ(train::load_config(p.string()).parallel.fsdp.sharding_strategy, expect);
  }
  auto wrap = write("acc_wrap.yaml", "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n");
  EXPECT_EQ(train::load_config(wrap.string()).parallel.fsdp.auto_wrap_policy, "transformer");
  auto no = write("acc_no.yaml", "mixed_precision: 'no'\nprecision:\n  param_dtype: fp32\n");
  EXPECT_EQ(train::load_config(no.string()).precision.mode, "fp32");
  auto fp16 = write("acc_fp16.yaml", "mixed_precision: fp16\n");
  EXPECT_EQ(train::load_config(fp16.string()).precision.mode, "fp16");
}

TEST(AccelerateConfig, Errors) {
  auto err = [](const std::string& name, const std::string& text) {
    auto p = write(name, text);
    return usage_error([&] { train::load_config(p.string()); });
  };
  EXPECT_HAS(err("a1.yaml", "fsdp_config:\n  fsdp_bogus: 2\n"), "unknown config key 'fsdp_config.fsdp_bogus'");
  EXPECT_HAS(err("a2.yaml", "fsdp_config:\n  fsdp_sharding_strategy: 5\n"),
             "fsdp_config.fsdp_sharding_strategy must be one of");
  EXPECT_HAS(err("a3.yaml", "fsdp_config:\n  fsdp_auto_wrap_policy: transformer\n"),
             "fsdp_config.fsdp_auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP");
  EXPECT_HAS(err("a4.yaml", "fsdp_config:\n  fsdp_backward_prefetch: NONE\n"), "fsdp_backward_prefetch");
  EXPECT_HAS(err("a5.yaml", "fsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n"), "LOCAL_STATE_DICT");
  EXPECT_HAS(err("a6.yaml", "fsdp_config:\n  fsdp_offload_params: maybe\n"), "fsdp_config.fsdp_offload_params");
  EXPECT_HAS(err("a7.yaml", "mixed_precision: fp4\n"), "mixed_precision must be one of no | bf16 | fp16 | fp8");
  EXPECT_HAS(err("a12.yaml", "mixed_precision: fp8\nfp8_config:\n  backend: AO\n"), "fp8_config.backend must be one of");
  EXPECT_HAS(err("a13.yaml", "mixed_precision: fp8\nfp8_config:\n  amax_compute_algo: most_recent\n"),
             "fp8_config.amax_compute_algo must be one of max");
  EXPECT_HAS(err("a14.yaml", "mixed_precision: fp8\nfp8_config:\n  opt_level: O1\n"),
             "fp8_config.opt_level applies to backend MSAMP, not TE");
  EXPECT_HAS(err("a15.yaml", "mixed_precision: bf16\nfp8_config:\n  backend: TE\n"),
             "fp8_config applies to mixed_precision: fp8");
  EXPECT_HAS(err("a16.yaml", "mixed_precision: fp8\nfp8_config:\n  amax_history_len: 0\n"),
             "precision.fp8_amax_history must be at least 1");
  EXPECT_HAS(err("a17.yaml", "mixed_precision: fp8\nfp8_config:\n  opt_level: O4\n  backend: MSAMP\n"),
             "fp8_config.opt_level must be one of O1 | O2 | O3");
  EXPECT_HAS(err("a18.yaml", "mixed_precision: fp8\nfp8_config:\n  fp8_recipe: x\n"), "unknown fp8_config key 'fp8_recipe'");
  EXPECT_HAS(err("a8.yaml", "parallel:\n  strategy: ddp\nfsdp_config:\n  fsdp_sharding_strategy: 1\n"),
             "fsdp_config implies parallel.strategy=fsdp");
  EXPECT_HAS(err("a9.yaml", "precision:\n  mode: fp32\nmixed_precision: bf16\n"),
             "mixed_precision implies precision.mode=bf16");
  EXPECT_HAS(err("a10.yaml", "distributed_type: TPU\n"), "distributed_type TPU is not supported");
  EXPECT_HAS(err("a11.yaml", "use_cuda: true\n"), "unknown config section 'use_cuda'");
}

// Accelerate's FP8: mixed_precision fp8 is FP8 linears under bf16 autocast;
// fp8_config's recipe keys land on precision.fp8_*; MSAMP's opt_level too.
TEST(ConfigCompat, AccelerateFp8) {
  const Config te = train::load_config(write("fp8_te.yaml",
                                             "mixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: E4M3\n"
                                             "  amax_history_len: 16\n  amax_compute_algo: max\n  margin: 2\n"
                                             "  interval: 1\n  use_autocast_during_eval: false\n")
                                           .string());
  EXPECT_EQ(te.precision.mode, "bf16");
  EXPECT_TRUE(te.precision.fp8);
  EXPECT_EQ(te.precision.fp8_format, "e4m3");
  EXPECT_EQ(te.precision.fp8_amax_history, 16);
  EXPECT_EQ(te.precision.fp8_margin, 2);
  EXPECT_EQ(te.precision.fp8_opt_level, "");
  const Config ms =
      train::load_config(write("fp8_msamp.yaml", "mixed_precision: fp8\nfp8_config:\n  backend: MSAMP\n").string());
  EXPECT_EQ(ms.precision.fp8_opt_level, "O2");  // Accelerate's default level
  const Config o1 = train::load_config(
      write("fp8_o1.yaml", "mixed_precision: fp8\nfp8_config:\n  backend: msamp\n  opt_level: O1\n").string());
  EXPECT_EQ(o1.precision.fp8_opt_level, "O1");
  const Config plain = train::load_config(write("fp8_plain.yaml", "mixed_precision: fp8\n").string());
  EXPECT_TRUE(plain.precision.fp8);
  EXPECT_EQ(plain.precision.fp8_format, "hybrid");
  // An explicit key that disagrees with the file is an error; one that agrees is fine.
  EXPECT_HAS(usage_error([] {
               train::load_config(write("fp8_c.yaml", "mixed_precision: fp8\n").string(), {"precision.fp8=false"});
             }),
             "implies precision.fp8=true");
  EXPECT_TRUE(
      train::load_config(write("fp8_d.yaml", "mixed_precision: fp8\n").string(), {"precision.fp8=true"}).precision.fp8);
}

// ---- DeepSpeed -------------------------------------------------------------

Config ds(const std::string& name, const std::string& json, int dp, Config base = {}) {
  train::apply_deepspeed_config(base, write(name, json).string(), dp);
  return base;
}

std::string ds_error(const std::string& name, const std::string& json, int dp = 1, Config base = {}) {
  auto path = write(name, json);
  auto m = usage_error([&] { train::apply_deepspeed_config(base, path.string(), dp); });
  EXPECT_HAS(m, path.string());
  return m;
}

TEST(DeepSpeedConfig, TypicalZero2Bf16) {
  auto c = ds("z2.json", R"({
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": false,
    "bf16": {"enabled": true},
    "zero_optimization": {"stage": 2, "allgather_partitions": true, "allgather_bucket_size": 2e8,
                          "overlap_comm": true, "reduce_scatter": true, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                  "warmup_num_steps": 100, "total_num_steps": 1000, "warmup_type": "linear"}}})",
              4);
  EXPECT_EQ(c.parallel.strategy, "zero2");
  EXPECT_EQ(c.precision.mode, "bf16");
  EXPECT_EQ(c.precision.param_dtype, "bf16");
  EXPECT_EQ(c.train.global_batch, 64);
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_EQ(c.train.grad_clip, 1.0);
  EXPECT_EQ(c.metrics.log_every, 10);
  EXPECT_DOUBLE_EQ(c.parallel.zero.allgather_bucket_mb, 2e8 * 2 / (1 << 20));  // bf16 elements
  EXPECT_DOUBLE_EQ(c.parallel.zero.reduce_bucket_mb, 5e8 * 2 / (1 << 20));
  EXPECT_TRUE(c.parallel.zero.overlap_comm);
  EXPECT_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.train.beta2, 0.95);
  EXPECT_EQ(c.train.weight_decay, 0.1);
  EXPECT_EQ(c.train.lr_schedule, "linear");
  EXPECT_EQ(c.train.warmup_type, "linear");
  EXPECT_EQ(c.train.warmup_steps, 100);
  EXPECT_EQ(c.train.steps, 1000);
  EXPECT_EQ(c.train.min_lr_ratio, 0.0);
}

TEST(DeepSpeedConfig, Zero3Fp16WithAutoValues) {
  Config base;
  base.train.global_batch = 48;
  base.train.micro_batch = 2;
  base.train.lr = 5e-4;
  base.train.grad_clip = 0.5;
  auto c = ds("z3.json", R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 3},
    "zero_optimization": {"stage": 3, "overlap_comm": true, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": 1048576, "stage3_max_live_parameters": 1e9,
                          "offload_param": {"device": "cpu", "pin_memory": true}},
    "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                             "weight_decay": "auto", "adam_w_mode": true}}})",
              3, base);
  EXPECT_EQ(c.parallel.strategy, "zero3");
  EXPECT_EQ(c.precision.mode, "fp32");  // "auto": the YAML's precision stays
  // fp16 "auto" resolved off: its loss-scaling keys act on nothing (notices),
  // and precision.* keeps the YAML's values.
  EXPECT_EQ(c.precision.initial_scale_power, 16);
  EXPECT_EQ(c.precision.hysteresis, 2);
  EXPECT_EQ(c.precision.loss_scale_window, 2000);
  EXPECT_EQ(c.train.global_batch, 48);
  EXPECT_EQ(c.train.micro_batch, 2);
  EXPECT_EQ(c.train.lr, 5e-4);
  EXPECT_EQ(c.train.grad_clip, 0.5);
  // reduce_bucket_size: stage 3 does not read it (a notice); the YAML's stays.
  EXPECT_DOUBLE_EQ(c.parallel.zero.reduce_bucket_mb, 25);
  EXPECT_DOUBLE_EQ(c.parallel.zero.prefetch_bucket_mb, 4.0);  // 1 Mi fp32 elements
  EXPECT_EQ(c.parallel.zero.offload_param, "cpu");  // parameter offload (Note [Offloaded shards])
  EXPECT_FALSE(c.parallel.zero.offload_pin_memory);  // DeepSpeed's pin_memory is a notice, not ours
  std::string notes;
  for (const auto& n : c.notices) notes += n + "\n";
  ASSERT_EQ(c.notices.size(), 5u) << notes;  // pin_memory, fp16's three, reduce_bucket_size
  EXPECT_EQ(notes.find("offload_param.device"), std::string::npos) << notes;
  EXPECT_HAS(notes, "fp16.initial_scale_power=12 has no effect");
  EXPECT_HAS(notes, "zero_optimization.reduce_bucket_size=\"auto\" has no effect");

  auto f = ds("z3fp16.json", R"({"fp16": {"enabled": true}, "zero_optimization": {"stage": 3}})", 2);
  EXPECT_EQ(f.precision.mode, "fp16");
  EXPECT_EQ(f.precision.param_dtype, "fp16");
  EXPECT_EQ(f.precision.loss_scale, 0);
}

TEST(DeepSpeedConfig, BatchTriple) {
  Config base;  // YAML: global 32, micro 8
  auto c = ds("b1.json", R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4})", 2, base);
  EXPECT_EQ(c.train.global_batch, 64);  // accumulation 8
  EXPECT_EQ(c.train.micro_batch, 4);
  c = ds("b2.json", R"({"train_batch_size": 64, "gradient_accumulation_steps": 2})", 4, base);
  EXPECT_EQ(c.train.micro_batch, 8);
  c = ds("b3.json", R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5})", 2, base);
  EXPECT_EQ(c.train.global_batch, 30);
  c = ds("b4.json", R"({"gradient_accumulation_steps": 2})", 2, base);  // micro from the YAML
  EXPECT_EQ(c.train.global_batch, 32);
  EXPECT_EQ(c.train.micro_batch, 8);
  c = ds("b5.json", R"({"train_micro_batch_size_per_gpu": 2})", 4, base);  // global from the YAML
  EXPECT_EQ(c.train.global_batch, 32);
  EXPECT_EQ(c.train.micro_batch, 2);
  c = ds("b6.json", R"({"train_batch_size": 16})", 2, base);  // micro 8 from the YAML, accumulation 1
  EXPECT_EQ(c.train.global_batch, 16);
  EXPECT_EQ(c.train.micro_batch, 8);

  auto m = ds_error("b7.json", R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                    "gradient_accumulation_steps": 3})",
                    2);
  EXPECT_HAS(m,
             "train_batch_size=64 does not equal train_micro_batch_size_per_gpu=4 x "
             "gradient_accumulation_steps=3 x data-parallel size 2");
  EXPECT_HAS(ds_error("b8.json", R"({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8})", 2),
             "is not a multiple");
  EXPECT_HAS(ds_error("b9.json", R"({"train_batch_size": 0})"), "train_batch_size must be at least 1");
}

TEST(DeepSpeedConfig, Errors) {
  auto m = ds_error("e1.json", R"({"zero_optimization": {"stage": 2, "sub_group_sise": 1e9}})");
  EXPECT_HAS(m, "unknown key 'zero_optimization.sub_group_sise'");
  EXPECT_HAS(ds_error("e2.json", R"({"steps_per_print": 10, "tensorboard": {}})"), "unknown key 'tensorboard'");
  EXPECT_HAS(ds_error("e3.json", R"({"zero_optimization": {"stage": 4}})"),
             "zero_optimization.stage must be 0, 1, 2 or 3, got 4");
  EXPECT_HAS(ds_error("e4.json", R"({"zero_optimization": {"stage": "two"}})"),
             "zero_optimization.stage must be a number");
  EXPECT_HAS(ds_error("e5.json", R"({"train_batch_size": 8,})"), "not valid JSON at byte 23");
  EXPECT_HAS(ds_error("e6.json", R"({"fp16": {"enabled": 1}})"), "fp16.enabled must be true or false");
  EXPECT_HAS(ds_error("e7.json", R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})"), "both be true");
  EXPECT_HAS(ds_error("e8.json", R"({"optimizer": {"type": "Lamb", "params": {}}})"), "'Lamb' is not supported");
  EXPECT_HAS(ds_error("e9.json", R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})"),
             "L2-regularised Adam");
  EXPECT_HAS(ds_error("e10.json", R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})"),
             "unknown key 'optimizer.params.amsgrad'");
  EXPECT_HAS(ds_error("e11.json", R"({"scheduler": {"type": "OneCycle", "params": {}}})"),
             "'OneCycle' is not supported");
  EXPECT_HAS(ds_error("e12.json", R"({"wall_clock_breakdown": "yes"})"), "wall_clock_breakdown must be true or false");
  EXPECT_HAS(ds_error("e13.json", R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})"),
             "zero_optimization.offload_optimizer.device must be none, cpu or nvme");
  EXPECT_HAS(ds_error("e14.json", R"({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                     "buffer_cnt": 4}}})"),
             "unknown key 'zero_optimization.offload_optimizer.buffer_cnt'");
  EXPECT_HAS(ds_error("e15.json", "[1, 2]"), "the top level must be an object");
  // Note [Strict JSON]: DeepSpeed refuses repeated keys; the last one must not win silently.
  EXPECT_HAS(ds_error("e16.json", R"({"zero_optimization": {"stage": 2, "stage": 3}})"),
             "key 'zero_optimization.stage' appears twice in one object");
  EXPECT_HAS(ds_error("e17.json", R"({"gradient_clipping": 1e400})"), "number overflow parsing '1e400'");
  EXPECT_HAS(ds_error("e18.json", "{\"steps_per_print\": 1\x80}"), "not valid JSON at byte 21");
  EXPECT_HAS(ds_error("e16.json", R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})"),
             "optimizer.params.betas must be a list of two numbers");
  auto missing = usage_error([] {
    Config c;
    train::apply_deepspeed_config(c, "/nonexistent/ds.json", 1);
  });
  EXPECT_HAS(missing, "/nonexistent/ds.json");
}

TEST(DeepSpeedConfig, OffloadNvmeAndOptimizerDefaults) {
  auto c = ds("nvme.json", R"({
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})",
              1);
  EXPECT_EQ(c.parallel.zero.offload_optimizer, "nvme");
  EXPECT_EQ(c.parallel.zero.offload_param, "nvme");
  EXPECT_EQ(c.parallel.zero.offload_dir, "/local_nvme");
  EXPECT_FALSE(c.parallel.zero.offload_pin_memory);  // a notice instead (Note [DeepSpeed mapping])
  // "Adam" is AdamW by DeepSpeed's default adam_w_mode; absent params take DeepSpeed's defaults.
  EXPECT_EQ(c.train.lr, 1e-4);
  EXPECT_EQ(c.train.beta2, 0.999);
  EXPECT_EQ(c.train.weight_decay, 0.0);
  EXPECT_HAS(ds_error("nvme2.json", R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})"),
             "offload_dir must be set");
  EXPECT_HAS(ds_error("nvme3.json", R"({"zero_optimization": {
               "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
               "offload_param": {"device": "nvme", "nvme_path": "/b"}}})"),
             "zero_optimization.offload_param.nvme_path differs");
  auto z0 = ds("z0.json", R"({"zero_optimization": {"stage": 0}})", 1);
  EXPECT_EQ(z0.parallel.strategy, "ddp");
}

TEST(DeepSpeedConfig, Schedulers) {
  auto w = ds("wlr.json", R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5,
                             "warmup_max_lr": 1e-3, "warmup_num_steps": 50}}})",
              1);
  EXPECT_EQ(w.train.lr_schedule, "constant");
  EXPECT_EQ(w.train.lr, 1e-3);
  EXPECT_NEAR(w.train.warmup_start_ratio, 0.01, 1e-12);
  EXPECT_EQ(w.train.warmup_steps, 50);
  EXPECT_EQ(w.train.warmup_type, "log");  // DeepSpeed's default
  Config base;
  base.train.lr = 2e-4;
  auto cos = ds("wcos.json", R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500,
                                 "warmup_num_steps": 20, "cos_min_ratio": 0.05, "warmup_type": "linear"}}})",
                1, base);
  EXPECT_EQ(cos.train.lr_schedule, "cosine");
  EXPECT_EQ(cos.train.lr, 2e-4);
  EXPECT_EQ(cos.train.steps, 500);
  EXPECT_EQ(cos.train.min_lr_ratio, 0.05);
  EXPECT_EQ(cos.train.warmup_start_ratio, 0.0);
  EXPECT_HAS(ds_error("wbad.json", R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}})"),
             "unknown key 'scheduler.params.total_num_steps'");
}

TEST(ConfigCompatSchedule, ShapesAndDefaultUnchanged) {
  optim::ScheduleOptions s{4, 14, 0.1};
  EXPECT_DOUBLE_EQ(optim::lr_at(0, 1.0, s), 0.25);  // unchanged default: (step + 1) / W
  EXPECT_DOUBLE_EQ(optim::lr_at(3, 1.0, s), 1.0);
  EXPECT_NEAR(optim::lr_at(14, 1.0, s), 0.1, 1e-12);
  s.decay = optim::Decay::Linear;
  EXPECT_NEAR(optim::lr_at(9, 1.0, s), 0.55, 1e-12);  // halfway down from 1 to 0.1
  s.decay = optim::Decay::Constant;
  EXPECT_DOUBLE_EQ(optim::lr_at(100, 1.0, s), 1.0);
  s.warmup = optim::Warmup::Log;
  s.warmup_start_ratio = 0.5;
  EXPECT_NEAR(optim::lr_at(0, 1.0, s), 0.5 + 0.5 * std::log(2.0) / std::log(5.0), 1e-12);
  EXPECT_DOUBLE_EQ(optim::lr_at(3, 1.0, s), 1.0);
}

}  // namespace config_compat_test
}  // namespace scaletrain

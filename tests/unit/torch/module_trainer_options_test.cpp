// The module trainer's options from the CLI's YAML keys
// (train::module_trainer_options): the keys that apply to a user module are
// mapped, every other key set away from its default is refused by name, and
// typed options with a bad value name their field. No processes needed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace module_trainer_options_test {

config::Config with(const std::vector<std::string>& overrides) {
  config::Config c;
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

// The message of module_trainer_options' UsageError ("" when it accepts).
std::string refusal(const std::vector<std::string>& overrides) {
  try {
    module_trainer_options(with(overrides));
    return "";
  } catch (const UsageError& e) {
    return e.what();
  }
}

TEST(ModuleTrainerOptions, YamlFileMapsTheKeysThatApply) {
  const auto dir = std::filesystem::temp_directory_path() / ("st_module_trainer_yaml_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "run.yaml").string();
  std::ofstream(path) << "train:\n  steps: 40\n  global_batch: 64\n  micro_batch: 4\n  lr: 0.002\n"
                         "  warmup_steps: 5\n  lr_schedule: linear\n  grad_clip: 0.5\n  seed: 9\n  beta2: 0.99\n"
                         "parallel:\n  strategy: zero3\n"
                         "checkpoint:\n  dir: ckpt\n  every: 10\n  keep: 2\n"
                         "metrics:\n  path: m.jsonl\n  log_every: 5\n  trace_steps: [3, 4]\n";
  const ModuleTrainerOptions o = module_trainer_options(load_config(path));
  std::filesystem::remove_all(dir);
  EXPECT_EQ(o.strategy, ModuleStrategy::Zero3);
  EXPECT_EQ(o.steps, 40);
  EXPECT_EQ(o.global_batch, 64);
  EXPECT_EQ(o.micro_batch, 4);
  EXPECT_EQ(o.seed, 9u);
  EXPECT_EQ(o.clip_grad_norm, 0.5);
  ASSERT_TRUE(o.lr_schedule.has_value());
  EXPECT_EQ(o.peak_lr, 0.002);
  EXPECT_EQ(o.lr_schedule->warmup_steps, 5);
  EXPECT_EQ(o.lr_schedule->total_steps, 40);
  EXPECT_EQ(o.lr_schedule->decay, optim::Decay::Linear);
  ASSERT_TRUE(o.adamw.has_value());
  EXPECT_EQ(o.adamw->lr, 0.002);
  EXPECT_EQ(o.adamw->beta2, 0.99);
  EXPECT_EQ(o.checkpoint_dir, "ckpt");
  EXPECT_EQ(o.checkpoint_every, 10);
  EXPECT_EQ(o.checkpoint_keep, 2);
  EXPECT_EQ(o.metrics_path, "m.jsonl");
  EXPECT_EQ(o.log_every, 5);
  EXPECT_EQ(o.trace_steps, (std::vector<int64_t>{3, 4}));
}

TEST(ModuleTrainerOptions, StrategiesAndUnitsHaveTheCliNames) {
  EXPECT_EQ(module_trainer_options(with({})).strategy, ModuleStrategy::DDP);
  EXPECT_EQ(module_trainer_options(with({"parallel.strategy=zero1"})).strategy, ModuleStrategy::Zero1);
  EXPECT_EQ(
      module_trainer_options(with({"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=NO_SHARD"})).strategy,
      ModuleStrategy::DDP);
  ModuleTrainerOptions o = module_trainer_options(
      with({"parallel.strategy=fsdp", "parallel.fsdp.transformer_layer_cls=BlockImpl, torch::nn::LinearImpl",
            "parallel.fsdp.backward_prefetch=BACKWARD_POST", "parallel.fsdp.state_dict_type=FULL_STATE_DICT",
            "checkpoint.dir=ckpt"}));
  EXPECT_EQ(o.strategy, ModuleStrategy::FullShard);
  EXPECT_EQ(o.units.types, (std::vector<std::string>{"BlockImpl", "torch::nn::LinearImpl"}));
  EXPECT_EQ(o.sharded.backward_prefetch, parallel::fsdp::BackwardPrefetch::Post);
  EXPECT_TRUE(o.full_state_dict);
  o = module_trainer_options(with({"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=SHARD_GRAD_OP",
                                   "parallel.fsdp.auto_wrap_policy=size", "parallel.fsdp.min_num_params=1000"}));
  EXPECT_EQ(o.strategy, ModuleStrategy::ShardGradOp);
  EXPECT_EQ(o.units.min_num_params, 1000);
  o = module_trainer_options(
      with({"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=HYBRID_SHARD", "parallel.dp_replicate=2"}));
  EXPECT_EQ(o.strategy, ModuleStrategy::HybridShard);
  EXPECT_EQ(o.dp_replicate, 2);
  o = module_trainer_options(with({"parallel.bucket_cap_mb=2", "parallel.find_unused_parameters=true"}));
  EXPECT_EQ(o.ddp.bucket_cap_bytes, 2 << 20);
  EXPECT_TRUE(o.ddp.find_unused_parameters);
  EXPECT_EQ(refusal({"train.sample_tokens=0"}), "") << "no sample is what the module trainer does";
  // Tensor parallelism's degree, bf16 autocast and LoRA reach a user module.
  o = module_trainer_options(with({"parallel.tp=2", "precision.mode=bf16", "finetune.method=lora",
                                   "finetune.target_modules=q, v"}));
  EXPECT_EQ(o.tp, 2);
  EXPECT_EQ(o.autocast, at::kBFloat16);
  ASSERT_TRUE(o.lora.has_value());
  EXPECT_EQ(o.lora->target_modules, (std::vector<std::string>{"q", "v"}));
  // bf16 storage with fp32 buffers, reduced in fp32, under a sharded strategy.
  o = module_trainer_options(with({"parallel.strategy=zero2", "precision.param_dtype=bf16",
                                   "precision.buffer_dtype=fp32", "precision.reduce_dtype=fp32"}));
  EXPECT_EQ(o.param_dtype, at::kBFloat16);
  EXPECT_EQ(o.buffer_dtype, at::kFloat);
  EXPECT_EQ(o.sharded.reduce_dtype, at::kFloat);
  // fp16 autocast with DeepSpeed's dynamic scaler from the loss-scale keys; bf16 scaled by scale_bf16.
  o = module_trainer_options(with({"precision.mode=fp16", "precision.initial_scale_power=10",
                                   "precision.loss_scale_window=50", "precision.hysteresis=3",
                                   "precision.min_loss_scale=4"}));
  EXPECT_EQ(o.autocast, at::kHalf);
  ASSERT_TRUE(o.loss_scaling.has_value());
  EXPECT_EQ(o.loss_scaling->static_scale, 0);
  EXPECT_EQ(o.loss_scaling->initial_scale, 1024);
  EXPECT_EQ(o.loss_scaling->growth_interval, 50);
  EXPECT_EQ(o.loss_scaling->hysteresis, 3);
  EXPECT_EQ(o.loss_scaling->min_scale, 4);
  EXPECT_EQ(module_trainer_options(with({"precision.mode=fp16", "precision.loss_scale=128"})).loss_scaling->static_scale,
            128);
  o = module_trainer_options(with({"precision.mode=bf16", "precision.scale_bf16=true"}));
  EXPECT_EQ(o.autocast, at::kBFloat16);
  EXPECT_TRUE(o.loss_scaling.has_value());
  EXPECT_FALSE(module_trainer_options(with({"precision.mode=bf16"})).loss_scaling.has_value());
  // Pipeline stages of a Sequential, with the schedule and chunks per rank.
  o = module_trainer_options(with({"parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"}));
  EXPECT_EQ(o.pp, 2);
  EXPECT_EQ(o.pp_schedule, parallel::pipeline::Schedule::Interleaved);
  EXPECT_EQ(o.virtual_stages, 2);
  // FP8 on the module's LoraLinear layers, with the scaling keys; not with tensor parallelism.
  o = module_trainer_options(with({"precision.fp8=true", "precision.fp8_format=e4m3", "precision.fp8_recipe=current",
                                   "precision.fp8_amax_history=16", "precision.fp8_margin=1"}));
  ASSERT_TRUE(o.fp8.has_value());
  EXPECT_EQ(o.fp8->mix, precision::Fp8Mix::E4M3);
  EXPECT_FALSE(o.fp8->delayed);
  EXPECT_EQ(o.fp8->history, 16);
  EXPECT_EQ(o.fp8->margin, 1);
  EXPECT_NE(refusal({"precision.fp8=true", "parallel.tp=2"}).find("precision.fp8=true would have no effect"),
            std::string::npos);
  // Activation checkpointing of every submodule that calls train::checkpointed.
  o = module_trainer_options(with({"model.activation_checkpointing=full"}));
  ASSERT_TRUE(o.activation_checkpointing.has_value());
  EXPECT_TRUE(o.activation_checkpointing->blocks.types.empty());
  EXPECT_EQ(o.activation_checkpointing->every, 1);
  EXPECT_FALSE(module_trainer_options(with({})).activation_checkpointing.has_value());
}

TEST(ModuleTrainerOptions, KeysThatDoNotApplyAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"model.preset=gpt2", "model.preset"},
      {"data.path=tokens.tok", "data.path"},
      {"parallel.virtual_stages=2", "parallel.virtual_stages"},  // pp 1
      {"parallel.cp=2", "parallel.cp"},
      {"parallel.ep=2", "parallel.ep"},
      {"finetune.method=qlora", "finetune.method"},
      {"finetune.r=4", "finetune.r"},  // method full
      {"precision.param_dtype=bf16", "precision.param_dtype"},   // strategy ddp: no masters
      {"precision.reduce_dtype=fp32", "precision.reduce_dtype"},  // strategy ddp
      {"precision.buffer_dtype=bf16", "precision.buffer_dtype"},  // param_dtype fp32
      {"precision.fp8_margin=1", "precision.fp8_margin"},  // precision.fp8 off
      {"precision.hysteresis=4", "precision.hysteresis"},  // no loss scaling (fp32)
      {"precision.scale_bf16=true", "precision.scale_bf16"},  // nothing bf16
      {"parallel.zero.offload_param=cpu", "parallel.zero"},  // strategy ddp
      {"train.device=cpu", "train.device"},
      {"parallel.timeout_s=10", "parallel.timeout_s"},
      {"metrics.peak_flops=1e12", "metrics.peak_flops"},
      {"checkpoint.every=5", "checkpoint.every"},                // no checkpoint.dir
      {"parallel.fsdp.forward_prefetch=true", "parallel.fsdp"},  // strategy ddp
      {"parallel.dp_replicate=2", "parallel.dp_replicate"}};
  for (const auto& [assignment, key] : cases) {
    const std::string why = refusal({assignment});
    EXPECT_NE(why.find(key), std::string::npos) << assignment << ": " << why;
    EXPECT_NE(why.find("would have no effect"), std::string::npos) << assignment << ": " << why;
  }
  // A pipeline's keys that a user module's pipeline does not read.
  EXPECT_NE(refusal({"parallel.pp=2", "parallel.microbatches=8"}).find("parallel.microbatches=8 would have no effect"),
            std::string::npos);
  EXPECT_NE(refusal({"parallel.pp=2", "parallel.pp_balance=time"}).find("parallel.pp_balance=time would have no effect"),
            std::string::npos);
  // Under a sharded strategy, DDP's keys and the ZeRO engine's knobs.
  EXPECT_NE(refusal({"parallel.strategy=zero2", "parallel.bucket_cap_mb=10"}).find("parallel.bucket_cap_mb"),
            std::string::npos);
  EXPECT_NE(refusal({"parallel.strategy=zero2", "parallel.zero.reduce_bucket_mb=10"}).find("parallel.zero"),
            std::string::npos);
  // fp16 storage (fp16 autocasts over fp32 parameters here), named under any strategy.
  EXPECT_NE(refusal({"parallel.strategy=zero3", "precision.param_dtype=fp16"}).find("fp16 storage is not run"),
            std::string::npos);
  // Every such key at once.
  const std::string all = refusal({"model.preset=gpt2", "data.path=x", "parallel.cp=2"});
  EXPECT_NE(all.find("3 problems"), std::string::npos) << all;
  // Values the config itself refuses keep their message.
  EXPECT_NE(refusal({"train.micro_batch=0"}).find("train.micro_batch"), std::string::npos);
}

TEST(ModuleTrainerOptions, TypedOptionsNameTheBadField) {
  auto field_of = [](const std::function<void(ModuleTrainerOptions&)>& edit) -> std::string {
    ModuleTrainerOptions o;
    edit(o);
    try {
      validate(o);
      return "";
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
  };
  EXPECT_EQ(field_of([](auto&) {}), "");
  EXPECT_NE(field_of([](auto& o) { o.micro_batch = 0; }).find("ModuleTrainerOptions.micro_batch"), std::string::npos);
  EXPECT_NE(field_of([](auto& o) { o.global_batch = 30; }).find("ModuleTrainerOptions.global_batch"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) { o.units.types = {"LinearImpl"}; }).find("ModuleTrainerOptions.units"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) { o.strategy = ModuleStrategy::HybridShard; }).find("replicate_group"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) { o.checkpoint_keep = 3; }).find("ModuleTrainerOptions.checkpoint_keep"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) {
              o.checkpoint_dir = "d";
              o.checkpoint_async = true;
              o.full_state_dict = true;
            }).find("ModuleTrainerOptions.checkpoint_async"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) {
              o.lr_schedule = optim::ScheduleOptions{};
              o.peak_lr = 0;
            }).find("ModuleTrainerOptions.peak_lr"),
            std::string::npos);
  EXPECT_NE(field_of([](auto& o) {
              o.loss_scaling = precision::LossScalerOptions{};
              o.loss_scaling->hysteresis = 0;
            }).find("ModuleTrainerOptions.loss_scaling is unusable"),
            std::string::npos);
}

}  // namespace module_trainer_options_test
}  // namespace scaletrain::train

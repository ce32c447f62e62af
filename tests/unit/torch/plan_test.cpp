// The validated plan (train/plan/plan.h): every problem at once, settings that
// would have no effect refused, and the dtypes and flags the run will use.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace plan_test {

config::Config base(const std::vector<std::string>& overrides = {}) {
  config::Config c;
  c.data.path = "tokens.tok";  // not opened by the plan
  c.model.n_layer = 2;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  for (const auto& o : overrides) apply_override(c, o);
  return c;
}

// The message of make_plan's UsageError ("" when it accepts).
std::string refusal(const std::vector<std::string>& overrides, int world = 2) {
  try {
    make_plan(base(overrides), world);
    return "";
  } catch (const UsageError& e) {
    return e.what();
  }
}

void expect_refused(const std::vector<std::string>& overrides, const std::string& needle, int world = 2) {
  const std::string msg = refusal(overrides, world);
  EXPECT_NE(msg.find(needle), std::string::npos) << "got: '" << msg << "'";
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
}

TEST(Plan, AcceptsTheDefaultsAndLaysOutTheBatch) {
  const Plan p = make_plan(base(), 2);
  EXPECT_EQ(p.dims.dp(), 2);
  EXPECT_EQ(p.micro_batch, 2);
  EXPECT_EQ(p.accum, 2);  // 8 = 2 x 2 x dp 2
  EXPECT_TRUE(p.notices.empty());
  EXPECT_FALSE(p.full_state_dict);
}

// The strings of the parallel and precision sections become the plan's
// enums once; the engines are chosen from these.
TEST(Plan, ResolvesTheStrategyIntoOneEnum) {
  const std::vector<std::pair<std::vector<std::string>, config::DataParallelism>> cases{
      {{"parallel.strategy=ddp"}, config::DataParallelism::kDdp},
      {{"parallel.strategy=zero1"}, config::DataParallelism::kZero1},
      {{"parallel.strategy=zero2"}, config::DataParallelism::kZero2},
      {{"parallel.strategy=zero3"}, config::DataParallelism::kZero3},
      {{"parallel.strategy=fsdp"}, config::DataParallelism::kFullShard},
      {{"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=SHARD_GRAD_OP"}, config::DataParallelism::kShardGradOp},
      {{"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=NO_SHARD"}, config::DataParallelism::kNoShard},
      {{"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=HYBRID_SHARD", "parallel.dp_replicate=2"},
       config::DataParallelism::kHybridShard},
  };
  for (const auto& [overrides, want] : cases) {
    const Plan p = make_plan(base(overrides), 4);
    EXPECT_EQ(p.data_parallel, want) << overrides[0] << " -> " << to_string(p.data_parallel);
  }
  EXPECT_TRUE(runs_ddp(config::DataParallelism::kNoShard));
  EXPECT_FALSE(runs_ddp(config::DataParallelism::kZero1));
  EXPECT_TRUE(shards_params(config::DataParallelism::kHybridShard));
  EXPECT_FALSE(shards_params(config::DataParallelism::kShardGradOp));
  EXPECT_EQ(zero_stage(config::DataParallelism::kZero2), 2);
  EXPECT_EQ(zero_stage(config::DataParallelism::kFullShard), 0);
  EXPECT_EQ(to_string(config::DataParallelism::kShardGradOp), "fsdp SHARD_GRAD_OP");

  const Plan o3 = make_plan(base({"parallel.strategy=zero3", "precision.fp8=true", "precision.fp8_opt_level=O3",
                                  "parallel.zero.offload_optimizer=cpu"}),
                            2);
  EXPECT_EQ(o3.fp8_level, Fp8OptLevel::kO3);
  EXPECT_EQ(o3.offload_optimizer, Offload::kCpu);
  EXPECT_EQ(o3.offload_params, Offload::kNone);
  EXPECT_EQ(make_plan(base({"parallel.strategy=fsdp", "parallel.fsdp.offload_params=true"}), 2).offload_params,
            Offload::kCpu);
  EXPECT_EQ(make_plan(base(), 2).fp8_level, Fp8OptLevel::kNone);
  // A name the config reader refuses first (overrides, YAML) is refused
  // here too when a program fills the Config itself.
  config::Config bad = base();
  bad.parallel.strategy = "zero4";
  try {
    make_plan(bad, 2);
    ADD_FAILURE() << "parallel.strategy=zero4 was planned";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.strategy 'zero4' is not one of"), std::string::npos) << e.what();
  }
}

TEST(Plan, ReportsEveryProblemAtOnce) {
  const std::string msg = refusal(
      {"parallel.tp=3", "parallel.schedule=gpipe", "precision.hysteresis=4", "parallel.zero.offload_pin_memory=true"});
  EXPECT_NE(msg.find("problems in the config"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tp=3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("parallel.schedule=gpipe would have no effect"), std::string::npos) << msg;
  EXPECT_NE(msg.find("precision.hysteresis=4 would have no effect"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offload_pin_memory=true needs a CUDA device"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(Plan, Bf16ParametersNeedMasterWeightsOnlyUnderDdp) {
  // The fsdp section's NO_SHARD is DDP; under zero1-3 it is not read at all.
  EXPECT_EQ(refusal({"parallel.strategy=zero2", "precision.mode=bf16", "precision.param_dtype=bf16"}), "");
  expect_refused({"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=NO_SHARD", "precision.mode=bf16",
                  "precision.param_dtype=bf16"},
                 "fsdp NO_SHARD (which is DDP) has none");
  expect_refused({"precision.mode=bf16", "precision.param_dtype=bf16"}, "ddp has none");
}

TEST(Plan, CommDtypeIsTheReduceDtypeUnderEveryStrategy) {
  for (const char* s : {"ddp", "zero1", "zero2", "zero3", "fsdp"}) {
    const Plan p = make_plan(base({std::string("parallel.strategy=") + s, "parallel.comm_dtype=bf16"}), 2);
    EXPECT_EQ(p.policy.reduce, at::kBFloat16) << s;
  }
  expect_refused({"parallel.comm_dtype=bf16", "precision.reduce_dtype=fp32"}, "disagree");
}

TEST(Plan, Fp8CombinationsAndLevels) {
  EXPECT_EQ(refusal({"precision.fp8=true", "precision.fp8_opt_level=O1"}), "");
  EXPECT_EQ(refusal({"parallel.comm_dtype=fp8", "precision.fp8_format=e4m3"}), "");  // the wire's format
  EXPECT_EQ(refusal({"precision.fp8=true", "precision.mode=bf16", "precision.scale_bf16=true"}), "");
  expect_refused({"precision.fp8_opt_level=O1"}, "needs precision.fp8=true");
  // GPT-2 under tp: the norms, GELU and AdamW still have a fused path to turn off.
  EXPECT_EQ(refusal({"parallel.tp=2", "model.fused=false"}), "");
  EXPECT_EQ(refusal({"precision.fp8=true", "precision.fp8_opt_level=O2", "parallel.strategy=zero3"}), "");
  // O3 gathers FP8 weights and shards fp16 masters: sharded parameters only.
  EXPECT_EQ(refusal({"precision.fp8=true", "precision.fp8_opt_level=O3", "parallel.strategy=zero3"}), "");
  EXPECT_EQ(refusal({"precision.fp8=true", "precision.fp8_opt_level=O3", "parallel.strategy=fsdp"}), "");
  expect_refused({"precision.fp8=true", "precision.fp8_opt_level=O3"}, "it needs parallel.strategy=zero3 or fsdp");
  expect_refused({"precision.fp8=true", "precision.fp8_opt_level=O3", "parallel.strategy=zero2"}, "(it is zero2;");
  expect_refused({"precision.fp8=true", "precision.fp8_opt_level=O3", "parallel.strategy=fsdp",
                  "parallel.fsdp.sharding_strategy=NO_SHARD"},
                 "(it is fsdp NO_SHARD;");
  expect_refused({"precision.fp8=true", "precision.fp8_opt_level=O1", "parallel.comm_dtype=bf16"},
                 "not as parallel.comm_dtype=bf16");
  expect_refused({"parallel.comm_dtype=fp8", "parallel.strategy=zero2", "precision.mode=bf16",
                  "precision.param_dtype=bf16"},
                 "precision.reduce_dtype must be fp32 (it is bf16)");
  expect_refused({"precision.fp8_margin=2"}, "precision.fp8_margin would have no effect: precision.fp8 is off");
  expect_refused({"precision.fp8=true", "precision.fp8_recipe=current", "precision.fp8_amax_history=8"},
                 "keeps no history");
  expect_refused({"precision.fp8=true", "finetune.method=qlora"}, "NF4 base weight is not cast to FP8");
}

// Mixture of Experts and expert parallelism: bad degrees and settings are
// one-line refusals, every problem named.
TEST(Plan, MoeAndExpertParallelism) {
  const std::string moe = "model.preset=mixtral-tiny";
  EXPECT_EQ(refusal({moe, "parallel.ep=2", "train.sample_tokens=0"}), "");
  EXPECT_EQ(refusal({moe, "parallel.ep=4", "train.sample_tokens=0"}, 4), "");
  expect_refused({moe, "parallel.ep=3", "train.sample_tokens=0"}, "parallel.ep=3 does not divide model.num_local_experts=4", 3);
  expect_refused({moe, "parallel.ep=4", "train.sample_tokens=0"}, "parallel.ep=4 does not divide the 2 data-parallel ranks");
  expect_refused({moe, "parallel.ep=0"}, "parallel.ep must be at least 1");
  expect_refused({"parallel.ep=2", "train.sample_tokens=0"}, "would have no effect: the model has no MoE layers");
  expect_refused({moe, "model.num_experts_per_tok=5"}, "model.num_experts_per_tok=5 must be between 1 and model.num_local_experts=4");
  for (const char* strategy : {"parallel.strategy=zero1", "parallel.strategy=zero2", "parallel.strategy=zero3",
                               "parallel.strategy=fsdp"})
    EXPECT_EQ(refusal({moe, "parallel.ep=2", strategy, "train.sample_tokens=0"}), "") << strategy;
  expect_refused({moe, "parallel.ep=2", "parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=HYBRID_SHARD",
                  "parallel.dp_replicate=2", "train.sample_tokens=0"},
                 "parallel.ep=2 with parallel.fsdp.sharding_strategy=HYBRID_SHARD is not available", 4);
  expect_refused({moe, "parallel.tp=2"}, "with MoE layers (model.num_local_experts) is not available");
  expect_refused({moe, "model.moe_drop_policy=position"}, "routing is dropless");
  expect_refused({"model.num_local_experts=4"}, "read by model.family=mixtral only");
  expect_refused({moe, "model.router_aux_loss_coef=nan"}, "router_aux_loss_coef");
  // A capacity factor is positive: dropless routing is the key left unset.
  for (const char* bad : {"model.capacity_factor=0", "model.capacity_factor=-1"}) {
    try {
      base({moe, bad});
      ADD_FAILURE() << bad << " accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("model.capacity_factor must be positive"), std::string::npos) << e.what();
    }
  }
}

TEST(Plan, RefusesSettingsThatWouldHaveNoEffect) {
  expect_refused({"parallel.strategy=zero2", "parallel.fsdp.forward_prefetch=true"},
                 "parallel.fsdp.forward_prefetch=true would have no effect: parallel.fsdp applies to "
                 "parallel.strategy=fsdp, not zero2");
  expect_refused({"parallel.strategy=zero1", "parallel.zero.prefetch_bucket_mb=8"}, "only zero3 has");
  expect_refused({"parallel.strategy=zero3", "parallel.zero.allgather_bucket_mb=8"}, "stages 1-2 read it");
  expect_refused({"parallel.strategy=fsdp", "parallel.bucket_cap_mb=4"}, "DDP reads it");
  expect_refused({"parallel.schedule=gpipe"}, "pipelines read it");
  expect_refused({"parallel.sequence_parallel=true"}, "parallel.tp > 1");
  expect_refused({"checkpoint.every=2"}, "checkpoint.dir is not set");
  expect_refused({"precision.hysteresis=4"}, "does not scale the loss");
  expect_refused(
      {"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=NO_SHARD", "parallel.fsdp.forward_prefetch=true"},
      "NO_SHARD runs DDP");
  // The same keys where they apply.
  EXPECT_EQ(refusal({"parallel.strategy=fsdp", "parallel.fsdp.forward_prefetch=true"}), "");
  EXPECT_EQ(refusal({"parallel.strategy=zero3", "parallel.zero.prefetch_bucket_mb=8"}), "");
  EXPECT_EQ(refusal({"parallel.bucket_cap_mb=4"}), "");
  EXPECT_EQ(refusal({"parallel.pp=2", "parallel.schedule=gpipe", "train.sample_tokens=0"}), "");
}

TEST(Plan, SaysWhenDeferredInitializationDoesNotApply) {
  EXPECT_TRUE(make_plan(base({"parallel.strategy=zero3"}), 2).deferred_init);
  EXPECT_FALSE(make_plan(base({"parallel.strategy=zero2"}), 2).deferred_init);
  const Plan pipe = make_plan(base({"parallel.strategy=zero3", "parallel.pp=2", "train.sample_tokens=0"}), 2);
  EXPECT_FALSE(pipe.deferred_init);
  ASSERT_EQ(pipe.notices.size(), 1u);
  EXPECT_NE(pipe.notices[0].find("pipeline stages are cut from a whole model"), std::string::npos);
  const Plan fsdp = make_plan(base({"parallel.strategy=fsdp", "parallel.fsdp.cpu_ram_efficient_loading=true"}), 2);
  EXPECT_TRUE(fsdp.deferred_init);
  EXPECT_TRUE(fsdp.notices.empty());
  const Plan bf16 =
      make_plan(base({"parallel.strategy=zero3", "precision.mode=bf16", "precision.param_dtype=bf16"}), 2);
  EXPECT_TRUE(bf16.deferred_init) << "16-bit parameters are initialized deferred too";
}

TEST(Plan, FullStateDictIsRefusedWithAsyncSaves) {
  const std::vector<std::string> full{"parallel.strategy=fsdp", "parallel.fsdp.state_dict_type=FULL_STATE_DICT"};
  EXPECT_TRUE(make_plan(base(full), 2).full_state_dict);
  auto with_async = full;
  with_async.insert(with_async.end(), {"checkpoint.dir=/tmp/x", "checkpoint.async=true"});
  expect_refused(with_async, "checkpoint.async with parallel.fsdp.state_dict_type=FULL_STATE_DICT");
}

TEST(Plan, ConfigValuesMustBeFiniteAndAllProblemsAreListed) {
  config::Config c;
  for (const char* bad : {"train.lr=nan", "train.lr=inf", "train.grad_clip=-inf", "parallel.timeout_s=NaN"})
    EXPECT_THROW(apply_override(c, bad), UsageError) << bad;
  c.train.steps = 0;
  c.train.lr = -1;
  c.metrics.log_every = 0;
  try {
    validate_config(c);
    FAIL() << "accepted";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("3 problems in the config"), std::string::npos) << msg;
    EXPECT_NE(msg.find("train.steps"), std::string::npos) << msg;
    EXPECT_NE(msg.find("train.lr"), std::string::npos) << msg;
    EXPECT_NE(msg.find("metrics.log_every"), std::string::npos) << msg;
  }
}

}  // namespace plan_test
}  // namespace scaletrain::train

namespace scaletrain::train {
namespace plan_test {

// Note [One device per rank], with the CUDA build and GPUs injected: the
// rules a GPU machine applies, checked on this CPU build.
std::string device_refusal(const std::vector<std::string>& overrides, int local_rank, DeviceEnvironment env) {
  try {
    make_plan(base(overrides), 2, local_rank, env);
    return "";
  } catch (const UsageError& e) {
    return e.what();
  }
}

at::Device device_of(const std::vector<std::string>& overrides, int local_rank, DeviceEnvironment env) {
  return make_plan(base(overrides), 2, local_rank, env).device;
}

TEST(DevicePlan, AutoTakesTheLocalRanksGpuElseTheCpu) {
  const DeviceEnvironment none{false, 0}, no_gpu{true, 0}, two{true, 2};
  EXPECT_TRUE(device_of({}, 0, none).is_cpu());
  EXPECT_TRUE(device_of({}, 1, no_gpu).is_cpu());
  EXPECT_EQ(device_of({}, 1, two), at::Device(at::kCUDA, 1));
  EXPECT_TRUE(make_plan(base(), 2, 1, two).cuda);
  EXPECT_TRUE(device_of({"train.device=cpu"}, 1, two).is_cpu());
  EXPECT_EQ(device_of({"train.device=cuda"}, 0, two), at::Device(at::kCUDA, 0));
  // cuda:N names the GPU, whatever the local rank (ranks sharing one GPU).
  EXPECT_EQ(device_of({"train.device=cuda:0"}, 1, two), at::Device(at::kCUDA, 0));
  // This build's own environment: no CUDA.
  EXPECT_TRUE(make_plan(base(), 2).device.is_cpu());
  EXPECT_FALSE(DeviceEnvironment::probe().built_with_cuda);
}

TEST(DevicePlan, WhatCannotRunIsRefusedInOneLine) {
  const DeviceEnvironment none{false, 0}, no_gpu{true, 0}, two{true, 2};
  auto refused = [](const std::string& msg, const std::string& needle) {
    EXPECT_NE(msg.find(needle), std::string::npos) << "got: '" << msg << "'";
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  refused(device_refusal({"train.device=cuda"}, 0, none), "train.device=cuda needs a CUDA build");
  refused(device_refusal({"train.device=cuda:1"}, 0, none), "train.device=cuda:1 needs a CUDA build");
  refused(device_refusal({"train.device=cuda"}, 0, no_gpu), "no GPU is visible");
  refused(device_refusal({}, 2, two), "LOCAL_RANK=2 but this process sees 2 GPUs");
  refused(device_refusal({"train.device=cuda:2"}, 0, two), "train.device=cuda:2 but this process sees 2 GPUs");
  refused(device_refusal({"train.device=gpu"}, 0, two), "train.device must be auto, cpu, cuda or cuda:N");
  refused(device_refusal({"train.device=cuda:x"}, 0, two), "expected cuda:N");
  refused(device_refusal({"parallel.backend=nccl"}, 0, none), "parallel.backend=nccl needs CUDA tensors");
  refused(device_refusal({"parallel.backend=nccl", "train.device=cpu"}, 0, two), "(train.device=cpu)");
  EXPECT_EQ(device_refusal({"parallel.backend=nccl"}, 0, two), "");
  // Offloaded state is always page-locked on a GPU run, never on a CPU one.
  refused(device_refusal({"parallel.strategy=zero2", "parallel.zero.offload_pin_memory=true"}, 0, none),
          "needs a CUDA device");
  refused(device_refusal({"parallel.strategy=zero2", "parallel.zero.offload_pin_memory=true",
                          "parallel.zero.offload_optimizer=cpu"},
                         0, two),
          "always page-locked on a GPU run");
}

TEST(DevicePlan, OffloadSettings) {
  const DeviceEnvironment none{false, 0};
  expect_refused({"parallel.strategy=zero2", "parallel.zero.offload_param=cpu"}, "needs parallel.strategy=zero3");
  expect_refused({"parallel.strategy=zero3", "parallel.zero.offload_param=nvme"}, "is not a writable directory");
  // Accepted, with what they mean here said once.
  const Plan p = make_plan(base({"parallel.strategy=zero3", "parallel.zero.offload_param=cpu"}), 2, 0, none);
  std::string notes;
  for (const auto& n : p.notices) notes += n + "\n";
  EXPECT_NE(notes.find("the optimizer steps them in host memory"), std::string::npos) << notes;
  EXPECT_NE(notes.find("host and device are the same memory"), std::string::npos) << notes;
  EXPECT_EQ(refusal({"parallel.strategy=fsdp", "parallel.fsdp.offload_params=true"}), "");
  EXPECT_EQ(refusal({"parallel.strategy=zero1", "parallel.zero.offload_optimizer=cpu"}), "");
}

}  // namespace plan_test
}  // namespace scaletrain::train

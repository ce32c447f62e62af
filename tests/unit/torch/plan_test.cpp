// The validated plan (train/plan.h): every problem at once, settings that
// would have no effect refused, and the dtypes and flags the run will use.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "scaletrain/train/config.h"
#include "scaletrain/train/plan.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

Config base(const std::vector<std::string>& overrides = {}) {
  Config c;
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
  Config c;
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

}  // namespace
}  // namespace scaletrain::train

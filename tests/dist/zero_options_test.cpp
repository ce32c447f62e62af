// ZeRO's knobs and ZeRO-1/2 overlap, each observed through the engine's
// stats and each run still checked against the single-process reference:
//   - stage 1/2 units are cut in backward order with a tapered tail, and
//     their reduces start while backward still produces gradients;
//   - the gather of updated ZeRO-1/2 parameters is deferred to the next
//     forward (per unit, the next one in flight) or a FullParams request;
//   - allgather_bucket_numel splits those gathers into more calls;
//   - stage 3's prefetch_bytes sets how far ahead units are gathered, and
//     max_live_numel bounds the elements gathered at once;
//   - the trainer's parallel.zero keys reach these options.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/engines.h"

namespace scaletrain::test {
namespace zero_options_test {

using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::ShardedOptions;

constexpr int64_t kBatch = 24;  // global; divisible by 2 or 3 ranks x 2 micro-batches
constexpr int kSteps = 4;
constexpr int kAccum = 2;
constexpr double kClip = 0.5;
// Six blocks of 8450 elements (width 26): enough for several units.
models::GPTConfig six_blocks() { return models::GPTConfig{61, 16, 6, 2, 26}; }
constexpr int64_t kBlock = 8450;

struct Precision {
  at::ScalarType dtype;
  double lr;
};
// See Note [Adam amplifies summation order] in ddp_test.cpp.
const Precision kFp64{at::kDouble, 1e-2}, kFp32{at::kFloat, 1e-4};

models::GPT make_model(const Precision& p) {
  torch::manual_seed(7);
  auto m = models::GPT(six_blocks());
  m->to(p.dtype);
  return m;
}

std::vector<Batch> make_data() { return make_batches(kSteps, kBatch, 16, 61, 99); }

// The reference's parameters after each step, by name.
std::vector<std::map<std::string, at::Tensor>> reference_trajectory(const Precision& p,
                                                                    const std::vector<Batch>& data) {
  auto model = make_model(p);
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  std::vector<std::map<std::string, at::Tensor>> out;
  for (auto& b : data) {
    model->loss(b.x, b.y).backward();
    optim::clip_grad_norm(params, kClip);
    opt.step(p.lr);
    opt.zero_grad();
    std::map<std::string, at::Tensor> now;
    for (auto& item : model->named_parameters()) now[item.key()] = item.value().detach().clone();
    out.push_back(std::move(now));
  }
  return out;
}

std::vector<at::Tensor> in_order(const models::GPT& model, const std::map<std::string, at::Tensor>& ref) {
  std::vector<at::Tensor> out;
  for (auto& item : model->named_parameters()) out.push_back(ref.at(item.key()));
  return out;
}

std::vector<at::Tensor> current(const models::GPT& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

// fp64 is compared per tensor, fp32 globally (reference.h).
double diff(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, const Precision& p) {
  return relative_diff(got, want, p.dtype == at::kDouble);
}

// Observations of one run, taken on every rank.
struct Observed {
  std::vector<ShardedDataParallel::Stats> backward;  // per synced backward
  std::vector<ShardedDataParallel::Stats> forward;   // per step's first forward
  std::vector<int> stale_after_step;
  std::vector<int64_t> gathers_in_after_step;
  std::vector<double> stale_diff;  // parameters read between steps against the reference
  std::vector<std::string> units;
  double final_diff = 0;
};

// Trains kSteps with kAccum micro-batches (no_sync before the last when
// `no_sync`), checking against the reference trajectory as it goes.
Observed train(const Precision& p, const ShardedOptions& options, bool no_sync) {
  auto data = make_data();
  auto ref = reference_trajectory(p, data);
  auto model = make_model(p);
  ShardedDataParallel engine(model.ptr(), *model, world(), *world().group(), nullptr, options);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  const int64_t local = kBatch / world().size(), micro = local / kAccum;
  // Only ZeRO-1/2 keep whole parameters to read between steps.
  const bool replicated = options.sharding == parallel::fsdp::Sharding::Zero1 ||
                          options.sharding == parallel::fsdp::Sharding::Zero2;
  Observed o;
  o.units = engine.unit_names();
  for (int s = 0; s < kSteps; ++s) {
    for (int k = 0; k < kAccum; ++k) {
      const int64_t start = world().rank() * local + k * micro;
      auto x = data[s].x.narrow(0, start, micro), y = data[s].y.narrow(0, start, micro);
      engine.reset_stats();
      auto loss = engine.forward([&] { return model->loss(x, y); }) / kAccum;
      if (k == 0) {
        o.forward.push_back(engine.stats());
        // Parameters read now are the last step's, gathered.
        if (s > 0 && replicated) EXPECT_LE(diff(current(model), in_order(model, ref[s - 1]), p), 1e-5) << "step " << s;
      }
      engine.reset_stats();
      if (k + 1 < kAccum && no_sync) {
        auto guard = engine.no_sync();
        loss.backward();
      } else {
        loss.backward();
        o.backward.push_back(engine.stats());
      }
    }
    engine.clip_grad_norm(kClip);
    opt.step(p.lr);
    engine.reset_stats();
    engine.after_step();
    engine.zero_grad();
    o.gathers_in_after_step.push_back(engine.stats().all_gathers);
    o.stale_after_step.push_back(engine.stale_units());
    if (replicated) o.stale_diff.push_back(diff(current(model), in_order(model, ref[s]), p));
  }
  // A full-parameters request after the last step gathers first.
  o.final_diff = diff(engine.full_parameters(), in_order(model, ref.back()), p);
  EXPECT_EQ(engine.stale_units(), 0);
  return o;
}

ShardedOptions zero_options(int stage, const std::function<void(parallel::zero::ZeroOptions&)>& set = {}) {
  parallel::zero::ZeroOptions z;
  z.stage = stage;
  if (set) set(z);
  return parallel::zero::sharded_options(z);
}

// Backward order is h.5 first, h.0 last: a first unit of one block (cap 8000),
// a tail of one block (cap 8000) then one block (16000, since two would
// exceed it), then 32000 >= the cap ends the taper; the middle fills to the
// cap of 20000 (a unit closes once it holds at least that).
void small_buckets(parallel::zero::ZeroOptions& z) {
  z.reduce_bucket_numel = 20000;
  z.first_bucket_numel = 8000;
  z.last_bucket_numel = 8000;
  z.tail_growth = 2;
}

TEST(ZeroOptions, Stage12ReduceInBucketsDuringBackward) {
  for (int stage : {1, 2})
    for (const Precision& p : {kFp64, kFp32}) {
      SCOPED_TRACE("zero" + std::to_string(stage) + " " + c10::toString(p.dtype));
      Observed o = train(p, zero_options(stage, small_buckets), /*no_sync=*/stage == 1);
      EXPECT_EQ(o.units, (std::vector<std::string>{"root", "h.0", "h.1", "h.2-h.4", "h.5"}));
      // Stage 1 reduces once per step, stage 2 every micro-batch.
      EXPECT_EQ(o.backward.size(), static_cast<size_t>(stage == 1 ? kSteps : kSteps * kAccum));
      for (auto& st : o.backward) {
        EXPECT_EQ(st.reduces, 5);
        // Every unit but the root (wte's gradient is the last of all) went
        // out while backward still had gradients to make.
        EXPECT_EQ(st.reduces_in_backward, 4);
      }
      EXPECT_LE(o.final_diff, 1e-5);
    }
}

TEST(ZeroOptions, DefaultBucketsOfAModelBelowTheCapStillOverlap) {
  // The default unit cap (25 MiB) holds this whole model, yet with taper caps
  // below one block every block gets its own unit, as in a small model
  // under the trainer's defaults.
  Observed o = train(kFp64, zero_options(2, [](auto& z) {
                       z.first_bucket_numel = 1;
                       z.last_bucket_numel = 1;
                     }),
                     false);
  EXPECT_EQ(o.units.size(), 7u);
  for (auto& st : o.backward) EXPECT_EQ(st.reduces_in_backward, 6);
  EXPECT_LE(o.final_diff, 1e-5);
}

TEST(ZeroOptions, Stage12GatherUpdatedParametersInTheNextForward) {
  for (int stage : {1, 2})
    for (const Precision& p : {kFp64, kFp32}) {
      SCOPED_TRACE("zero" + std::to_string(stage) + " " + c10::toString(p.dtype));
      Observed o = train(p, zero_options(stage, small_buckets), stage == 1);
      for (int s = 0; s < kSteps; ++s) {
        // Nothing moves in after_step(); every unit waits for its gather.
        EXPECT_EQ(o.gathers_in_after_step[s], 0);
        EXPECT_EQ(o.stale_after_step[s], 5);
        // Other ranks' parts are stale until then (this rank's part is its
        // shard, already stepped). fp32's lr 1e-4 moves weights by ~1e-4.
        if (world().size() > 1) EXPECT_GT(o.stale_diff[s], p.dtype == at::kDouble ? 1e-3 : 2e-5) << "step " << s;
      }
      // The first forward after a step gathered all 5 units, the next one in
      // flight while the current one was waited for.
      for (size_t s = 1; s < o.forward.size(); ++s) {
        EXPECT_GE(o.forward[s].all_gathers, 5);
        EXPECT_EQ(o.forward[s].max_gathers_in_flight, 2);
        EXPECT_EQ(o.forward[s].prefetched, 4);  // every block unit's gather was on the way before it ran
      }
      EXPECT_EQ(o.forward[0].all_gathers, 0);  // nothing stale before the first step
      EXPECT_LE(o.final_diff, 1e-5);
    }
}

TEST(ZeroOptions, AllgatherBucketSplitsTheGathers) {
  int64_t calls[2] = {0, 0};
  int i = 0;
  for (int64_t bucket : {int64_t{1} << 30, int64_t{2000}}) {
    Observed o = train(kFp64, zero_options(2, [&](auto& z) {
                         small_buckets(z);
                         z.allgather_bucket_numel = bucket;
                       }),
                       false);
    calls[i++] = o.forward[1].all_gathers;
    EXPECT_LE(o.final_diff, 1e-5) << "bucket " << bucket;
  }
  // Unbounded: one call per trainable flat buffer (one per unit here: one
  // dtype, everything trainable).
  EXPECT_EQ(calls[0], 5);
  // 2000 elements per call: the model's ~52k elements need at least 26 calls.
  EXPECT_GE(calls[1], (6 * kBlock + 2 * 26 + 61 * 26 + 16 * 26) / 2000);
}

TEST(ZeroOptions, Stage3PrefetchBytesSetHowFarAheadUnitsAreGathered) {
  const int64_t unit_bytes = kBlock * 8;  // fp64
  int in_flight[2] = {0, 0};
  int i = 0;
  for (int64_t budget : {int64_t{1}, 3 * unit_bytes}) {
    Observed o = train(kFp64, zero_options(3, [&](auto& z) { z.prefetch_bytes = budget; }), false);
    int most = 0;
    for (auto& st : o.forward) most = std::max(most, st.max_gathers_in_flight);
    in_flight[i++] = most;
    EXPECT_LE(o.final_diff, 1e-5) << "prefetch " << budget;
  }
  // At forward's start the root is in flight with one unit, or with three.
  EXPECT_EQ(in_flight[0], 2);
  EXPECT_EQ(in_flight[1], 4);
}

TEST(ZeroOptions, Stage3MaxLiveParametersBoundsTheGatheredElements) {
  const int64_t whole = 6 * kBlock + 61 * 26 + 16 * 26 + 2 * 26;
  const int64_t bound = whole / 2;  // the root and two or three blocks
  int64_t peak[2] = {0, 0};
  int i = 0;
  for (int64_t live : {int64_t{1000000000}, bound}) {
    Observed o = train(kFp64, zero_options(3, [&](auto& z) {
                         z.prefetch_bytes = int64_t{1} << 30;  // everything ahead, but for the bound
                         z.max_live_numel = live;
                       }),
                       false);
    for (auto& st : o.forward) peak[i] = std::max(peak[i], st.peak_gathered_numel);
    for (auto& st : o.backward) peak[i] = std::max(peak[i], st.peak_gathered_numel);
    ++i;
    EXPECT_LE(o.final_diff, 1e-5) << "max live " << live;
  }
  EXPECT_GE(peak[0], whole);  // unbounded: the whole model was gathered at once
  EXPECT_LE(peak[1], bound);
  EXPECT_GT(peak[1], 0);
}

// The trainer's keys reach the engine (train/plan/engine_plan.cpp, then sharded_setup).
TEST(ZeroOptions, ConfigKeysReachTheEngine) {
  static comm::Mesh mesh(world(), comm::MeshDims{});
  train::Plan plan;  // fp32, nothing deferred; the engine is the plan's, the keys the config's
  plan.data_parallel = config::DataParallelism::kZero2;
  config::Config c;
  c.parallel.zero.reduce_bucket_mb = 2;
  c.parallel.zero.allgather_bucket_mb = 0.5;
  c.parallel.first_bucket_mb = 0.25;
  c.parallel.last_bucket_mb = 0;
  plan.engines = train::plan_engines(c, plan);
  ShardedOptions o = train::sharded_setup(plan, mesh).options;
  EXPECT_EQ(o.wrap.policy, parallel::fsdp::WrapPolicy::Buckets);
  EXPECT_EQ(o.wrap.min_num_params, 2 << 18);  // 2 MiB of fp32
  EXPECT_EQ(o.allgather_bucket_numel, 1 << 17);
  EXPECT_EQ(o.wrap.first_bucket_numel, 1 << 16);
  EXPECT_EQ(o.wrap.last_bucket_numel, 0);
  plan.data_parallel = config::DataParallelism::kZero3;
  c.parallel.zero.prefetch_bucket_mb = 3;
  c.parallel.zero.max_live_parameters = 12345;
  plan.engines = train::plan_engines(c, plan);
  o = train::sharded_setup(plan, mesh).options;
  EXPECT_EQ(o.prefetch_bytes, 3 << 20);
  EXPECT_EQ(o.max_live_numel, 12345);
  EXPECT_FALSE(o.limit_all_gathers);  // the live bound replaces FSDP's two units
}

}  // namespace zero_options_test
}  // namespace scaletrain::test

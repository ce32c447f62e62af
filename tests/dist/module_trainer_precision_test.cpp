// The module trainer's precision (train/module_trainer.h) against one
// process doing the same arithmetic: bf16 autocast on the same slices, bf16
// storage with fp32 masters, and loss scaling whose overflowed steps are
// skipped on every rank, the scale backing off and growing as DeepSpeed's
// dynamic scaler does, its state resumed from a checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "module_trainer_case.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora_linear.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"

namespace scaletrain::test {
namespace module_trainer_precision_test {

using namespace trainer_case;

// precision.mode bf16: the trainer autocasts each micro-batch's forward and
// loss. One process computing the same slices under autocast gets the same
// bf16 roundings (same operators on the same values), and sums the slices'
// fp32 gradients in another order than the all-reduce: 1e-5 relative, the
// fp32 bound. The same run without autocast ends far from it.
TEST(ModuleTrainer, Bf16AutocastMatchesOneProcessOnTheSameSlices) {
  auto make32 = [] {
    torch::manual_seed(3);
    return Toy().ptr();
  };
  const train::ModuleData data = dataset32();
  const int64_t n = kGlobal / world().size();
  auto run = [&](at::ScalarType autocast) {
    ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
    o.micro_batch = n;  // one slice per rank and step
    o.autocast = autocast;
    ModuleTrainer t(make32(), world(), adam, mse, o);
    t.fit(data);
    return t.full_parameters();
  };
  const std::vector<at::Tensor> got = run(at::kBFloat16), plain = run(at::kFloat);

  auto m = make32();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(kLr));
  const ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
  data::SamplerOptions so;
  so.seed = o.seed;
  so.global_batch = o.global_batch;
  data::DistributedSampler sampler(kSamples, so);
  precision::PrecisionPolicy bf16;
  bf16.compute = at::kBFloat16;
  for (int64_t s = 0; s < o.steps; ++s) {
    const train::ModuleBatch b = data.get(sampler.global_batch(s));
    opt.zero_grad();
    for (int r = 0; r < world().size(); ++r) {
      at::Tensor loss;
      {
        precision::AutocastGuard autocast(bf16, at::kCPU);
        loss = mse(*m, b.input.narrow(0, r * n, n), b.target.narrow(0, r * n, n));
      }
      (loss / world().size()).backward();
    }
    torch::nn::utils::clip_grad_norm_(m->parameters(), o.clip_grad_norm);
    opt.param_groups()[0].options().set_lr(optim::lr_at(s, o.peak_lr, *o.lr_schedule));
    opt.step();
  }
  const double diff = relative_diff(got, m->parameters(), /*per_tensor=*/true);
  EXPECT_LE(diff, 1e-5) << "autocast bf16 against one process on the same slices";
  EXPECT_GT(relative_diff(plain, m->parameters(), /*per_tensor=*/true), 100 * std::max(diff, 1e-7))
      << "without autocast the run should end elsewhere";
  ModuleTrainerOptions half = options(ModuleStrategy::DDP, 4);
  half.autocast = at::kHalf;
  expect_error([&] { train::validate(half); }, "kHalf needs loss_scaling", "fp16 autocast without loss scaling");
  half.loss_scaling = precision::LossScalerOptions{};
  train::validate(half);  // fp16 autocast with loss scaling: a CUDA module's
  expect_error([&] { ModuleTrainer t(make_toy(), world(), adam, mse, half); }, "needs the module on a CUDA device",
               "fp16 autocast on the CPU");
}

// bf16 storage with fp32 masters (param_dtype) under the sharded strategies:
// every rank's bf16 gradients summed in fp32 and averaged, clipped and stepped
// on fp32 masters, the module's bf16 parameters their rounding; one process
// computing the same slices the same way is the reference.
TEST(ModuleTrainer, Bf16StorageStepsFp32MastersAsOneProcessWould) {
  auto make32 = [] {
    torch::manual_seed(3);
    return Toy().ptr();
  };
  auto loss32 = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<ToyImpl&>(m).forward(x).to(at::kFloat), y);
  };
  const train::ModuleData data = dataset32();
  const int64_t n = kGlobal / world().size();
  // The run's master shards against the reference's masters by name:
  // |shard - reference| / |reference| over this rank's pieces.
  auto run = [&](ModuleStrategy s, at::ScalarType master, const std::map<std::string, at::Tensor>& want) {
    ModuleTrainerOptions o = options(s, 4);
    o.micro_batch = n;  // one slice per rank and step
    o.param_dtype = at::kBFloat16;
    o.sharded.master_dtype = master;
    auto module = make32();
    ModuleTrainer t(module, world(), adam, loss32, o);
    EXPECT_EQ(t.optimizer().param_groups()[0].params()[0].scalar_type(),
              master == at::ScalarType::Undefined ? at::kFloat : master);
    t.fit(data);
    for (const auto& p : module->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
    double num = 0, den = 0;
    for (const auto& v : t.sharded()->shard_views())
      for (const auto& piece : v.pieces) {
        const at::Tensor ref = want.at(piece.name).flatten().narrow(0, piece.param_offset, piece.numel);
        const at::Tensor got = v.shard.narrow(0, piece.shard_offset, piece.numel).to(at::kFloat);
        num += (got - ref).pow(2).sum().item<double>();
        den += ref.pow(2).sum().item<double>();
      }
    return std::sqrt(num / den);
  };
  auto bf = make32();
  bf->to(at::kBFloat16);
  std::vector<at::Tensor> masters;
  for (const auto& p : bf->parameters()) masters.push_back(p.detach().to(at::kFloat).requires_grad_());
  torch::optim::Adam opt(masters, torch::optim::AdamOptions(kLr));
  const ModuleTrainerOptions o = options(ModuleStrategy::FullShard, 4);
  data::SamplerOptions so;
  so.seed = o.seed;
  so.global_batch = o.global_batch;
  data::DistributedSampler sampler(kSamples, so);
  for (int64_t step = 0; step < o.steps; ++step) {
    const train::ModuleBatch b = data.get(sampler.global_batch(step));
    std::vector<at::Tensor> sum;
    for (const auto& p : masters) sum.push_back(at::zeros_like(p));
    for (int r = 0; r < world().size(); ++r) {
      bf->zero_grad();
      loss32(*bf, b.input.narrow(0, r * n, n).to(at::kBFloat16), b.target.narrow(0, r * n, n)).backward();
      auto params = bf->parameters();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += params[i].grad().to(at::kFloat);
    }
    // Reduced in the gradients' dtype (no reduce_dtype): the fp32 sum's mean, rounded to bf16.
    for (size_t i = 0; i < sum.size(); ++i)
      masters[i].mutable_grad() = (sum[i] / world().size()).to(at::kBFloat16).to(at::kFloat);
    torch::nn::utils::clip_grad_norm_(masters, o.clip_grad_norm);
    opt.param_groups()[0].options().set_lr(optim::lr_at(step, o.peak_lr, *o.lr_schedule));
    opt.step();
    torch::NoGradGuard no_grad;
    auto params = bf->parameters();
    for (size_t i = 0; i < masters.size(); ++i) params[i].copy_(masters[i]);
  }
  std::map<std::string, at::Tensor> want;
  {
    auto named = bf->named_parameters();
    for (size_t i = 0; i < masters.size(); ++i) want[named[i].key()] = masters[i].detach();
  }
  for (ModuleStrategy s : {ModuleStrategy::Zero2, ModuleStrategy::FullShard}) {
    const double diff = run(s, at::ScalarType::Undefined, want);
    EXPECT_LE(diff, 1e-6) << train::to_string(s) << ": bf16 storage, fp32 masters, against one process";
    if (s != ModuleStrategy::FullShard) continue;
    const double bf16_masters = run(s, at::kBFloat16, want);
    EXPECT_GT(bf16_masters, 100 * std::max(diff, 1e-8)) << "with bf16 masters the run should end elsewhere";
  }
  ModuleTrainerOptions ddp = options(ModuleStrategy::DDP, 4);
  ddp.param_dtype = at::kBFloat16;
  expect_error([&] { train::validate(ddp); }, "needs fp32 master weights", "bf16 storage under DDP");
  ddp.param_dtype = at::kHalf;
  expect_error([&] { train::validate(ddp); }, "fp16 storage is not run", "fp16 storage");
}

// Loss scaling (options.loss_scaling) in float64, where multiplying by a
// power of two and dividing again is exact: the run equals one process that
// leaves out the optimizer steps of the overflowed steps. The overflow is
// made on one rank only, in the gradient of one element (at steps 2 and 4):
// under a sharded strategy one rank's shard holds it, so the skip must be agreed. With hysteresis 2 and a growth
// interval of 2 the scales the steps used are 1024, 1024, 1024, 1024, 512, 512 and the scale after step 6 is 1024 again
// (grown); a run saved after step 4 and resumed under another strategy takes the scaler's state from the checkpoint.
TEST(ModuleTrainer, LossScalingSkipsOverflowedStepsOnEveryRank) {
  const std::set<int64_t> overflow = {1, 3};  // 0-based steps
  auto loss_at = [&](std::shared_ptr<int64_t> calls, int64_t per_step, bool here) {
    return [=](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
      const int64_t step = (*calls)++ / per_step;
      const at::Tensor l = mse(m, x, y);
      if (!here || !overflow.count(step)) return l;
      // inf in the gradient of one element only: after a sharded reduction one rank holds it.
      const at::Tensor last = dynamic_cast<ToyImpl&>(m).net2->bias.flatten()[-1];
      return l + last * std::numeric_limits<double>::infinity();
    };
  };
  const bool odd = world().rank() == world().size() - 1;
  // SGD without clipping, so that a gradient left scaled (or unscaled twice) moves the parameters elsewhere.
  auto sgd = [](std::vector<at::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(kLr).momentum(0.9));
  };
  auto scaled_options = [&](ModuleStrategy s) {
    ModuleTrainerOptions o = options(s, 6);
    o.clip_grad_norm = 1e6;  // measured, never clipping
    o.loss_scaling = precision::LossScalerOptions{};
    o.loss_scaling->initial_scale = 1024;
    o.loss_scaling->hysteresis = 2;
    o.loss_scaling->growth_interval = 2;
    return o;
  };
  const AloneRun ref = run_alone(make_toy(), mse, scaled_options(ModuleStrategy::DDP), sgd, overflow);
  ASSERT_EQ(ref.norms.size(), 4u);
  const std::vector<double> scales = {1024, 1024, 1024, 1024, 512, 512};
  auto check_metrics = [&](const std::string& path, size_t first, const std::string& name) {
    if (world().rank() != 0) return;
    std::ifstream in(path);
    size_t i = first;
    for (std::string line; std::getline(in, line); ++i) {
      const nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j.at("loss_scale").get<double>(), scales.at(i)) << name << " step " << i + 1;
      const int64_t skipped = (i >= 1) + (i >= 3);
      EXPECT_EQ(j.at("skipped_steps").get<int64_t>(), skipped) << name << " step " << i + 1;
    }
    EXPECT_EQ(i, scales.size()) << name;
  };
  for (ModuleStrategy s : {ModuleStrategy::DDP, ModuleStrategy::Zero2, ModuleStrategy::FullShard}) {
    const std::string name = train::to_string(s);
    ModuleTrainerOptions o = scaled_options(s);
    o.metrics_path = (fresh_dir("scaling") / "metrics.jsonl").string();
    ModuleTrainer t(make_toy(), world(), sgd, loss_at(std::make_shared<int64_t>(0), 2, odd), o);
    const train::ModuleTrainResult r = t.fit(dataset());
    for (size_t i = 0; i < r.losses.size(); ++i)
      if (!overflow.count(static_cast<int64_t>(i)))
        EXPECT_NEAR(r.losses[i], ref.losses[i], 1e-10 * std::abs(ref.losses[i])) << name << " step " << i + 1;
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
    EXPECT_EQ(t.optimizer_steps(), 4) << name;
    EXPECT_EQ(t.loss_scaler()->skipped_steps(), 2) << name;
    EXPECT_EQ(t.loss_scaler()->scale(), 1024) << name << ": grown after two good steps";
    check_metrics(o.metrics_path, 0, name);
  }
  // Saved after step 4 (scale 512, one overflow credit left), resumed by another strategy.
  const fs::path dir = fresh_dir("scaling_resume");
  ModuleTrainerOptions first = scaled_options(ModuleStrategy::FullShard);
  first.stop_at = 4;
  first.checkpoint_dir = dir.string();
  ModuleTrainer(make_toy(), world(), sgd, loss_at(std::make_shared<int64_t>(0), 2, odd), first).fit(dataset());
  ModuleTrainerOptions second = scaled_options(ModuleStrategy::DDP);
  second.checkpoint_dir = dir.string();
  second.micro_batch = kGlobal / world().size();  // one micro-batch per step now
  second.metrics_path = (dir / "metrics.jsonl").string();
  ModuleTrainer t(make_toy(), world(), sgd, loss_at(std::make_shared<int64_t>(4), 1, odd), second);
  ASSERT_EQ(t.completed_steps(), 4);
  EXPECT_EQ(t.optimizer_steps(), 2);
  const precision::LossScalerState st = t.loss_scaler()->state();
  EXPECT_EQ(st.scale, 512);
  EXPECT_EQ(st.hysteresis_left, 1);
  EXPECT_EQ(st.skipped, 2);
  t.fit(dataset());
  EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << "resumed";
  check_metrics(second.metrics_path, 4, "resumed");
  EXPECT_EQ(t.loss_scaler()->scale(), 1024);
}

// Two LoraLinear layers: what FP8 reaches in a user's module.
struct Fp8NetImpl : torch::nn::Module {
  Fp8NetImpl()
      : fc1(register_module("fc1", models::LoraLinear(10, 16))),
        fc2(register_module("fc2", models::LoraLinear(16, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  models::LoraLinear fc1, fc2;
};
TORCH_MODULE(Fp8Net);

// FP8 (options.fp8, delayed scaling, hybrid formats) on a module's
// LoraLinear layers, float32: one process running every rank's micro-batches
// in turn with the loss multiplier of the whole step (1 / (ranks x
// micro-batches): gradient casts are relative to it) and ending each step
// with the amaxes of all of them is the reference. The scales every layer
// casts with equal the reference's exactly, the parameters to the fp32
// bound; the same run without FP8 ends far away; a run saved after step 2
// resumes with the histories and ends where the uninterrupted one does.
TEST(ModuleTrainer, Fp8OnLoraLinearLayersFollowsOneProcess) {
  auto make = [] {
    torch::manual_seed(9);
    return Fp8Net().ptr();
  };
  auto loss = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<Fp8NetImpl&>(m).forward(x), y);
  };
  const train::ModuleData data = dataset32();
  const precision::Fp8LinearOptions f8{precision::Fp8Mix::Hybrid, true, 16, 0};
  auto fp8_options = [&](ModuleStrategy s) {
    ModuleTrainerOptions o = options(s, 6);
    o.units.names = {"fc1", "fc2"};
    if (s == ModuleStrategy::DDP) o.units = {};
    o.fp8 = f8;
    return o;
  };
  // The reference: the sampler's global batch, rank r's micro-batch k being slice (r, k).
  auto ref_module = make();
  const std::vector<precision::Fp8LinearPtr> ref_layers = models::use_fp8(*ref_module, f8);
  ASSERT_EQ(ref_layers.size(), 2u);
  const int64_t accum = 2;
  const std::vector<std::vector<double>> ref_scales =
      fp8_alone(ref_module, ref_layers, loss, data, fp8_options(ModuleStrategy::DDP));
  EXPECT_NE(ref_scales.front(), ref_scales.back()) << "the histories must move for the scales to mean anything";
  for (ModuleStrategy s : {ModuleStrategy::DDP, ModuleStrategy::FullShard}) {
    const std::string name = train::to_string(s);
    ModuleTrainer t(make(), world(), adam, loss, fp8_options(s));
    ASSERT_EQ(t.accumulation(), accum);
    t.fit(data);
    EXPECT_EQ(fp8_scales(t.fp8_layers()), ref_scales.back()) << name << ": the scales every rank casts with";
    const double diff = relative_diff(t.full_parameters(), ref_module->parameters(), /*per_tensor=*/true);
    EXPECT_LE(diff, 1e-5) << name;
    if (s != ModuleStrategy::DDP) continue;
    ModuleTrainerOptions plain = fp8_options(s);
    plain.fp8.reset();
    ModuleTrainer p(make(), world(), adam, loss, plain);
    p.fit(data);
    EXPECT_GT(relative_diff(p.full_parameters(), ref_module->parameters(), /*per_tensor=*/true),
              100 * std::max(diff, 1e-7))
        << "without FP8 the run should end elsewhere";
  }
  // Saved after step 2 by FULL_SHARD, resumed by DDP: the histories come back.
  const fs::path dir = fresh_dir("fp8_resume");
  ModuleTrainerOptions first = fp8_options(ModuleStrategy::FullShard);
  first.stop_at = 2;
  first.checkpoint_dir = dir.string();
  ModuleTrainer(make(), world(), adam, loss, first).fit(data);
  ModuleTrainerOptions second = fp8_options(ModuleStrategy::DDP);
  second.checkpoint_dir = dir.string();
  ModuleTrainer t(make(), world(), adam, loss, second);
  ASSERT_EQ(t.completed_steps(), 2);
  EXPECT_EQ(fp8_scales(t.fp8_layers()), ref_scales[1]) << "resumed histories";
  t.fit(data);
  EXPECT_EQ(fp8_scales(t.fp8_layers()), ref_scales.back()) << "resumed";
  EXPECT_LE(relative_diff(t.full_parameters(), ref_module->parameters(), /*per_tensor=*/true), 1e-5) << "resumed";
  // Refused by name: a module with no LoraLinear, and FP8 under tensor parallelism.
  ModuleTrainerOptions toy = options(ModuleStrategy::DDP, 4);
  toy.fp8 = f8;
  expect_error([&] { ModuleTrainer x(make_toy(), world(), adam, mse, toy); }, "no LoraLinear layer", "fp8 on Toy");
  toy.tp = 2;
  toy.tensor_plan = {{"net1", parallel::tensor::colwise}};
  expect_error([&] { train::validate(toy); }, "ModuleTrainerOptions.fp8 is not run with tp > 1", "fp8 with tp");
}

}  // namespace module_trainer_precision_test
}  // namespace scaletrain::test

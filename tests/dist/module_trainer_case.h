#pragma once
// What the module trainer's tests share (module_trainer_test.cpp,
// module_trainer_precision_test.cpp): the toy module, its data and loss,
// options with accumulation, a schedule and clipping, and one process
// training plainly on the whole batch as the reference.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/train/module_trainer.h"
#include "user_modules.h"

namespace scaletrain::test::trainer_case {

namespace fs = std::filesystem;
using train::ModuleStrategy;
using train::ModuleTrainer;
using train::ModuleTrainerOptions;

inline constexpr int64_t kSamples = 40;  // the global batch of 24 straddles epochs
inline constexpr int64_t kGlobal = 24;   // divisible by 2 micro-batches x 1..4 ranks
inline constexpr double kLr = 1e-2;

inline std::shared_ptr<torch::nn::Module> make_toy() {
  torch::manual_seed(3);
  auto m = Toy();
  m->to(at::kDouble);
  return m.ptr();
}

inline train::ModuleData dataset() {
  auto g = at::detail::createCPUGenerator(77);
  return train::ModuleData(at::randn({kSamples, 10}, g, at::kDouble), at::randn({kSamples, 5}, g, at::kDouble));
}

// The same samples in float32.
inline train::ModuleData dataset32() {
  std::vector<int64_t> all(kSamples);
  for (int64_t i = 0; i < kSamples; ++i) all[static_cast<size_t>(i)] = i;
  const train::ModuleBatch whole = dataset().get(all);
  return train::ModuleData(whole.input.to(at::kFloat), whole.target.to(at::kFloat));
}

inline at::Tensor mse(torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(dynamic_cast<ToyImpl&>(m).forward(x), y);
}

inline std::unique_ptr<torch::optim::Optimizer> adam(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(kLr));
}

// Two micro-batches per rank and step, a warmup-then-cosine schedule, clipping below the norm.
inline ModuleTrainerOptions options(ModuleStrategy s, int64_t steps) {
  ModuleTrainerOptions o;
  o.strategy = s;
  if (s != ModuleStrategy::DDP) o.units.names = {"net1", "net2"};
  if (s == ModuleStrategy::HybridShard) o.dp_replicate = 2;
  o.steps = steps;
  o.global_batch = kGlobal;
  o.micro_batch = kGlobal / (2 * world().size());
  o.seed = 11;
  o.clip_grad_norm = 0.3;
  optim::ScheduleOptions sched;
  sched.warmup_steps = 2;
  sched.total_steps = steps;
  o.lr_schedule = sched;
  o.peak_lr = kLr;
  o.progress = false;
  return o;
}

struct AloneRun {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
  std::vector<double> norms;
};

// One process: the sampler's global batch of each step, the whole batch's
// mean loss, torch's clipping, the schedule written into Adam's lr.
// `skip`: steps whose optimizer step is left out (the schedule still counts them).
inline AloneRun run_alone(const std::shared_ptr<torch::nn::Module>& m, const train::ModuleLoss& loss,
                          const ModuleTrainerOptions& o, const train::OptimizerFactory& factory = adam,
                          const std::set<int64_t>& skip = {}) {
  std::unique_ptr<torch::optim::Optimizer> made = factory(m->parameters());
  torch::optim::Optimizer& opt = *made;
  data::SamplerOptions so;
  so.seed = o.seed;
  so.global_batch = o.global_batch;
  data::DistributedSampler sampler(kSamples, so);
  const train::ModuleData data = dataset();
  AloneRun ref;
  for (int64_t s = 0; s < o.steps; ++s) {
    const train::ModuleBatch b = data.get(sampler.global_batch(s));
    opt.zero_grad();
    at::Tensor l = loss(*m, b.input, b.target);
    ref.losses.push_back(l.item<double>());
    if (skip.count(s)) continue;
    l.backward();
    ref.norms.push_back(torch::nn::utils::clip_grad_norm_(m->parameters(), o.clip_grad_norm));
    opt.param_groups()[0].options().set_lr(optim::lr_at(s, o.peak_lr, *o.lr_schedule));
    opt.step();
  }
  ref.params = m->parameters();
  return ref;
}

inline AloneRun train_alone(const ModuleTrainerOptions& o, const train::OptimizerFactory& factory = adam) {
  return run_alone(make_toy(), mse, o, factory);
}

inline void expect_losses(const std::vector<double>& got, const std::vector<double>& want, size_t first,
                          const std::string& what) {
  ASSERT_EQ(got.size() + first, want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[first + i], 1e-10 * std::abs(want[first + i])) << what << " step " << first + i + 1;
}

inline std::vector<ModuleStrategy> strategies() {
  std::vector<ModuleStrategy> all = {ModuleStrategy::DDP,   ModuleStrategy::Zero1,     ModuleStrategy::Zero2,
                                     ModuleStrategy::Zero3, ModuleStrategy::FullShard, ModuleStrategy::ShardGradOp};
  if (world().size() == 4) all.push_back(ModuleStrategy::HybridShard);
  return all;
}

// The run's directory, the same on every rank, emptied by rank 0.
inline fs::path fresh_dir(const std::string& name) {
  const char* port = std::getenv("MASTER_PORT");
  const fs::path d =
      fs::temp_directory_path() /
      ("scaletrain_module_trainer_" + std::string(port ? port : "0") + "_w" + std::to_string(world().size())) / name;
  if (world().rank() == 0) fs::remove_all(d);
  world().group()->barrier().wait();
  return d;
}

template <class E = std::invalid_argument>
inline void expect_error(const std::function<void()>& f, const std::string& part, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << what << ": " << e.what();
  }
}

// FP8 runs (float32): the three scales (input, weight, gradient) of each
// layer that `keep` marks (empty: every layer), in order.
inline std::vector<double> fp8_scales(const std::vector<precision::Fp8LinearPtr>& layers,
                                      const std::vector<bool>& keep = {}) {
  std::vector<double> out;
  for (size_t i = 0; i < layers.size(); ++i)
    if (keep.empty() || keep[i])
      for (auto which : {precision::Fp8Linear::Input, precision::Fp8Linear::Weight, precision::Fp8Linear::Grad})
        out.push_back(layers[i]->scale(which));
  return out;
}

// One process with FP8 `layers` in `m`: each step's global batch in its
// global_batch / micro_batch slices in turn (every rank's micro-batches), the
// loss multiplier of the whole step, the amaxes ended once, torch's clipping,
// Adam with the schedule. Returns every layer's scales after each step.
inline std::vector<std::vector<double>> fp8_alone(const std::shared_ptr<torch::nn::Module>& m,
                                                  const std::vector<precision::Fp8LinearPtr>& layers,
                                                  const train::ModuleLoss& loss, const train::ModuleData& data,
                                                  const ModuleTrainerOptions& o) {
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(kLr));
  data::SamplerOptions so;
  so.seed = o.seed;
  so.global_batch = o.global_batch;
  data::DistributedSampler sampler(data.size(), so);
  const int64_t slices = o.global_batch / o.micro_batch, n = o.micro_batch;
  std::vector<std::vector<double>> scales;
  for (int64_t step = 0; step < o.steps; ++step) {
    const train::ModuleBatch b = data.get(sampler.global_batch(step));
    opt.zero_grad();
    for (const auto& l : layers) l->set_loss_multiplier(1.0 / static_cast<double>(slices));
    for (int64_t k = 0; k < slices; ++k)
      (loss(*m, b.input.narrow(0, k * n, n), b.target.narrow(0, k * n, n)) / static_cast<double>(slices)).backward();
    precision::fp8_end_step(layers, {});
    torch::nn::utils::clip_grad_norm_(m->parameters(), o.clip_grad_norm);
    opt.param_groups()[0].options().set_lr(optim::lr_at(step, o.peak_lr, *o.lr_schedule));
    opt.step();
    scales.push_back(fp8_scales(layers));
  }
  return scales;
}

}  // namespace scaletrain::test::trainer_case

// The training loop for user modules (train/module_trainer.h) against one
// process training plainly on the whole batch (float64, 1e-10): DDP and every
// sharded strategy with gradient accumulation, a learning-rate schedule and
// clipping; a run saved under one strategy and resumed under another, which
// continues the uninterrupted run's losses; bad options and optimizers that
// checkpoints cannot save, refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "dist_env.h"
#include "module_trainer_case.h"
#include "reference.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/lora_linear.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/util/error.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace module_trainer_test {

using namespace trainer_case;

TEST(ModuleTrainer, MatchesOneProcessUnderEveryStrategy) {
  const AloneRun ref = train_alone(options(ModuleStrategy::DDP, 5));
  EXPECT_GT(ref.norms.front(), 0.3) << "clipping must act for the test to mean anything";
  for (ModuleStrategy s : strategies()) {
    const std::string name = train::to_string(s);
    ModuleTrainerOptions o = options(s, 5);
    o.metrics_path = (fresh_dir("metrics") / "metrics.jsonl").string();
    ModuleTrainer trainer(make_toy(), world(), adam, mse, o);
    EXPECT_EQ(trainer.accumulation(), 2) << name;
    const train::ModuleTrainResult r = trainer.fit(dataset());
    EXPECT_EQ(r.start_step, 0) << name;
    expect_losses(r.losses, ref.losses, 0, name);
    EXPECT_LE(relative_diff(trainer.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
    if (world().rank() == 0) {  // one JSON line per step, with the step's global mean loss
      std::ifstream in(o.metrics_path);
      size_t lines = 0;
      for (std::string line; std::getline(in, line); ++lines) {
        const nlohmann::json j = nlohmann::json::parse(line);
        EXPECT_NEAR(j.at("loss").get<double>(), r.losses.at(lines), 1e-14) << name;
        // The CLI's metrics (observe::MetricsSink), in samples: this module counts no tokens.
        EXPECT_EQ(j.at("step").get<int64_t>(), static_cast<int64_t>(lines) + 1) << name;
        EXPECT_GT(j.at("grad_norm").get<double>(), 0.3) << name;
        for (const char* key : {"samples_per_s", "step_ms", "peak_rss_mb"})
          EXPECT_GT(j.at(key).get<double>(), 0) << name << " " << key;
        EXPECT_TRUE(j.contains("comm_wait_ms") && !j.contains("tokens_per_s") && !j.contains("mfu")) << name << line;
      }
      EXPECT_EQ(lines, r.losses.size()) << name;
    }
  }
}

// Saved at step 3 of 6 by one strategy, resumed by another with another
// micro-batch size: the rest of the run is the uninterrupted run's.
TEST(ModuleTrainer, ResumesUnderAnotherStrategy) {
  const AloneRun ref = train_alone(options(ModuleStrategy::DDP, 6));
  const std::vector<std::pair<ModuleStrategy, ModuleStrategy>> pairs = {
      {ModuleStrategy::DDP, ModuleStrategy::FullShard},
      {ModuleStrategy::FullShard, ModuleStrategy::DDP},
      {ModuleStrategy::Zero2, ModuleStrategy::Zero3}};
  for (const auto& [save_as, resume_as] : pairs) {
    const std::string name = train::to_string(save_as) + " -> " + train::to_string(resume_as);
    const fs::path dir = fresh_dir("resume");
    ModuleTrainerOptions first = options(save_as, 6);
    first.stop_at = 3;
    first.checkpoint_dir = dir.string();
    double drawn_after_save = 0;
    {
      ModuleTrainer trainer(make_toy(), world(), adam, mse, first);
      torch::rand({7});  // what a loop draws (dropout, augmentation) moves the generator past the model's init
      expect_losses(trainer.fit(dataset()).losses, std::vector<double>(ref.losses.begin(), ref.losses.begin() + 3), 0,
                    name + " (first part)");
      drawn_after_save = torch::rand({1}, at::kDouble).item<double>();
    }
    ModuleTrainerOptions second = options(resume_as, 6);
    second.checkpoint_dir = dir.string();
    second.micro_batch = kGlobal / world().size();  // no accumulation now
    ModuleTrainer trainer(make_toy(), world(), adam, mse, second);
    EXPECT_EQ(trainer.completed_steps(), 3) << name;
    EXPECT_EQ(torch::rand({1}, at::kDouble).item<double>(), drawn_after_save) << name << ": the RNG is restored";
    const train::ModuleTrainResult r = trainer.fit(dataset());
    EXPECT_EQ(r.start_step, 3) << name;
    expect_losses(r.losses, ref.losses, 3, name);
    EXPECT_LE(relative_diff(trainer.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
  }
}

// Linear, BatchNorm1d, ReLU, Linear: running statistics that training moves.
struct NormedImpl : torch::nn::Module {
  NormedImpl()
      : fc1(register_module("fc1", torch::nn::Linear(10, 10))),
        bn(register_module("bn", torch::nn::BatchNorm1d(10))),
        fc2(register_module("fc2", torch::nn::Linear(10, 5))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Normed);

// Buffers are part of the state: BatchNorm's running statistics (each rank
// keeps its own, as in PyTorch) come back from a checkpoint as rank 0 saved
// them, on every rank and under another strategy.
TEST(ModuleTrainer, ResumeRestoresBuffers) {
  auto make = [] {
    torch::manual_seed(5);
    Normed m;
    m->to(at::kDouble);
    return m;
  };
  auto loss = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<NormedImpl&>(m).forward(x), y);
  };
  const fs::path dir = fresh_dir("buffers");
  ModuleTrainerOptions first = options(ModuleStrategy::DDP, 6);
  first.stop_at = 3;
  first.checkpoint_dir = dir.string();
  Normed saved = make();
  ModuleTrainer(saved.ptr(), world(), adam, loss, first).fit(dataset());
  std::vector<at::Tensor> rank0;
  for (const auto& b : saved->buffers()) {
    rank0.push_back(b.clone());
    world().group()->broadcast(rank0.back(), 0).wait();
  }
  ASSERT_EQ(rank0.size(), 3u);  // running mean, running variance, batches seen
  EXPECT_EQ(rank0[2].item<int64_t>(), 3 * 2) << "two micro-batches per step";
  EXPECT_GT(rank0[0].abs().sum().item<double>(), 0) << "the running mean must have moved";
  ModuleTrainerOptions second = options(ModuleStrategy::FullShard, 6);
  second.units.names = {"fc1", "fc2"};
  second.checkpoint_dir = dir.string();
  Normed resumed = make();
  ModuleTrainer trainer(resumed.ptr(), world(), adam, loss, second);
  ASSERT_EQ(trainer.completed_steps(), 3);
  const std::vector<at::Tensor> loaded = resumed->buffers();
  ASSERT_EQ(loaded.size(), rank0.size());
  for (size_t i = 0; i < loaded.size(); ++i)
    EXPECT_TRUE(loaded[i].equal(rank0[i])) << "buffer " << i << " on rank " << world().rank();
}


TEST(ModuleTrainer, BadOptionsNameTheField) {
  using Edit = std::function<void(ModuleTrainerOptions&)>;
  const std::vector<std::pair<std::string, Edit>> cases = {
      {"micro_batch", [](auto& o) { o.micro_batch = 0; }},
      {"global_batch", [](auto& o) { o.micro_batch = 5; }},
      {"steps", [](auto& o) { o.steps = 0; }},
      {"stop_at", [](auto& o) { o.stop_at = 9; }},
      {"units", [](auto& o) { o.units.names = {"net1"}; }},
      {"replicate_group", [](auto& o) { o.strategy = ModuleStrategy::HybridShard; }},
      {"dp_replicate", [](auto& o) { o.dp_replicate = 2; }},
      {"clip_grad_norm", [](auto& o) { o.clip_grad_norm = -1; }},
      {"peak_lr", [](auto& o) { o.lr_schedule.reset(); }},
      {"checkpoint_every", [](auto& o) { o.checkpoint_every = 2; }},
      {"trace_steps",
       [](auto& o) {
         o.trace_steps = {3, 2};
       }},
      {"log_every", [](auto& o) { o.log_every = 0; }}};
  for (const auto& [field, edit] : cases) {
    ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
    edit(o);
    expect_error([&] { train::validate(o); }, "ModuleTrainerOptions." + field, field);
    expect_error([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "ModuleTrainerOptions." + field, field);
  }
  // What needs the world: the global batch over micro-batches of every rank.
  ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
  o.micro_batch = kGlobal;  // 24 x 2+ ranks
  expect_error([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "data-parallel size", "global batch");
  // An optimizer over the module's parameters under a sharded strategy.
  o = options(ModuleStrategy::FullShard, 4);
  auto m = make_toy();
  auto over_params = [m](std::vector<at::Tensor>) { return adam(m->parameters()); };
  expect_error([&] { ModuleTrainer t(m, world(), over_params, mse, o); }, "exactly the", "optimizer over parameters");
  // Both an optimizer factory and options.adamw.
  o = options(ModuleStrategy::DDP, 4);
  o.adamw = train::AdamWSettings{};
  expect_error([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "both given", "factory and adamw");
}

// Note [Same on every rank] for a user's module: a rank with another option
// or another module is named before any collective, and every rank throws
// (the ranks equal to rank 0 as well, so none goes on into a collective alone).
TEST(ModuleTrainer, ARankWithOtherOptionsOrModuleIsNamedAtStart) {
  const bool odd = world().rank() == world().size() - 1;
  ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
  if (odd) o.steps = 5;
  expect_error<UsageError>([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "steps=5", "steps");
  auto other = make_toy();
  if (odd) other->to(at::kFloat);
  expect_error<UsageError>([&] { ModuleTrainer t(other, world(), adam, mse, options(ModuleStrategy::DDP, 4)); },
                           "Float", "module");
  // Equal everywhere: trains.
  ModuleTrainer t(make_toy(), world(), adam, mse, options(ModuleStrategy::DDP, 1));
  EXPECT_EQ(t.fit(dataset()).losses.size(), 1u);
}

// Checkpoints save Adam, AdamW and plain SGD; anything else is refused before a step.
// Every libtorch optimizer with per-parameter state resumes exactly: saved
// under DDP after 3 of 6 steps, resumed under ZeRO-3 (and the other way),
// the run continues the uninterrupted one's losses. A checkpoint of another
// optimizer's state does not load, and LBFGS is refused with checkpoints on.
TEST(ModuleTrainer, EveryTorchOptimizerResumesExactly) {
  using Factory = train::OptimizerFactory;
  using namespace torch::optim;
  const std::vector<std::pair<std::string, Factory>> optimizers = {
      {"SGD momentum dampening", [](std::vector<at::Tensor> p) {
         return std::make_unique<SGD>(p, SGDOptions(kLr).momentum(0.9).dampening(0.1).weight_decay(0.01));
       }},
      {"SGD nesterov", [](std::vector<at::Tensor> p) {
         return std::make_unique<SGD>(p, SGDOptions(kLr).momentum(0.8).nesterov(true));
       }},
      {"RMSprop momentum centered", [](std::vector<at::Tensor> p) {
         return std::make_unique<RMSprop>(p, RMSpropOptions(kLr).momentum(0.5).centered(true));
       }},
      {"Adagrad", [](std::vector<at::Tensor> p) { return std::make_unique<Adagrad>(p, AdagradOptions(kLr)); }},
      {"Adam amsgrad", [](std::vector<at::Tensor> p) {
         return std::make_unique<Adam>(p, AdamOptions(kLr).amsgrad(true));
       }},
      {"AdamW amsgrad", [](std::vector<at::Tensor> p) {
         return std::make_unique<AdamW>(p, AdamWOptions(kLr).amsgrad(true));
       }}};
  for (const auto& [what, factory] : optimizers) {
    const AloneRun ref = train_alone(options(ModuleStrategy::DDP, 6), factory);
    for (auto [save_as, resume_as] : {std::pair{ModuleStrategy::DDP, ModuleStrategy::Zero3},
                                      std::pair{ModuleStrategy::Zero3, ModuleStrategy::DDP}}) {
      const std::string name = what + ", " + train::to_string(save_as) + " -> " + train::to_string(resume_as);
      const fs::path dir = fresh_dir("optimizers");
      ModuleTrainerOptions first = options(save_as, 6);
      first.stop_at = 3;
      first.checkpoint_dir = dir.string();
      expect_losses(ModuleTrainer(make_toy(), world(), factory, mse, first).fit(dataset()).losses,
                    std::vector<double>(ref.losses.begin(), ref.losses.begin() + 3), 0, name + " (first part)");
      ModuleTrainerOptions second = options(resume_as, 6);
      second.checkpoint_dir = dir.string();
      ModuleTrainer trainer(make_toy(), world(), factory, mse, second);
      expect_losses(trainer.fit(dataset()).losses, ref.losses, 3, name);
      EXPECT_LE(relative_diff(trainer.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
    }
  }
  const fs::path dir = fresh_dir("optimizers");
  ModuleTrainerOptions o = options(ModuleStrategy::DDP, 2);
  o.checkpoint_dir = dir.string();
  ModuleTrainer(make_toy(), world(), optimizers[0].second, mse, o).fit(dataset());
  o.steps = 4;  // Adam resuming SGD's checkpoint: its moments are not there
  expect_error<std::exception>([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "has no tensor exp_avg/",
                               "Adam from SGD");
  auto lbfgs = [](std::vector<at::Tensor> p) { return std::make_unique<LBFGS>(p, LBFGSOptions(kLr)); };
  expect_error([&] { ModuleTrainer t(make_toy(), world(), lbfgs, mse, o); }, "torch::optim::LBFGS", "LBFGS");
  o.checkpoint_dir.clear();  // without checkpoints LBFGS is not refused at construction
  EXPECT_NO_THROW(ModuleTrainer(make_toy(), world(), lbfgs, mse, o)) << "LBFGS without checkpoints";
}

// The YAML route: the CLI's keys give the options, and the optimizer is
// torch::optim::AdamW with the train section's settings.
// A user module with two LoraLinear layers and a plain Linear head.
struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl() {
    q = register_module("q", models::LoraLinear(10, 16));
    v = register_module("v", models::LoraLinear(16, 10));
    head = register_module("head", torch::nn::Linear(10, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return head(torch::relu(v(torch::relu(q(x))))); }
  models::LoraLinear q{nullptr}, v{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Adapted);

std::shared_ptr<torch::nn::Module> make_adapted() {
  torch::manual_seed(3);
  auto m = Adapted();
  m->to(at::kDouble);
  return m.ptr();
}

at::Tensor adapted_mse(torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(dynamic_cast<AdaptedImpl&>(m).forward(x), y);
}

models::LoraOptions lora_options() {
  models::LoraOptions l;
  l.r = 4;
  l.alpha = 8;
  l.target_modules = {"q", "v"};
  l.seed = 5;
  return l;
}

// LoRA through the trainer: adapters on the targeted LoraLinear layers train
// as on one process (1e-10) under DDP and the sharded strategies, the rest
// stays as it was; save_adapter writes a PEFT directory that adapter_from
// reads back; targets that are no LoraLinear are named.
TEST(ModuleTrainer, LoraTrainsTheAdaptersOfAUserModule) {
  {  // a LoraLinear without an adapter is a torch::nn::Linear: the same draws, the same names
    torch::manual_seed(9);
    torch::nn::Linear plain(10, 16);
    torch::manual_seed(9);
    models::LoraLinear lora(10, 16);
    EXPECT_TRUE(plain->weight.equal(lora->weight) && plain->bias.equal(lora->bias));
    EXPECT_EQ(lora->named_parameters().keys(), plain->named_parameters().keys());
  }
  auto ref = make_adapted();
  models::add_lora_adapters(*ref, lora_options());
  const std::vector<at::Tensor> init = [&] {
    std::vector<at::Tensor> v;
    for (auto& p : ref->parameters()) v.push_back(p.detach().clone());
    return v;
  }();
  run_alone(ref, adapted_mse, options(ModuleStrategy::DDP, 4));
  const fs::path dir = fresh_dir("adapter");
  for (ModuleStrategy s : {ModuleStrategy::DDP, ModuleStrategy::Zero2, ModuleStrategy::FullShard}) {
    const std::string name = train::to_string(s);
    ModuleTrainerOptions o = options(s, 4);
    if (s != ModuleStrategy::DDP) o.units.names = {"q", "v"};
    o.lora = lora_options();
    ModuleTrainer trainer(make_adapted(), world(), adam, adapted_mse, o);
    trainer.fit(dataset());
    const std::vector<at::Tensor> got = trainer.full_parameters();
    EXPECT_LE(relative_diff(got, ref->parameters(), /*per_tensor=*/true), 1e-10) << name;
    const auto named = ref->named_parameters();
    for (size_t i = 0; i < got.size(); ++i)
      if (models::is_adapter_parameter(named[i].key()))
        EXPECT_GT((got[i] - init[i]).abs().max().item<double>(), 1e-4) << name << " " << named[i].key() << " trained";
      else
        EXPECT_TRUE(got[i].equal(init[i])) << name << " " << named[i].key() << " frozen";
    if (s == ModuleStrategy::FullShard) trainer.save_adapter(dir.string());
  }
  // The PEFT directory: PEFT's names and config, and the trained values.
  const hub::Adapter a = hub::read_adapter(dir.string(), "module");
  EXPECT_EQ(a.settings.r, 4);
  EXPECT_EQ(a.settings.alpha, 8);
  EXPECT_EQ(a.settings.target_modules, (std::vector<std::string>{"q", "v"}));
  ASSERT_EQ(a.tensors.size(), 4u);
  for (auto& p : ref->named_parameters())
    if (models::is_adapter_parameter(p.key()))
      EXPECT_LE(relative_diff({a.tensors.at(p.key()).to(at::kDouble)}, {p.value()}, true), 1e-6) << p.key();
  if (world().rank() == 0) {
    std::ifstream in(dir / "adapter_config.json");
    const auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j["peft_type"], "LORA");
    EXPECT_TRUE(j["task_type"].is_null());
  }
  ModuleTrainerOptions again = options(ModuleStrategy::DDP, 4);
  again.lora = lora_options();
  again.adapter_from = dir.string();
  ModuleTrainer resumed(make_adapted(), world(), adam, adapted_mse, again);
  const auto loaded = resumed.full_parameters();
  const auto names = ref->named_parameters();
  for (size_t i = 0; i < loaded.size(); ++i)
    if (models::is_adapter_parameter(names[i].key()))
      EXPECT_TRUE(loaded[i].to(at::kFloat).equal(a.tensors.at(names[i].key()))) << names[i].key() << " from the file";

  ModuleTrainerOptions bad = options(ModuleStrategy::DDP, 4);
  bad.lora = lora_options();
  bad.lora->target_modules = {"head"};
  expect_error<UsageError>([&] { ModuleTrainer t(make_adapted(), world(), adam, adapted_mse, bad); },
                           "LoRA: 'head' is a torch::nn::Linear", "a plain Linear targeted");
  bad.lora->target_modules = {"q", "k_proj"};
  expect_error<UsageError>([&] { ModuleTrainer t(make_adapted(), world(), adam, adapted_mse, bad); },
                           "target_modules entry 'k_proj' matches no LoraLinear", "a target matching nothing");
  config::Config c;
  for (const char* kv : {"finetune.method=lora", "finetune.r=4", "finetune.alpha=8", "finetune.target_modules=q, v"})
    config::apply_override(c, kv);
  const ModuleTrainerOptions yaml = train::module_trainer_options(c);
  ASSERT_TRUE(yaml.lora.has_value());
  EXPECT_EQ(yaml.lora->target_modules, (std::vector<std::string>{"q", "v"}));
  config::apply_override(c, "finetune.method=qlora");
  expect_error<UsageError>([&] { train::module_trainer_options(c); }, "QLoRA quantizes the CLI families'", "qlora");
}

// A stack of residual blocks whose forward marks each block as one that may
// recompute (train::checkpointed); `runs` counts the blocks' forwards.
struct CkptBlockImpl : torch::nn::Module {
  CkptBlockImpl() : fc(register_module("fc", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) {
    ++runs;
    return x + torch::tanh(fc(x));
  }
  torch::nn::Linear fc;
  int64_t runs = 0;
};
TORCH_MODULE(CkptBlock);
struct CkptNetImpl : torch::nn::Module {
  CkptNetImpl() : in(register_module("in", torch::nn::Linear(10, 8))), out(register_module("out", torch::nn::Linear(8, 5))) {
    for (int i = 0; i < 4; ++i) blocks.push_back(register_module("block" + std::to_string(i), CkptBlock()));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : blocks) h = train::checkpointed(*b, [&b](const at::Tensor& t) { return b->forward(t); }, h);
    return out(h);
  }
  int64_t runs() const {
    int64_t n = 0;
    for (const auto& b : blocks) n += b->runs;
    return n;
  }
  torch::nn::Linear in, out;
  std::vector<CkptBlock> blocks;
};
TORCH_MODULE(CkptNet);

// Activation checkpointing of a user's module by policy: the same curve as
// one process without it, with the selected blocks run twice per micro-batch.
TEST(ModuleTrainer, ActivationCheckpointingByPolicyFollowsOneProcess) {
  auto make = [] {
    torch::manual_seed(5);
    auto m = CkptNet();
    m->to(at::kDouble);
    return m;
  };
  auto loss = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<CkptNetImpl&>(m).forward(x), y);
  };
  auto ref = make();
  const std::vector<double> ref_losses = run_alone(ref.ptr(), loss, options(ModuleStrategy::DDP, 4)).losses;
  const int64_t micro_batches = 4 * 2;  // 4 steps x 2 micro-batches per rank
  struct Case {
    ModuleStrategy strategy;
    train::CheckpointPolicy policy;
    int64_t recomputed;  // blocks recomputed per micro-batch
  };
  train::CheckpointPolicy every_other;
  every_other.blocks.types = {"CkptBlockImpl"};
  every_other.every = 2;
  train::CheckpointPolicy by_name;
  by_name.blocks.names = {"block1", "block2", "block3"};
  for (const Case& c : {Case{ModuleStrategy::DDP, {}, 4}, Case{ModuleStrategy::DDP, every_other, 2},
                        Case{ModuleStrategy::FullShard, every_other, 2}, Case{ModuleStrategy::Zero3, by_name, 3}}) {
    const std::string name = train::to_string(c.strategy) + ", " + std::to_string(c.recomputed) + " blocks recomputed";
    ModuleTrainerOptions o = options(c.strategy, 4);
    o.units.names.clear();
    if (c.strategy != ModuleStrategy::DDP) o.units.types = {"CkptBlockImpl"};
    o.activation_checkpointing = c.policy;
    auto m = make();
    ModuleTrainer t(m.ptr(), world(), adam, loss, o);
    expect_losses(t.fit(dataset()).losses, ref_losses, 0, name);
    EXPECT_LE(relative_diff(t.full_parameters(), ref->parameters(), /*per_tensor=*/true), 1e-10) << name;
    EXPECT_EQ(m->runs(), micro_batches * (4 + c.recomputed)) << name;
  }
  ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
  o.activation_checkpointing = every_other;
  o.activation_checkpointing->blocks.types = {"NoSuchImpl"};
  expect_error([&] { ModuleTrainer t(make().ptr(), world(), adam, loss, o); }, "activation checkpointing: ",
               "a class no submodule has");
  // A module that never calls checkpointed(): the policy would change nothing, so the first step stops.
  ModuleTrainerOptions plain = options(ModuleStrategy::DDP, 4);
  plain.activation_checkpointing = train::CheckpointPolicy{};
  expect_error<UsageError>([&] { ModuleTrainer(make_toy(), world(), adam, mse, plain).fit(dataset()); },
               "no selected submodule called train::checkpointed", "a module that marks no block");
}

// A residual MLP of the user's: the pair fc1 (colwise) -> fc2 (rowwise)
// splits over tp, the rest is replicated.
struct TpNetImpl : torch::nn::Module {
  TpNetImpl() {
    in = register_module("in", torch::nn::Linear(10, 16));
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor h = torch::tanh(in(x));
    return head(h + fc2(torch::gelu(fc1(h))));
  }
  torch::nn::Linear in{nullptr}, fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
TORCH_MODULE(TpNet);

// Tensor parallelism through the trainer: tp 2 (and dp 2 on 4 ranks) under
// DDP, ZeRO-2 and FULL_SHARD, losses and parameters as one process (1e-10),
// with clipping on; checkpoints move between tp 2 and no tensor
// parallelism; what it cannot run is named.
TEST(ModuleTrainer, TensorParallelByPlanMatchesOneProcess) {
  auto make = [] {
    torch::manual_seed(3);
    auto m = TpNet();
    m->to(at::kDouble);
    return m.ptr();
  };
  auto loss = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<TpNetImpl&>(m).forward(x), y);
  };
  auto ref = make();
  const std::vector<double> ref_losses = run_alone(ref, loss, options(ModuleStrategy::DDP, 4)).losses;
  std::vector<ModuleStrategy> strategies{ModuleStrategy::DDP, ModuleStrategy::Zero2, ModuleStrategy::FullShard};
  if (world().size() == 4) strategies.push_back(ModuleStrategy::HybridShard);  // 2 replicas x 1 shard x tp 2
  for (ModuleStrategy s : strategies) {
    const std::string name = train::to_string(s) + " over tp 2";
    ModuleTrainerOptions o = options(s, 4);
    o.units.names.clear();
    if (s != ModuleStrategy::DDP) o.units.names = {"fc1", "fc2"};
    o.tp = 2;
    o.tensor_plan = {{"fc1", parallel::tensor::colwise}, {"fc2", parallel::tensor::rowwise}};
    o.micro_batch = kGlobal / (2 * (world().size() / 2));  // two micro-batches per dp rank
    ModuleTrainer trainer(make(), world(), adam, loss, o);
    EXPECT_EQ(trainer.data_parallel_size(), world().size() / 2) << name;
    expect_losses(trainer.fit(dataset()).losses, ref_losses, 0, name);
    EXPECT_LE(relative_diff(trainer.full_parameters(), ref->parameters(), /*per_tensor=*/true), 1e-10) << name;
  }
  // Saved after 2 of 4 steps under FULL_SHARD over tp 2, resumed without
  // tensor parallelism (DDP over every rank), and the other way round.
  for (int saved_tp : {2, 1}) {
    const fs::path dir = fresh_dir("tp_resume");
    auto tp_options = [&](int tp, ModuleStrategy s) {
      ModuleTrainerOptions o = options(s, 4);
      o.units.names.clear();
      if (s != ModuleStrategy::DDP) o.units.names = {"fc1", "fc2"};
      o.tp = tp;
      if (tp > 1) o.tensor_plan = {{"fc1", parallel::tensor::colwise}, {"fc2", parallel::tensor::rowwise}};
      o.micro_batch = kGlobal / (2 * (world().size() / tp));
      o.checkpoint_dir = dir.string();
      return o;
    };
    const int resumed_tp = 3 - saved_tp;
    const std::string name = "tp " + std::to_string(saved_tp) + " -> tp " + std::to_string(resumed_tp);
    ModuleTrainerOptions first = tp_options(saved_tp, saved_tp > 1 ? ModuleStrategy::FullShard : ModuleStrategy::DDP);
    first.stop_at = 2;
    expect_losses(ModuleTrainer(make(), world(), adam, loss, first).fit(dataset()).losses,
                  std::vector<double>(ref_losses.begin(), ref_losses.begin() + 2), 0, name + " (first part)");
    ModuleTrainer second(make(), world(), adam, loss,
                         tp_options(resumed_tp, resumed_tp > 1 ? ModuleStrategy::FullShard : ModuleStrategy::DDP));
    EXPECT_EQ(second.completed_steps(), 2) << name;
    expect_losses(second.fit(dataset()).losses, ref_losses, 2, name);
    EXPECT_LE(relative_diff(second.full_parameters(), ref->parameters(), /*per_tensor=*/true), 1e-10) << name;
  }
  ModuleTrainerOptions o = options(ModuleStrategy::DDP, 4);
  o.tp = 2;
  expect_error([&] { ModuleTrainer t(make(), world(), adam, loss, o); }, "ModuleTrainerOptions.tensor_plan is empty",
               "tp without a plan");
  o.strategy = ModuleStrategy::HybridShard;
  o.tensor_plan = {{"fc1", parallel::tensor::colwise}};
  o.shard_group = o.replicate_group = world().group().get();
  expect_error([&] { train::validate(o); }, "builds its own dp x tp mesh", "tp with given HybridShard groups");
}

// The YAML route: `keys` (with the batch and schedule below) read by
// module_trainer_options train as AdamW on one process does; `inspect` looks
// at the trainer before it runs.
void expect_yaml_run(const std::vector<std::string>& keys, ModuleStrategy want,
                     const std::function<void(ModuleTrainer&)>& inspect) {
  config::Config c;
  for (const char* kv : {"train.steps=4", "train.global_batch=24", "train.warmup_steps=1", "train.weight_decay=0.05",
                         "train.grad_clip=0.3", "train.seed=11", "metrics.progress=false"})
    config::apply_override(c, kv);
  for (const std::string& kv : keys) config::apply_override(c, kv);
  config::apply_override(c, "train.micro_batch=" + std::to_string(kGlobal / (2 * world().size())));
  const ModuleTrainerOptions o = train::module_trainer_options(c);
  ASSERT_EQ(o.strategy, want);
  ModuleTrainer trainer(make_toy(), world(), nullptr, mse, o);
  inspect(trainer);
  const std::vector<double> losses = trainer.fit(dataset()).losses;

  auto m = make_toy();
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3).betas({0.9, 0.95}).weight_decay(0.05));
  data::SamplerOptions so;
  so.seed = 11;
  so.global_batch = kGlobal;
  data::DistributedSampler sampler(kSamples, so);
  for (int64_t s = 0; s < 4; ++s) {
    const train::ModuleBatch b = dataset().get(sampler.global_batch(s));
    opt.zero_grad();
    at::Tensor loss = mse(*m, b.input, b.target);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(m->parameters(), 0.3);
    opt.param_groups()[0].options().set_lr(optim::lr_at(s, 1e-3, *o.lr_schedule));
    opt.step();
    EXPECT_NEAR(losses.at(s), loss.item<double>(), 1e-10 * loss.item<double>()) << "step " << s + 1;
  }
  EXPECT_LE(relative_diff(trainer.full_parameters(), m->parameters(), /*per_tensor=*/true), 1e-10);
}

TEST(ModuleTrainer, YamlKeysTrainWithAdamW) {
  expect_yaml_run({"parallel.strategy=fsdp", "parallel.fsdp.sharding_strategy=SHARD_GRAD_OP",
                   "parallel.fsdp.transformer_layer_cls=LinearImpl"},
                  ModuleStrategy::ShardGradOp, [](ModuleTrainer& t) {
                    ASSERT_NE(t.sharded(), nullptr);
                    EXPECT_EQ(t.sharded()->options().sharding, parallel::fsdp::Sharding::ShardGradOp);
                  });
}

// Offload keys reach a user module: ZeRO-3 with optimizer and parameter
// shards in host memory, then in files, and FSDP's offload_params; the
// shards live off the device and the run is unchanged.
TEST(ModuleTrainer, YamlOffloadKeysOffloadShards) {
  const fs::path files = fresh_dir("offload");
  if (world().rank() == 0) fs::create_directories(files);
  world().group()->barrier().wait();
  auto offloaded = [](ModuleTrainer& t) {
    ASSERT_NE(t.sharded(), nullptr);
    EXPECT_GT(t.sharded()->offloaded_bytes(), 0);
  };
  expect_yaml_run({"parallel.strategy=zero3", "parallel.zero.offload_optimizer=cpu", "parallel.zero.offload_param=cpu"},
                  ModuleStrategy::Zero3, offloaded);
  expect_yaml_run({"parallel.strategy=zero3", "parallel.zero.offload_param=nvme",
                   "parallel.zero.offload_dir=" + files.string()},
                  ModuleStrategy::Zero3, offloaded);
  expect_yaml_run({"parallel.strategy=fsdp", "parallel.fsdp.offload_params=true"}, ModuleStrategy::FullShard,
                  offloaded);
  config::Config c;
  for (const char* kv : {"parallel.strategy=zero2", "parallel.zero.offload_param=cpu"}) config::apply_override(c, kv);
  expect_error<UsageError>([&] { train::module_trainer_options(c); },
                           "parallel.zero.offload_param=cpu would have no effect: stages 1 and 2", "offload_param zero2");
}

}  // namespace module_trainer_test
}  // namespace scaletrain::test

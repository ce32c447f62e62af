// The module trainer under pipeline parallelism (ModuleRecipe::pp): a
// user's torch::nn::Sequential cut into chunks by the recipe, each with its
// engine over dp, run by every schedule, against one process training the
// whole module on the whole batch (float64, 1e-10), HybridShard and tensor
// parallelism inside the stages included: clipping over every chunk, the
// schedule of learning rates, checkpoints that resume with and without the
// pipeline (and from stages split over tp), bf16 storage, LoRA adapters
// trained and saved through the stages, and what a pipeline of a user
// module refuses.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "module_trainer_case.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/models/lora_linear.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace module_trainer_pipeline_test {

using namespace trainer_case;
namespace pl = parallel::pipeline;

// Seven children: four Linear layers with Tanh between them.
std::shared_ptr<torch::nn::Module> make_seq() {
  torch::manual_seed(21);
  torch::nn::Sequential s(torch::nn::Linear(10, 12), torch::nn::Tanh(), torch::nn::Linear(12, 12), torch::nn::Tanh(),
                          torch::nn::Linear(12, 12), torch::nn::Tanh(), torch::nn::Linear(12, 5));
  s->to(at::kDouble);
  return s.ptr();
}

// Written for the Sequential: one process calls it with the whole module, a
// pipeline with its last chunk (Note [The last chunk runs in the loss]).
at::Tensor seq_mse(torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x), y);
}

struct Layout {
  int pp;
  ModuleStrategy strategy;
  pl::Schedule schedule;
  int virtual_stages;
  int dp_replicate = 1;  // HybridShard's replicas inside each stage's dp
  int tp = 1;            // tensor parallelism inside each stage (kSeqPlan)
};

// make_seq()'s Linear layers split over tp: a colwise layer's slice of the
// features through Tanh into a rowwise one, so each chunk's output (the
// cut falls after child 2) is whole.
const parallel::tensor::ModulePlan kSeqPlan = {{"0", parallel::tensor::colwise},
                                               {"2", parallel::tensor::rowwise},
                                               {"4", parallel::tensor::colwise},
                                               {"6", parallel::tensor::rowwise}};

std::string name_of(const Layout& l) {
  return "pp " + std::to_string(l.pp) + " " + train::to_string(l.strategy) + " " + pl::to_string(l.schedule) +
         (l.virtual_stages > 1 ? " v" + std::to_string(l.virtual_stages) : "") +
         (l.dp_replicate > 1 ? " x " + std::to_string(l.dp_replicate) + " replicas" : "") +
         (l.tp > 1 ? " x tp " + std::to_string(l.tp) : "");
}

ModuleTrainerOptions pipeline_options(const Layout& l, int64_t steps) {
  ModuleTrainerOptions o = options(l.strategy, steps);
  o.units = {};
  o.pp = l.pp;
  o.pp_schedule = l.schedule;
  o.virtual_stages = l.virtual_stages;
  o.dp_replicate = l.dp_replicate;
  o.tp = l.tp;
  if (l.tp > 1) o.tensor_plan = kSeqPlan;
  return o;
}

std::vector<Layout> layouts() {
  if (world().size() == 2)
    return {{2, ModuleStrategy::DDP, pl::Schedule::GPipe, 1},
            {2, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1},
            {2, ModuleStrategy::DDP, pl::Schedule::Interleaved, 2},
            {2, ModuleStrategy::FullShard, pl::Schedule::OneFOneB, 1}};
  return {{2, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1},
          {2, ModuleStrategy::Zero2, pl::Schedule::OneFOneB, 1},
          {2, ModuleStrategy::FullShard, pl::Schedule::Interleaved, 2},
          {4, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1},
          {2, ModuleStrategy::HybridShard, pl::Schedule::OneFOneB, 1, 2},
          {2, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1, 1, 2},
          {2, ModuleStrategy::FullShard, pl::Schedule::GPipe, 1, 1, 2}};
}

TEST(ModuleTrainer, PipelineOfASequentialMatchesOneProcess) {
  const AloneRun ref = run_alone(make_seq(), seq_mse, options(ModuleStrategy::DDP, 5));
  EXPECT_GT(ref.norms.front(), 0.3) << "clipping must act for the test to mean anything";
  for (const Layout& l : layouts()) {
    const std::string name = name_of(l);
    ModuleTrainer t(make_seq(), world(), adam, seq_mse, pipeline_options(l, 5));
    EXPECT_EQ(t.data_parallel_size(), world().size() / (l.pp * l.tp)) << name;
    EXPECT_EQ(t.stages().size(), static_cast<size_t>(l.virtual_stages)) << name;
    const train::ModuleTrainResult r = t.fit(dataset());
    expect_losses(r.losses, ref.losses, 0, name);
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
  }
  // Units chosen on the whole module, each chunk's engine taking its own:
  // the four Linear layers by type (two a chunk, beside each chunk's root
  // unit), or the first and the last by name (one a chunk).
  const Layout sharded{2, ModuleStrategy::FullShard, pl::Schedule::OneFOneB, 1};
  for (bool by_type : {true, false}) {
    ModuleTrainerOptions o = pipeline_options(sharded, 5);
    if (by_type)
      o.units.types = {"LinearImpl"};
    else
      o.units.names = {"0", "6"};
    const std::string name = name_of(sharded) + (by_type ? ", a unit per Linear" : ", units 0 and 6");
    ModuleTrainer t(make_seq(), world(), adam, seq_mse, o);
    EXPECT_EQ(t.stages().front().sharded->num_units(), by_type ? 3 : 2) << name;
    const train::ModuleTrainResult r = t.fit(dataset());
    expect_losses(r.losses, ref.losses, 0, name);
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
  }
}

// bf16 storage with fp32 masters (param_dtype) through the stages: the
// chunks' sharded engines keep fp32 masters of the module's bf16 parameters,
// and the run follows the same storage without a pipeline on the same ranks
// (the micro-batches' bf16 gradients add in another order, so within bf16's
// rounding), far from the float64 run it rounds.
TEST(ModuleTrainer, PipelineStoresBf16ParametersAsWithoutPipeline) {
  const Layout pp2{2, ModuleStrategy::FullShard, pl::Schedule::OneFOneB, 1};
  const Layout none{1, ModuleStrategy::FullShard, pl::Schedule::OneFOneB, 1};
  // The bf16 output widened to the targets' dtype, as a bf16 model's loss is.
  auto wide_mse = [](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
    return torch::mse_loss(dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x).to(y.scalar_type()), y);
  };
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<at::Tensor>> params;
  for (const Layout& l : {none, pp2}) {
    ModuleTrainerOptions o = pipeline_options(l, 5);
    o.param_dtype = at::kBFloat16;
    auto module = make_seq();
    ModuleTrainer t(module, world(), adam, wide_mse, o);
    for (const auto& p : t.optimizer().param_groups()[0].params()) EXPECT_EQ(p.scalar_type(), at::kFloat) << name_of(l);
    losses.push_back(t.fit(dataset()).losses);
    params.push_back(t.full_parameters());
    for (const auto& p : params.back()) EXPECT_EQ(p.scalar_type(), at::kBFloat16) << name_of(l);
  }
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i)
    EXPECT_NEAR(losses[1][i], losses[0][i], 2e-2 * std::abs(losses[0][i])) << "step " << i + 1;
  EXPECT_LE(relative_diff(params[1], params[0], /*per_tensor=*/false), 2e-2);
  const AloneRun f64 = run_alone(make_seq(), seq_mse, options(ModuleStrategy::DDP, 5));
  EXPECT_GT(std::abs(losses[1].back() - f64.losses.back()), 1e-6 * std::abs(f64.losses.back()))
      << "the bf16 run must differ from the float64 one for the comparison to mean anything";
}

// Saved under one layout at step 3 of 6, resumed under another (a pipeline
// into none, none into a pipeline): the rest is the uninterrupted run's.
TEST(ModuleTrainer, PipelineCheckpointsResumeWithAndWithoutPipeline) {
  const AloneRun ref = run_alone(make_seq(), seq_mse, options(ModuleStrategy::DDP, 6));
  // Two chunks per rank: their optimizer states follow one another in the layout.
  const Layout pp2{2, ModuleStrategy::FullShard, pl::Schedule::Interleaved, 2};
  const Layout none{1, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1};
  std::vector<std::pair<Layout, Layout>> cases = {{pp2, none}, {none, pp2}};
  // Split over tp in the stages: the checkpoint holds the whole tensors.
  if (world().size() == 4) cases.push_back({{2, ModuleStrategy::Zero2, pl::Schedule::OneFOneB, 1, 1, 2}, pp2});
  for (const auto& [save_as, resume_as] : cases) {
    const std::string name = name_of(save_as) + " -> " + name_of(resume_as);
    const fs::path dir = fresh_dir("pipeline_resume");
    ModuleTrainerOptions first = pipeline_options(save_as, 6);
    first.stop_at = 3;
    first.checkpoint_dir = dir.string();
    ModuleTrainer(make_seq(), world(), adam, seq_mse, first).fit(dataset());
    ModuleTrainerOptions second = pipeline_options(resume_as, 6);
    second.checkpoint_dir = dir.string();
    ModuleTrainer t(make_seq(), world(), adam, seq_mse, second);
    ASSERT_EQ(t.completed_steps(), 3) << name;
    const train::ModuleTrainResult r = t.fit(dataset());
    expect_losses(r.losses, ref.losses, 3, name);
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
  }
}

// LoRA through a pipeline: adapters on the LoraLinear children "0" and "4"
// of a Sequential, everything else frozen; the chunks' engines train only
// the adapters, and save_adapter gathers them from every stage.
TEST(ModuleTrainer, PipelineTrainsLoraAdaptersAsOneProcess) {
  auto make = [] {
    torch::manual_seed(23);
    torch::nn::Sequential s(models::LoraLinear(10, 12), torch::nn::Tanh(), models::LoraLinear(12, 12),
                            torch::nn::Tanh(), models::LoraLinear(12, 5));
    s->to(at::kDouble);
    return s.ptr();
  };
  models::LoraOptions lo;
  lo.r = 2;
  lo.alpha = 4;
  lo.target_modules = {"0", "4"};
  lo.seed = 3;
  auto ref_module = make();
  models::add_lora_adapters(*ref_module, lo);
  const AloneRun ref = run_alone(ref_module, seq_mse, options(ModuleStrategy::DDP, 4));
  std::vector<Layout> cases = {{2, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1},
                               {2, ModuleStrategy::FullShard, pl::Schedule::GPipe, 1}};
  for (const Layout& l : cases) {
    const std::string name = name_of(l);
    ModuleTrainerOptions o = pipeline_options(l, 4);
    o.lora = lo;
    ModuleTrainer t(make(), world(), adam, seq_mse, o);
    t.fit(dataset());
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
    const fs::path dir = fresh_dir("pipeline_adapter");
    t.save_adapter(dir.string());
    const hub::Adapter a = hub::read_adapter(dir.string(), "module");
    EXPECT_EQ(a.tensors.size(), 4u) << name;
    for (const auto& item : ref_module->named_parameters())
      if (models::is_adapter_parameter(item.key())) {
        ASSERT_TRUE(a.tensors.count(item.key())) << name << ": " << item.key();
        EXPECT_LE(relative_diff({a.tensors.at(item.key()).to(at::kDouble)}, {item.value()}, true), 1e-6)
            << name << ": " << item.key() << " as saved (fp32)";
      }
  }
}

// FP8 through a pipeline (float32): each rank casts its chunks' LoraLinear
// layers with the scales of one process that runs the whole step's
// micro-batches in turn, and a run saved after step 2 resumes with them.
TEST(ModuleTrainer, PipelineComputesLoraLinearLayersInFp8AsOneProcess) {
  auto make = [] {
    torch::manual_seed(25);
    torch::nn::Sequential s(models::LoraLinear(10, 16), torch::nn::ReLU(), models::LoraLinear(16, 16),
                            torch::nn::ReLU(), models::LoraLinear(16, 5));
    return s.ptr();
  };
  const train::ModuleData data = dataset32();
  const precision::Fp8LinearOptions f8{precision::Fp8Mix::Hybrid, true, 16, 0};
  const Layout l{2, world().size() == 2 ? ModuleStrategy::DDP : ModuleStrategy::FullShard, pl::Schedule::OneFOneB, 1};
  ModuleTrainerOptions o = pipeline_options(l, 5);
  o.fp8 = f8;
  // One process: every rank's micro-batches in turn, the multiplier of the whole step.
  auto ref_module = make();
  const std::vector<std::vector<double>> ref_scales =
      fp8_alone(ref_module, models::use_fp8(*ref_module, f8), seq_mse, data, o);
  // The layers this rank runs: children "0", "2", "4" in the chunks it holds.
  auto mine = [](const ModuleTrainer& t) {
    std::vector<bool> keep;
    for (const std::string child : {"0", "2", "4"}) {
      bool held = false;
      for (const auto& st : t.stages())
        for (const auto& c : st.module->named_children()) held = held || c.key() == child;
      keep.push_back(held);
    }
    return keep;
  };
  auto owned = [&](const std::vector<double>& scales, const std::vector<bool>& keep) {
    std::vector<double> out;
    for (size_t i = 0; i < keep.size(); ++i)
      if (keep[i]) out.insert(out.end(), scales.begin() + 3 * i, scales.begin() + 3 * i + 3);
    return out;
  };
  {
    ModuleTrainer t(make(), world(), adam, seq_mse, o);
    t.fit(data);
    const std::vector<bool> keep = mine(t);
    EXPECT_EQ(fp8_scales(t.fp8_layers(), keep), owned(ref_scales.back(), keep)) << name_of(l);
    EXPECT_LE(relative_diff(t.full_parameters(), ref_module->parameters(), /*per_tensor=*/true), 1e-5) << name_of(l);
  }
  const fs::path dir = fresh_dir("pipeline_fp8");
  ModuleTrainerOptions first = o;
  first.stop_at = 2;
  first.checkpoint_dir = dir.string();
  ModuleTrainer(make(), world(), adam, seq_mse, first).fit(data);
  ModuleTrainerOptions second = o;
  second.checkpoint_dir = dir.string();
  ModuleTrainer t(make(), world(), adam, seq_mse, second);
  const std::vector<bool> keep = mine(t);
  EXPECT_EQ(fp8_scales(t.fp8_layers(), keep), owned(ref_scales[1], keep)) << "resumed histories";
  t.fit(data);
  EXPECT_EQ(fp8_scales(t.fp8_layers(), keep), owned(ref_scales.back(), keep)) << "resumed";
  EXPECT_LE(relative_diff(t.full_parameters(), ref_module->parameters(), /*per_tensor=*/true), 1e-5) << "resumed";
}

TEST(ModuleTrainer, PipelineRefusalsNameTheField) {
  const Layout pp2{2, ModuleStrategy::DDP, pl::Schedule::OneFOneB, 1};
  ModuleTrainerOptions o = pipeline_options(pp2, 4);
  expect_error([&] { ModuleTrainer t(make_toy(), world(), adam, mse, o); }, "cuts a torch::nn::Sequential",
               "a module that is not a Sequential");
  o.tp = world().size();
  o.tensor_plan = {{"0", parallel::tensor::colwise}};
  expect_error([&] { ModuleTrainer t(make_seq(), world(), adam, seq_mse, o); },
               "x tp=" + std::to_string(world().size()) + " does not divide the world", "pp x tp beyond the world");
  o = pipeline_options(pp2, 4);
  o.strategy = ModuleStrategy::HybridShard;
  o.shard_group = o.replicate_group = world().group().get();
  expect_error([&] { train::validate(o); }, "ModuleTrainerOptions.shard_group cannot be given with pp > 1",
               "HybridShard's groups under pp");
  o = pipeline_options(pp2, 4);
  o.pp_balance = {1, 1, 5};
  expect_error([&] { ModuleTrainer t(make_seq(), world(), adam, seq_mse, o); }, "pp_balance has 3 entries",
               "a balance of another chunk count");
  o = pipeline_options(pp2, 4);
  o.pp_schedule = pl::Schedule::GPipe;  // two chunks per rank: interleaved's alone
  o.virtual_stages = 2;
  expect_error([&] { ModuleTrainer t(make_seq(), world(), adam, seq_mse, o); }, "ModuleTrainerOptions.pp_schedule",
               "GPipe with two chunks per rank");
  ModuleTrainerOptions flat = options(ModuleStrategy::DDP, 4);
  flat.pp_schedule = pl::Schedule::GPipe;
  expect_error([&] { train::validate(flat); }, "ModuleTrainerOptions.pp_schedule is for pp > 1", "schedule, no pp");
  EXPECT_EQ(train::balance_by_parameters({120, 0, 144, 0, 144, 0, 60}, 2), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(train::balance_by_parameters({5, 5, 5, 5}, 4), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_THROW(train::balance_by_parameters({5, 5}, 3), UsageError);
}

}  // namespace module_trainer_pipeline_test
}  // namespace scaletrain::test

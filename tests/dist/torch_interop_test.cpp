// A run moves from PyTorch to scaletrain and back mid-way
// (checkpoint/torch_training.h): Python's torch trains a float64 model with
// AdamW for 3 steps and saves {"model", "optim"}; the module trainer imports
// that file, resumes it under DDP and FULL_SHARD on this world and trains 3
// steps; the checkpoint it saves is exported as a torch.save file that
// Python's AdamW resumes for 3 more. Every loss is Python's own uninterrupted
// run's (tests/reference/torch_files.py `train`), to 1e-10.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dist_env.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/checkpoint/torch_training.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace torch_interop_test {

namespace fs = std::filesystem;
using train::ModuleStrategy;

std::string reference(const std::string& args) {
  return std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/torch_files.py " + args;
}

// torch_files.py's resume_model(), in C++: the same names and order.
std::shared_ptr<torch::nn::Module> python_model() {
  torch::nn::Sequential m(torch::nn::Linear(4, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                          torch::nn::Tanh(), torch::nn::Linear(8, 2));
  m->to(at::kDouble);
  return m.ptr();
}

at::Tensor mse(torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x), y);
}

std::vector<double> losses_of(const fs::path& json) {
  std::ifstream in(json);
  return nlohmann::json::parse(in).at("losses").get<std::vector<double>>();
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), 1e-10 * std::abs(want[i])) << what << " step " << i << ": " << got[i]
                                                                       << " vs " << want[i];
}

TEST(TorchInterop, APythonRunContinuesHereAndGoesBack) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed";
  const char* port = std::getenv("MASTER_PORT");
  const fs::path dir = fs::temp_directory_path() / ("scaletrain_torch_interop_" + std::string(port ? port : "0") +
                                                    "_w" + std::to_string(world().size()));
  if (world().rank() == 0) {
    fs::remove_all(dir);
    const std::string cmd = reference("train " + dir.string() + " --before 3 --after 6");
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  world().group()->barrier().wait();
  const std::vector<double> python = losses_of(dir / "losses.json");  // 9 steps, uninterrupted
  const checkpoint::TensorMap batch = checkpoint::load_safetensors((dir / "data.safetensors").string());
  const train::ModuleData data(batch.at("input"), batch.at("target"));
  for (ModuleStrategy s : {ModuleStrategy::DDP, ModuleStrategy::FullShard}) {
    const std::string name = train::to_string(s);
    const fs::path root = dir / ("ckpt_" + std::to_string(static_cast<int>(s)));
    std::string step_dir = (root / "step-000003").string();
    if (world().rank() == 0) {
      auto module = python_model();
      const auto imported = checkpoint::import_torch_training(*module, (dir / "train64.pt").string(), root.string());
      EXPECT_EQ(imported.step_dir, step_dir);
      EXPECT_EQ(imported.step, 3);
      EXPECT_EQ(imported.params.at("lr"), 1e-2);
      EXPECT_EQ(imported.params.at("beta2"), 0.95);
      EXPECT_EQ(imported.params.at("weight_decay"), 0.1);
      EXPECT_FALSE(imported.flags.at("amsgrad"));
    }
    world().group()->barrier().wait();
    train::ModuleTrainerOptions o;
    o.strategy = s;
    o.steps = 6;
    o.global_batch = 16;
    o.micro_batch = 16 / (2 * world().size());  // two micro-batches per rank
    o.shuffle = false;
    o.progress = false;
    o.adamw = train::AdamWSettings{1e-2, 0.9, 0.95, 1e-8, 0.1};
    o.resume = step_dir;
    o.checkpoint_dir = root.string();
    train::ModuleTrainer trainer(python_model(), world(), nullptr, mse, o);
    ASSERT_EQ(trainer.completed_steps(), 3) << name;
    expect_near_all(trainer.fit(data).losses, {python.begin() + 3, python.begin() + 6}, name + " after Python");
    world().group()->barrier().wait();
    if (world().rank() == 0) {
      const fs::path back = root / "back.pt";
      checkpoint::export_torch_training(*python_model(), (root / "step-000006").string(), back.string(),
                                        checkpoint::TorchAdamGroup{1e-2, 0.9, 0.95, 1e-8, 0.1, false});
      const std::string cmd = reference("resume " + back.string() + " " + (dir / "data.safetensors").string() + " 3 " +
                                        (root / "back.json").string() + " 2> /dev/null");
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
      expect_near_all(losses_of(root / "back.json"), {python.begin() + 6, python.end()}, name + " back in Python");
    }
    world().group()->barrier().wait();
  }
}

// What does not fit is named: another module, a missing optimizer key.
TEST(TorchInterop, AFileThatDoesNotFitIsNamed) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed";
  if (world().rank() != 0) return;
  const fs::path dir = fs::temp_directory_path() / ("scaletrain_torch_interop_bad_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string cmd = reference("train " + dir.string() + " --before 2 --after 0");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string file = (dir / "train64.pt").string();
  torch::nn::Sequential wider(torch::nn::Linear(4, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                              torch::nn::Tanh(), torch::nn::Linear(8, 3));
  wider->to(at::kDouble);
  try {
    checkpoint::import_torch_training(*wider, file, (dir / "a").string());
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("'3.weight' is [2, 8] in the file, [3, 8] in the module"), std::string::npos)
        << e.what();
  }
  auto module = python_model();
  try {
    checkpoint::import_torch_training(*module, file, (dir / "b").string(), {"model", "optimizer"});
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no optimizer state dict under 'optimizer'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "a")) << "nothing is written for a file that does not fit";
  // An existing checkpoint of that step is never replaced.
  checkpoint::import_torch_training(*module, file, (dir / "c").string());
  try {
    checkpoint::import_torch_training(*module, file, (dir / "c").string());
    ADD_FAILURE() << "replaced";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("step-000002 already exists"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace torch_interop_test
}  // namespace scaletrain::test

// The loop every run takes (train/loop.h), through the module trainer: a
// loss or gradient that is not finite stops the run before its update, the
// trainer beats to the launcher's watchdog, and a restarted attempt goes on
// from the newest checkpoint, as the CLI's runs do.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <memory>
#include <stdexcept>
#include <string>

#include "module_trainer_case.h"

namespace scaletrain::test {
namespace module_trainer_loop_test {

using namespace trainer_case;

// The step every run takes (Note [Training step] in train/loop.cpp): a loss
// that is not finite on one rank (step 2, the last rank), or a finite loss
// whose gradient holds one infinite element, stops the run on every rank
// before the optimizer step, naming the step (and under DDP the parameter
// and element); the parameters stay step 1's, as one process's.
TEST(ModuleTrainer, ANonFiniteLossStopsBeforeTheUpdate) {
  const bool odd = world().rank() == world().size() - 1;
  auto broken = [odd](bool whole_loss) {
    auto calls = std::make_shared<int64_t>(0);
    return train::ModuleLoss([=](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
      const int64_t step = (*calls)++ / 2;  // two micro-batches a step
      const at::Tensor l = mse(m, x, y);
      if (!odd || step != 1) return l;
      if (whole_loss) return l * std::numeric_limits<double>::quiet_NaN();
      // The loss's value unchanged, net2.bias[4]'s gradient infinite.
      at::Tensor c = dynamic_cast<ToyImpl&>(m).net2->bias.flatten()[-1].clone();
      c.register_hook([](const at::Tensor& g) { return g + std::numeric_limits<double>::infinity(); });
      return l + c * 0.0;
    });
  };
  ModuleTrainerOptions one = options(ModuleStrategy::DDP, 3);
  one.steps = 1;  // the schedule of three steps, the first one taken
  const AloneRun ref = train_alone(one);
  for (ModuleStrategy s : {ModuleStrategy::DDP, ModuleStrategy::FullShard})
    for (bool whole_loss : {true, false}) {
      const std::string name = train::to_string(s) + (whole_loss ? ", NaN loss" : ", infinite gradient");
      ModuleTrainer t(make_toy(), world(), adam, broken(whole_loss), options(s, 3));
      std::string said;
      try {
        t.fit(dataset());
      } catch (const std::runtime_error& e) {
        said = e.what();
      }
      EXPECT_NE(said.find(whole_loss ? "step 2: the loss is " : "step 2: the gradient norm is inf, not finite"),
                std::string::npos)
          << name << ": " << said;
      // DDP reduced the infinity into every rank's gradient of that element.
      if (s == ModuleStrategy::DDP && !whole_loss)
        EXPECT_NE(said.find("non-finite gradient is net2.bias (element 4)"), std::string::npos) << name << ": " << said;
      EXPECT_EQ(t.completed_steps(), 1) << name;
      EXPECT_EQ(t.optimizer_steps(), 1) << name;
      EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10) << name;
    }
}

// Note [Heartbeats] (train/loop.cpp): under `scaletrain launch`, as every
// dist test runs, the trainer beats once set up and after every step. The
// launcher's pipe is swapped for one this test reads, then put back.
TEST(ModuleTrainer, BeatsToTheLauncherAfterEveryStep) {
  const char* v = std::getenv("SCALETRAIN_HEARTBEAT_FD");
  ASSERT_NE(v, nullptr) << "dist tests run under scaletrain launch";
  const int fd = std::atoi(v);
  const int saved = ::dup(fd);
  int p[2];
  ASSERT_EQ(::pipe2(p, O_NONBLOCK), 0);
  ASSERT_GE(::dup2(p[1], fd), 0);
  auto drain = [&] {
    char buf[256];
    int64_t n = 0;
    for (ssize_t got; (got = ::read(p[0], buf, sizeof buf)) > 0;) n += got;
    return n;
  };
  {
    ModuleTrainer t(make_toy(), world(), adam, mse, options(ModuleStrategy::FullShard, 4));
    EXPECT_GE(drain(), 1) << "no beat once set up";
    t.fit(dataset());
    EXPECT_GE(drain(), 4) << "a beat after each of the 4 steps";
  }
  ::dup2(saved, fd);
  ::close(saved);
  ::close(p[0]);
  ::close(p[1]);
}

// Note [Training loop] (train/training_loop.cpp): a restarted attempt
// (SCALETRAIN_RESTART_COUNT > 0, as `scaletrain launch --max-restarts` sets
// it) goes on from the newest intact checkpoint whatever `resume` says (here
// never, a first start's setting), and adds to the metrics file after a
// record of the attempt; the rest of the run is the uninterrupted one's.
TEST(ModuleTrainer, ARestartedAttemptGoesOnFromTheNewestCheckpoint) {
  const AloneRun ref = train_alone(options(ModuleStrategy::FullShard, 6));
  const fs::path dir = fresh_dir("restart_attempt");
  ModuleTrainerOptions first = options(ModuleStrategy::FullShard, 6);
  first.stop_at = 3;
  first.checkpoint_dir = (dir / "ckpt").string();
  first.metrics_path = (dir / "metrics.jsonl").string();
  ModuleTrainer(make_toy(), world(), adam, mse, first).fit(dataset());
  ModuleTrainerOptions second = first;
  second.stop_at = 0;
  second.resume = "never";
  ::setenv("SCALETRAIN_RESTART_COUNT", "1", 1);
  ::setenv("SCALETRAIN_RESTART_REASON", "rank 1 exited with code 9", 1);
  train::ModuleTrainResult r;
  {
    ModuleTrainer t(make_toy(), world(), adam, mse, second);
    r = t.fit(dataset());
    EXPECT_LE(relative_diff(t.full_parameters(), ref.params, /*per_tensor=*/true), 1e-10);
  }
  ::unsetenv("SCALETRAIN_RESTART_COUNT");
  ::unsetenv("SCALETRAIN_RESTART_REASON");
  EXPECT_EQ(r.start_step, 3);
  expect_losses(r.losses, ref.losses, 3, "the restarted attempt");
  if (world().rank() != 0) return;
  std::ifstream in(dir / "metrics.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 7u) << "three steps, the restart's record, three steps";
  EXPECT_EQ(lines[3].value("record", ""), "restart");
  EXPECT_EQ(lines[3].value("resumed_from_step", -1), 3);
  EXPECT_EQ(lines[3].value("reason", ""), "rank 1 exited with code 9");
  for (size_t i : {0, 1, 2, 4, 5, 6}) EXPECT_EQ(lines[i].value("step", -1), static_cast<int>(i < 3 ? i + 1 : i)) << i;
}

}  // namespace module_trainer_loop_test
}  // namespace scaletrain::test

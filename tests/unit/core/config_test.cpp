// config/ without libtorch: this binary links scaletrain_core only, so the
// readers building and running here is the proof that they are torch-free.
// What the readers need of the model comes in as a ModelWidth; these tests
// give a counting stand-in and check that it is asked only for DeepSpeed's
// "auto" sizes, once, and that its answer sizes them. The readers' keys and
// files are covered in depth by tests/unit/torch/config_*_test.cpp.
#include "scaletrain/config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "scaletrain/config/deepspeed_config.h"
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using scaletrain::UsageError;
using namespace scaletrain::config;

namespace config_test {

constexpr double kMiB = 1024.0 * 1024.0;

class ConfigCore : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("st_config_core_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  // A width that counts how often it is asked.
  ModelWidth counting(int64_t width) {
    return [this, width](const ModelOptions&) {
      ++asked_;
      return width;
    };
  }
  std::string yaml() {
    return write("base.yaml", "model:\n  n_embd: 48\ntrain:\n  global_batch: 4\n  micro_batch: 2\n");
  }

  fs::path dir_;
  int asked_ = 0;
};

TEST_F(ConfigCore, ReadsYamlAndOverridesWithoutLibtorch) {
  const Config c = load_config(yaml(), {"--train.lr=0.5", "parallel.strategy=zero2"});
  EXPECT_EQ(c.model.n_embd, 48);
  EXPECT_EQ(c.train.global_batch, 4);
  EXPECT_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.parallel.strategy, "zero2");
  try {
    load_config(write("bad.yaml", "train:\n  lr: 1e-3\n  no_such_key: 1\n"));
    FAIL() << "an unknown key was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no_such_key"), std::string::npos) << e.what();
  }
}

TEST_F(ConfigCore, DeepSpeedAutoBucketsAskTheModelWidthOnce) {
  Config c = load_config(yaml(), {}, counting(1000));
  const std::string ds = write("z3.json",
                               "{\"zero_optimization\": {\"stage\": 3, \"stage3_prefetch_bucket_size\": \"auto\","
                               " \"stage3_param_persistence_threshold\": \"auto\"}}");
  apply_deepspeed_config(c, ds, 1, counting(48));
  EXPECT_EQ(asked_, 1);  // two "auto" keys, one question
  EXPECT_EQ(c.parallel.strategy, "zero3");
  EXPECT_DOUBLE_EQ(c.parallel.zero.prefetch_bucket_mb, std::floor(0.9 * 48 * 48) * 4 / kMiB);
  bool shown = false;  // 10 x width, shown resolved
  for (const auto& n : c.notices) shown |= n.find("stage3_param_persistence_threshold=480") != std::string::npos;
  EXPECT_TRUE(shown);
}

TEST_F(ConfigCore, SizesInElementsNeedNoWidth) {
  Config c = load_config(yaml());
  const std::string ds = write("z2.json", "{\"zero_optimization\": {\"stage\": 2, \"reduce_bucket_size\": 524288}}");
  apply_deepspeed_config(c, ds, 1, counting(48));
  EXPECT_EQ(asked_, 0);
  EXPECT_DOUBLE_EQ(c.parallel.zero.reduce_bucket_mb, 2.0);  // 2^19 fp32 elements
  // Without a width, "auto" is refused by name rather than guessed.
  Config d = load_config(yaml());
  const std::string auto_ds =
      write("z2_auto.json", "{\"zero_optimization\": {\"stage\": 2, \"reduce_bucket_size\": \"auto\"}}");
  try {
    apply_deepspeed_config(d, auto_ds, 1, {});
    FAIL() << "an \"auto\" size was resolved without the model's width";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.reduce_bucket_size=\"auto\""), std::string::npos)
        << e.what();
  }
}

}  // namespace config_test

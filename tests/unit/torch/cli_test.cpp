// Bad input through the real CLI: one line naming the problem, exit code 2,
// no stack trace.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Run {
  int code;
  std::string err;
};

fs::path scratch() {
  static fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("scaletrain_cli_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

Run run(const std::string& args) {
  const auto err = scratch() / "stderr.txt";
  // A clean environment: no launcher variables leak in from the test runner.
  std::string cmd = "env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u SLURM_PROCID " +
                    std::string(SCALETRAIN_BIN) + " " + args + " >/dev/null 2>" + err.string();
  int status = std::system(cmd.c_str());
  std::ifstream in(err);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

fs::path write(const std::string& name, const std::string& text) {
  auto p = scratch() / name;
  std::ofstream(p) << text;
  return p;
}

fs::path tokens() {
  static fs::path tok = [] {
    std::string text;
    for (int i = 0; i < 200; ++i) text += "In the beginning was the word. ";
    auto txt = write("corpus.txt", text);
    auto out = scratch() / "corpus.tok";
    EXPECT_EQ(run("prepare " + txt.string() + " -o " + out.string()).code, 0);
    return out;
  }();
  return tok;
}

void expect_usage_error(const Run& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  // exactly one line, no backtrace
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
}

TEST(Cli, MalformedYaml) {
  auto cfg = write("bad.yaml", "train:\n  steps: [1, 2\n");
  expect_usage_error(run("train " + cfg.string()), "not valid YAML");
}

TEST(Cli, UnknownConfigKey) {
  auto cfg = write("unknown.yaml", "train:\n  stpes: 3\n");
  expect_usage_error(run("train " + cfg.string()), "unknown config key 'train.stpes'");
}

TEST(Cli, UnknownOverrideKey) {
  auto cfg = write("ok.yaml", "train:\n  steps: 3\n");
  expect_usage_error(run("train " + cfg.string() + " --train.nope=1"), "unknown config key 'train.nope'");
}

TEST(Cli, IllTypedValue) {
  auto cfg = write("typed.yaml", "train:\n  steps: many\n");
  expect_usage_error(run("train " + cfg.string()), "train.steps");
}

TEST(Cli, MissingConfigFile) {
  expect_usage_error(run("train /nonexistent/config.yaml"), "/nonexistent/config.yaml");
}

TEST(Cli, MissingDataFile) {
  auto cfg = write("nodata.yaml", "data:\n  path: /nonexistent/tokens.bin\n");
  expect_usage_error(run("train " + cfg.string()), "/nonexistent/tokens.bin");
}

TEST(Cli, MeshThatDoesNotFitTheWorld) {
  auto cfg = write("mesh.yaml", "data:\n  path: " + tokens().string() + "\nparallel:\n  dp_replicate: 3\n");
  auto r = run("train " + cfg.string());
  expect_usage_error(r, "world size 1");
  EXPECT_NE(r.err.find("dp_replicate"), std::string::npos);
}

TEST(Cli, UnsupportedStrategy) {
  auto cfg = write("strategy.yaml", "data:\n  path: " + tokens().string() + "\nparallel:\n  strategy: zero9\n");
  expect_usage_error(run("train " + cfg.string()), "zero9");
}

TEST(Cli, DeepSpeedConfigErrors) {
  auto cfg = write("ds.yaml", "data:\n  path: " + tokens().string() + "\n");
  auto bad_json = write("bad.json", "{\"train_batch_size\": 8,,}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + bad_json.string()), "bad.json");
  auto stage4 = write("stage4.json", "{\"zero_optimization\": {\"stage\": 4}}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + stage4.string()), "zero_optimization.stage");
  auto unknown = write("unknown.json", "{\"steps_per_print\": 5, \"flops_profiler\": {}}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + unknown.string()), "'flops_profiler'");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed /nonexistent/ds.json"), "/nonexistent/ds.json");
}

TEST(Cli, TrainsTwoStepsAndWritesMetrics) {
  auto metrics = scratch() / "m.jsonl";
  auto cfg = write("tiny.yaml", "data:\n  path: " + tokens().string() +
                                    "\nmodel:\n  block_size: 32\ntrain:\n  steps: 2\n  global_batch: 4\n"
                                    "  micro_batch: 2\n  sample_tokens: 10\nmetrics:\n  peak_flops: 1e10\n"
                                    "  path: " + metrics.string() + "\n");
  auto r = run("train " + cfg.string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(metrics);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    for (const char* key : {"\"step\"", "\"loss\"", "\"lr\"", "\"step_ms\"", "\"tokens_per_s\"", "\"mfu\"",
                            "\"peak_rss_mb\"", "\"comm_wait_ms\""})
      EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
  }
  EXPECT_EQ(lines, 2);
}

}  // namespace

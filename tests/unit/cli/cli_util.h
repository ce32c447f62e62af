#pragma once
// Running the real `scaletrain` binary from unit tests: a scratch directory,
// a tiny token file, and the exit code and stderr of one command.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "scaletrain/util/error.h"

namespace scaletrain::test {

namespace fs = std::filesystem;

struct Run {
  int code;
  std::string err;
};

inline fs::path scratch() {
  static fs::path dir = [] {
    auto d = fs::temp_directory_path() / ("scaletrain_cli_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

inline Run run(const std::string& args) {
  const auto err = scratch() / "stderr.txt";
  // A clean environment: no launcher variables leak in from the test runner.
  std::string cmd = "env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u SLURM_PROCID " + std::string(SCALETRAIN_BIN) +
                    " " + args + " >/dev/null 2>" + err.string();
  int status = std::system(cmd.c_str());
  std::ifstream in(err);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

inline fs::path write(const std::string& name, const std::string& text) {
  auto p = scratch() / name;
  std::ofstream(p) << text;
  return p;
}

inline fs::path tokens() {
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

// The message of the UsageError `f` throws ("" if none); it must be one line.
inline std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  }
  ADD_FAILURE() << "no UsageError";
  return "";
}

inline void expect_usage_error(const Run& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  // exactly one line, no backtrace
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
}

// A 2-layer, 32-wide GPT on tokens(), 6 steps of global batch 8 in micro-batches
// of 2 with clipping that acts: the config the end-to-end trainer tests share.
inline fs::path small_train_config(const std::string& name, int sample_tokens) {
  return write(name,
               "model:\n  preset: tiny\n  n_layer: 2\n  n_embd: 32\n  n_head: 2\n  block_size: 32\n"
               "data:\n  path: " +
                   tokens().string() +
                   "\ntrain:\n  steps: 6\n  global_batch: 8\n  micro_batch: 2\n  lr: 3.0e-3\n"
                   "  warmup_steps: 2\n  grad_clip: 0.5\n  sample_tokens: " +
                   std::to_string(sample_tokens) + "\nmetrics:\n  peak_flops: 1.0e11\n  progress: false\n");
}

// The "loss" of every step line of a metrics JSON-lines file (lines with a
// "record" key, such as the memory report, are not steps).
inline std::vector<double> metric_losses(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("record")) out.push_back(j.at("loss").get<double>());
  }
  return out;
}

// The {"record": "memory"} lines of a metrics file, in order.
inline std::vector<nlohmann::json> memory_records(const fs::path& metrics) {
  std::ifstream in(metrics);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.value("record", "") == "memory") out.push_back(std::move(j));
  }
  return out;
}

}  // namespace scaletrain::test

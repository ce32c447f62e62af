#pragma once
// Running the real `scaletrain` binary from unit tests: a scratch directory,
// a tiny token file, and the exit code and stderr of one command.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

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

inline void expect_usage_error(const Run& r, const std::string& needle) {
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  // exactly one line, no backtrace
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
}

}  // namespace scaletrain::test

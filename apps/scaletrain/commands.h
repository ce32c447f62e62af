#pragma once
// Subcommands of the `scaletrain` CLI. Each add_* registers its subcommand on
// `app` and stores in `run` what to execute when that subcommand is chosen;
// the runner returns the process exit code. Throw scaletrain::UsageError for
// bad input (exit 2, one line).
#include <CLI/CLI.hpp>

#include <functional>

namespace scaletrain::cli {

using Runner = std::function<int()>;

void add_train(CLI::App& app, Runner& run);           // cmd_train.cpp
void add_bench_gemm(CLI::App& app, Runner& run);      // cmd_train.cpp
void add_launch(CLI::App& app, Runner& run);          // cmd_launch.cpp
void add_prepare(CLI::App& app, Runner& run);         // cmd_data.cpp
void add_plot(CLI::App& app, Runner& run);            // cmd_data.cpp
void add_estimate_memory(CLI::App& app, Runner& run); // cmd_estimate.cpp
void add_checkpoint(CLI::App& app, Runner& run);      // cmd_checkpoint.cpp
void add_config(CLI::App& app, Runner& run);          // cmd_config.cpp
void add_lora(CLI::App& app, Runner& run);            // cmd_lora.cpp

}  // namespace scaletrain::cli

// The `scaletrain` command line: thin subcommands over the library.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "scaletrain/util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"scaletrain: distributed training of large neural networks on libtorch"};
  app.require_subcommand(1);
  scaletrain::cli::Runner run;
  scaletrain::cli::add_train(app, run);
  scaletrain::cli::add_bench_gemm(app, run);
  scaletrain::cli::add_launch(app, run);
  scaletrain::cli::add_prepare(app, run);
  scaletrain::cli::add_plot(app, run);
  scaletrain::cli::add_estimate_memory(app, run);
  scaletrain::cli::add_checkpoint(app, run);
  scaletrain::cli::add_config(app, run);
  scaletrain::cli::add_lora(app, run);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "scaletrain: error: %s\n", e.what());
    return 2;
  }
  try {
    return run ? run() : 2;
  } catch (const scaletrain::UsageError& e) {
    std::fprintf(stderr, "scaletrain: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaletrain: fatal: %s\n", e.what());
    return 1;
  }
}

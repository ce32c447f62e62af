// `scaletrain train` and `scaletrain bench-gemm`.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>

#include "commands.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/module_library.h"
#include "scaletrain/train/trainer.h"

namespace scaletrain::cli {

void add_train(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("train", "train a model: scaletrain train CONFIG.yaml [--section.key=value ...]");
  auto config = std::make_shared<std::string>();
  auto deepspeed = std::make_shared<std::string>();
  auto init_from = std::make_shared<std::string>();
  cmd->add_option("config", *config, "YAML config file")->required();
  cmd->add_option("--deepspeed", *deepspeed,
                  "DeepSpeed JSON config applied over the YAML (ZeRO, batch, optimizer, ...)");
  cmd->add_option("--init-from", *init_from,
                  "start from this Hugging Face GPT-2 safetensors file (same as --model.init_from=FILE)");
  cmd->allow_extras();
  cmd->footer(
      "Overrides: --train.steps=10 --model.preset=gpt2 --parallel.fsdp.sharding_strategy=FULL_SHARD ... (any key of "
      "the config file)\nEvery key, its type, default and meaning: docs/config.md, or `scaletrain config keys`");
  cmd->callback([&run, cmd, config, deepspeed, init_from] {
    // Extras are the overrides; accept both --k=v and --k v.
    std::vector<std::string> raw = cmd->remaining(), overrides;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i].find('=') == std::string::npos && i + 1 < raw.size() && raw[i + 1].rfind("--", 0) != 0)
        overrides.push_back(raw[i] + "=" + raw[i + 1]), ++i;
      else
        overrides.push_back(raw[i]);
    }
    if (!init_from->empty()) overrides.push_back("model.init_from=" + *init_from);
    run = [config, deepspeed, overrides] {
      auto cfg = train::load_config(*config, overrides);
      if (!deepspeed->empty())
        train::apply_deepspeed_config(cfg, *deepspeed, config::deepspeed_data_parallel_size(cfg));
      if (cfg.model.library.empty())
        train::run_training(cfg);
      else
        train::run_module_library(cfg);
      return 0;
    };
  });
}

void add_bench_gemm(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("bench-gemm", "measure the fp32 GEMM peak that MFU is reported against");
  auto n = std::make_shared<int64_t>(1024);
  auto threads = std::make_shared<int>(0);
  cmd->add_option("--size", *n, "matrix size n (n x n times n x n)");
  cmd->add_option("--threads", *threads, "torch threads (0 = libtorch default)");
  cmd->callback([&run, n, threads] {
    run = [n, threads] {
      if (*threads > 0) observe::set_compute_threads(*threads);
      double f = observe::measure_gemm_flops(*n);
      std::printf("gemm %lldx%lld fp32, %d thread(s): %.2f GFLOP/s (use as metrics.peak_flops: %.4g)\n",
                  static_cast<long long>(*n), static_cast<long long>(*n), torch::get_num_threads(), f / 1e9, f);
      return 0;
    };
  });
}

}  // namespace scaletrain::cli

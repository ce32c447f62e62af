#pragma once
// The training loop: joins the job, builds the mesh, the model and the
// strategy, and runs the configured number of optimizer steps.
#include <vector>

#include "scaletrain/train/plan/config.h"

namespace scaletrain::train {

struct TrainResult {
  std::vector<double> losses;  // per step, mean over the global batch
  double tokens_per_s = 0;     // median over the steps after the first
};

// Runs `config` in this process (alone, or as one rank of a launched job).
// Bad input throws UsageError before any step runs.
TrainResult run_training(const config::Config& config);

}  // namespace scaletrain::train

#pragma once
// Internal to train/: the state of one training run (Run) and the phases of
// run_training (trainer.cpp) kept in other files: joining the job and
// building the model and optimizer, and the start lines (run_setup.cpp);
// what the training loop saves of a run (run_checkpoints.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/observe/memory.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/train/loop.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/recipe.h"

namespace scaletrain::train::detail {

// Everything a run holds between setup and the end, so each phase of
// run_training is a short function and the loop reads as a recipe
// (Note [Training step] in loop.cpp).
struct Run {
  const config::Config& cfg;
  const Plan& plan;
  data::SampleSource& dataset;
  comm::MeshDims dims;
  std::shared_ptr<comm::World> world;
  std::unique_ptr<comm::Mesh> mesh;
  bool lead = false;
  Parallelized par;
  std::vector<at::Tensor> params;  // what the optimizer updates
  std::unique_ptr<optim::AdamW> opt;
  int64_t opt_bytes = 0;
  std::unique_ptr<precision::LossScaler> scaler;
  std::vector<precision::Fp8LinearPtr> fp8;  // precision.fp8: the blocks' linears, in module order
  optim::ScheduleOptions sched;
  std::unique_ptr<data::DistributedSampler> sampler;
  double peak_flops = 0;
  double flops_per_token = 0;  // of one training step, frozen weights' gradients left out (MFU)
  double setup_peak_mb = 0, rss_before_setup = 0, rss_file_before_setup = 0;
  std::unique_ptr<TrainingLoop> loop;  // train/loop.h
  observe::MeasuredMemory mem;
  estimate::Layout mem_layout;
  double lifetime_rss_peak_mb = 0;

  DataParallel& dp() { return *par.dp; }
  models::CausalLM& model() { return *par.model; }
};

// run_setup.cpp: joins the job and builds the mesh, the model, its strategy
// and the optimizer; then the lead rank prints what it built.
// Compute threads per rank as the launcher decided (SCALETRAIN_THREADS or
// OMP_NUM_THREADS), else libtorch's default.
void set_threads();
void setup(Run& r, const comm::WorldInfo& info);
void print_start(Run& r, const comm::WorldInfo& info);

// run_checkpoints.cpp: the loop's options from the checkpoint.* and
// metrics.* keys, and what its checkpoints hold of this run.
LoopOptions loop_options(const Run& r);
RunCheckpoint run_checkpoint(Run& r);

}  // namespace scaletrain::train::detail

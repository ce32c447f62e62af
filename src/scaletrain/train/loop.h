#pragma once
// The training step every run takes, ours and users' modules alike (Note
// [Training step] in loop.cpp): the CLI's loop (trainer.cpp) and
// ModuleTrainer (module_trainer.cpp) each prepare a step's micro-batches
// their own way (token files with masks, packed documents and context
// splits; a user's samples) and hand them, with the engine behind
// DataParallel, to run_step.
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/train/data_parallel.h"

namespace scaletrain::train {

// What a step needs besides its micro-batches; set once for a run.
struct StepParts {
  DataParallel* engine = nullptr;
  // What the optimizer steps (the engine's optimizer_params(), taken once):
  // their gradients are the ones loss scaling checks.
  std::vector<at::Tensor> params;
  int64_t global_batch = 0;  // samples per step over the job (samples_per_s)
  // The ranks that see other samples of the step (data and context
  // parallel groups, HSDP's shard then replicate group): the loss averages
  // over each in turn.
  std::vector<comm::Group*> batch_groups;
  precision::LossScaler* scaler = nullptr;  // null: no loss scaling
  // FP8 linears whose delayed-scaling amaxes are agreed over fp8_groups at
  // the end of the micro-batches (Note [FP8 linears]).
  std::vector<precision::Fp8LinearPtr> fp8;
  std::vector<comm::Group*> fp8_groups;
  // The learning rate of a (0-based) step, and the optimizer step at that
  // rate over the engine's optimizer_params().
  std::function<double(int64_t step)> lr;
  std::function<void(double lr)> optimizer_step;
  double grad_clip = 0;  // max global norm; 0: measured, not clipped
  int rank = 0;          // this process's, for the errors that name it
};

// A step's micro-batches, built for the loss scale the step runs at.
using BuildStepWork = std::function<StepWork(double loss_scale)>;

struct StepOutcome {
  // step (1-based), loss (global mean), lr, grad_norm, loss_scale,
  // skipped_steps, step_ms, samples_per_s and comm_wait_ms; the rest is the
  // caller's.
  observe::StepMetrics metrics;
  bool skipped = false;  // the loss scaler found an overflow: no update
};

// Runs step `step` (0-based): the micro-batches through the engine, the
// overflow check, the global loss, clipping and the optimizer step, then
// zeroes the gradients, and beats to the launcher. Collective. Throws std::runtime_error naming the
// step (and the first parameter whose gradient is not finite) when the loss
// or the gradient norm is not finite and the scaler did not skip the step.
StepOutcome run_step(const StepParts& parts, int64_t step, const BuildStepWork& build);

// Note [Heartbeats] (loop.cpp): while it lives, and the process runs under
// `scaletrain launch`, a thread beats to the launcher whenever this process
// waits in a collective; run_step beats after every step.
class CollectiveHeartbeat {
 public:
  CollectiveHeartbeat();
  ~CollectiveHeartbeat();
  CollectiveHeartbeat(const CollectiveHeartbeat&) = delete;
  CollectiveHeartbeat& operator=(const CollectiveHeartbeat&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Whether a checkpoint is due after `done` steps: every `every` steps
// (0: only at the end) and at `stop`.
bool checkpoint_due(int64_t done, int64_t every, int64_t stop);

}  // namespace scaletrain::train

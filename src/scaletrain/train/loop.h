#pragma once
// The training loop every run takes, ours and users' modules alike: the
// step (Note [Training step] in loop.cpp) and the loop around it
// (TrainingLoop: resuming, metrics, traces, checkpoints; training_loop.cpp).
// The CLI's run_training (trainer.cpp) and ModuleTrainer
// (module_trainer.cpp) each build their model, engine and optimizer, and
// prepare a step's micro-batches their own way (token files with masks,
// packed documents and context splits; a user's samples); everything else
// of a run exists once, here.
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/group.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/observe/tracing.h"
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

// The launcher's attempt number (launch --max-restarts): 0 on a first start.
int restart_count();

// The checkpoint a run resumes from, "" for a fresh start. `resume`: auto
// (the newest complete checkpoint of `dir` whose files pass their checksums;
// a newer one that fails is skipped, with a line when `print`; none intact
// stops the run rather than starting over beside them) | never | a step
// directory or a root of them. A restarted attempt (restart_count() > 0)
// goes on from the newest intact checkpoint of `dir` whatever `resume` says.
// `key` names the setting in messages. Throws UsageError.
std::string find_resume(const std::string& dir, const std::string& resume, const std::string& key, bool print);

// What a run's loop does around its steps, set once: the CLI's train.*,
// checkpoint.* and metrics.* keys, or ModuleTrainerOptions' fields.
struct LoopOptions {
  std::string who = "scaletrain";  // the lead rank's lines begin "who: "
  int64_t steps = 0;               // the run's steps (its progress bar)
  int64_t stop_at = 0;             // stop after this step, as if preempted; 0: steps
  checkpoint::CheckpointOptions checkpoint;  // root "": no checkpoints
  int64_t checkpoint_every = 0;              // 0: only at the stop
  std::string resume = "auto";               // find_resume
  std::string resume_key = "resume";         // how messages name the settings
  std::string trace_key = "trace_steps";
  std::string metrics_path;  // the lead rank's JSON lines; "": none
  int64_t log_every = 1;     // steps between progress lines
  bool lines = true;         // progress lines (and checkpoint lines) on the lead rank's stdout
  bool bar = true;           // a progress bar where stdout is a terminal
  std::vector<int64_t> trace_steps;  // {first, last} (1-based); empty: none
  std::string trace_dir = "trace";
};

// What checkpoints hold of a run besides its state (step, optimizer steps,
// loss scaler, RNG, FP8 scaling): made only when the run saves or resumes.
struct RunCheckpoint {
  checkpoint::Layout layout;                              // what this rank saves and loads
  std::unique_ptr<checkpoint::OptimizerState> optimizer;  // null: model only
  checkpoint::ModelShape model;                           // for consolidation (our families)
  // Refuses a checkpoint of another kind before anything loads (may be empty).
  std::function<void(const checkpoint::Index& index, const std::string& from)> check;
};

// A step's hooks: its micro-batches for the step's loss scale, and what the
// caller adds to its metrics after the update (tokens, MFU, memory, MoE).
struct StepHooks {
  std::function<StepWork(int64_t step, double loss_scale)> build;
  std::function<void(observe::StepMetrics& m)> finish;  // may be empty
};

// The loop of every run (Note [Training loop] in training_loop.cpp).
class TrainingLoop {
 public:
  TrainingLoop(comm::World& world, StepParts parts, LoopOptions options);
  ~TrainingLoop();
  TrainingLoop(const TrainingLoop&) = delete;
  TrainingLoop& operator=(const TrainingLoop&) = delete;

  // Collective: resumes when a checkpoint is found (`make` is called when
  // the run saves or resumes), then opens the metrics file (a resumed run
  // or a restarted attempt adds to it) and the tracer.
  void start(const std::function<RunCheckpoint()>& make);
  // One step (the next one); saves a checkpoint when due. Collective.
  observe::StepMetrics step(const StepHooks& hooks);
  // The steps from completed_steps() to stop_step(), then finish().
  std::vector<observe::StepMetrics> run(const StepHooks& hooks);
  // Commits an asynchronous save and writes the trace (collective).
  void finish();
  // Saves the steps done, unless saved already (collective; needs checkpoints).
  void save();

  int64_t completed_steps() const { return step_; }
  int64_t optimizer_steps() const { return opt_steps_; }
  int64_t stop_step() const { return options_.stop_at > 0 ? options_.stop_at : options_.steps; }
  int64_t start_step() const { return start_; }
  bool checkpoints() const { return ckpt_ != nullptr; }
  const checkpoint::Checkpointer* checkpointer() const { return ckpt_.get(); }
  observe::MetricsSink& metrics() { return *sink_; }
  // The pipeline's measured bubble per step run, and its schedule's formula.
  const std::vector<double>& bubbles() const { return bubbles_; }
  std::optional<double> expected_bubble() const { return expected_bubble_; }

 private:
  int64_t resume(const std::string& from);
  void open_metrics();

  comm::World& world_;
  StepParts parts_;
  LoopOptions options_;
  bool lead_ = false;
  std::unique_ptr<RunCheckpoint> saved_;
  std::unique_ptr<checkpoint::Checkpointer> ckpt_;
  std::unique_ptr<observe::MetricsSink> sink_;
  std::unique_ptr<observe::StepTracer> tracer_;
  int64_t step_ = 0, start_ = 0, opt_steps_ = 0, last_saved_ = -1;
  std::vector<double> bubbles_;
  std::optional<double> expected_bubble_;
};

}  // namespace scaletrain::train

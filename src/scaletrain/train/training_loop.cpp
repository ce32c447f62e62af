// The loop of every run (loop.h): resuming, the steps with their metrics,
// traces and checkpoints.
//
// Note [Training loop]: what a run does around its steps, the same for our
// families (run_training) and a user's module (ModuleTrainer).
//   1. start: the checkpoint to go on from (find_resume; a restarted attempt
//      takes the newest intact one); the caller's RunCheckpoint (layout,
//      optimizer state, model shape, a check that refuses a checkpoint of
//      another kind) is made only when the run saves or resumes, so an
//      optimizer a checkpoint cannot hold is refused only then. Resuming
//      restores, besides the tensors, everything the next step depends on:
//      the step (which positions the schedule and the sampler, pure
//      functions of it), the optimizer's step count, the loss scaler, the
//      CPU RNG and FP8's delayed scaling. Then the metrics file (a resumed
//      run or a restarted attempt adds to it, after a record of the attempt)
//      and the tracer.
//   2. step: the tracer's window, the step (Note [Training step]), the
//      caller's additions to its metrics, the lead rank's metrics line, and
//      a checkpoint when due (every checkpoint_every steps and at the stop).
//   3. finish: an asynchronous save committed, the trace written.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/train/loop.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {

int restart_count() {
  for (const char* name : {"SCALETRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n >= 0 && n < 1000000) return static_cast<int>(n);
      throw UsageError(std::string(name) + "=" + v + " is not an attempt number");
    }
  return 0;
}

namespace {

// resume=auto: the newest complete checkpoint of `dir` that is intact.
std::string newest_intact(const std::string& dir, const std::string& key, bool print) {
  if (dir.empty()) return "";
  const std::vector<std::string> all = checkpoint::complete_checkpoints(dir);
  std::string newest_bad;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    std::string bad;
    try {
      const std::vector<std::string> problems = checkpoint::verify_files(*it, checkpoint::read_index(*it));
      if (problems.empty()) return *it;
      bad = "corrupt file " + problems.front();
    } catch (const UsageError& e) {
      bad = e.what();
    }
    if (print) std::printf("scaletrain: %s=auto: skipping %s: %s\n", key.c_str(), it->c_str(), bad.c_str());
    if (newest_bad.empty()) newest_bad = bad;
  }
  if (!all.empty())
    throw UsageError(key + "=auto: none of the " + std::to_string(all.size()) + " checkpoints in " + dir +
                     " is intact (the newest: " + newest_bad + "); remove them, or set " + key +
                     "=never to start over");
  return "";
}

}  // namespace

std::string find_resume(const std::string& dir, const std::string& resume, const std::string& key, bool print) {
  if (const int restart = restart_count(); restart > 0) {
    if (dir.empty() || checkpoint::complete_checkpoints(dir).empty()) {
      if (print && (resume == "auto" || resume == "never"))
        std::printf("scaletrain: restart %d of the group: no checkpoint to go on from (%s), starting at step 0\n",
                    restart, dir.empty() ? "no checkpoint directory is set" : ("none in " + dir).c_str());
    } else if (resume != "auto") {
      if (print)
        std::printf(
            "scaletrain: restart %d of the group: resuming from the newest intact checkpoint in %s "
            "(%s=%s is for a first start)\n",
            restart, dir.c_str(), key.c_str(), resume.c_str());
      return newest_intact(dir, key, print);
    }
  }
  if (resume == "never") return "";
  if (resume == "auto") return newest_intact(dir, key, print);
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(resume) / "index.json")) return resume;         // a step directory
  if (auto newest = checkpoint::newest_checkpoint(resume)) return *newest;  // a root of step directories
  throw UsageError(key + "=" + resume + " is not a complete checkpoint nor a directory holding one");
}

TrainingLoop::TrainingLoop(comm::World& world, StepParts parts, LoopOptions options)
    : world_(world), parts_(std::move(parts)), options_(std::move(options)), lead_(world.rank() == 0) {
  // The optimizer steps the loop counts (checkpoints keep them).
  auto step = std::move(parts_.optimizer_step);
  parts_.optimizer_step = [this, step](double lr) {
    step(lr);
    ++opt_steps_;
  };
}

TrainingLoop::~TrainingLoop() = default;

void TrainingLoop::start(const std::function<RunCheckpoint()>& make) {
  const std::string& root = options_.checkpoint.root;
  const std::string from = find_resume(root, options_.resume, options_.resume_key, lead_);
  if (!root.empty() || !from.empty()) saved_ = std::make_unique<RunCheckpoint>(make());
  if (!root.empty()) {
    checkpoint::check_shared_directory(*world_.group(), root);
    ckpt_ = std::make_unique<checkpoint::Checkpointer>(*world_.group(), options_.checkpoint);
  }
  if (!from.empty()) start_ = step_ = last_saved_ = resume(from);
  open_metrics();
  tracer_ = std::make_unique<observe::StepTracer>(options_.trace_steps, options_.trace_dir, world_,
                                                  parts_.engine->describe());
  if (tracer_->active() && lead_ && start_ >= options_.trace_steps[1])
    std::printf("%s: note: %s %lld-%lld were done before the resumed step %lld: nothing to trace\n",
                options_.who.c_str(), options_.trace_key.c_str(), static_cast<long long>(options_.trace_steps[0]),
                static_cast<long long>(options_.trace_steps[1]), static_cast<long long>(start_ + 1));
  launch::heartbeat();
}

// Step 1 of Note [Training loop]; returns the step to go on from.
int64_t TrainingLoop::resume(const std::string& from) {
  const auto t_load = std::chrono::steady_clock::now();
  RunCheckpoint& c = *saved_;
  if (c.check) c.check(checkpoint::read_index(from), from);
  const checkpoint::Index index = checkpoint::load_checkpoint(from, c.layout, c.optimizer.get());
  parts_.engine->after_load();
  opt_steps_ = index.state.optimizer_steps;
  // A run that starts or stops scaling here keeps its own: a fresh scaler, or none.
  if (parts_.scaler && !index.state.loss_scaler.empty())
    parts_.scaler->load_state(precision::LossScalerState::from_map(index.state.loss_scaler));
  checkpoint::set_cpu_rng_state(index.state.rng_cpu);
  if (lead_)
    std::printf("%s: resumed from %s (step %lld, saved by %s on %d ranks; loaded in %.3f s)\n", options_.who.c_str(),
                from.c_str(), static_cast<long long>(index.state.step), index.strategy.c_str(), index.world_size,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  // Note [FP8 scaling state]: the delayed scales go on where they were.
  const bool delayed = !parts_.fp8.empty() && parts_.fp8.front()->options().delayed;
  if (delayed && !index.state.fp8_scaling.empty()) {
    try {
      precision::fp8_restore_scaling(parts_.fp8, index.state.fp8_scaling);
    } catch (const std::invalid_argument& e) {
      throw UsageError("checkpoint " + from + ": " + e.what());
    }
  } else if (lead_ && delayed) {
    std::printf("%s: note: %s holds no FP8 scaling state (saved without delayed FP8 scaling): the scales start "
                "again from 1\n",
                options_.who.c_str(), from.c_str());
  } else if (lead_ && !index.state.fp8_scaling.empty()) {
    std::printf("%s: note: the FP8 scaling state in %s is not used (this run has no delayed FP8 scaling)\n",
                options_.who.c_str(), from.c_str());
  }
  return index.state.step;
}

// A restarted attempt adds to the metrics of the attempts before it, after
// a record that says which attempt this is, where it went on from and why.
void TrainingLoop::open_metrics() {
  const int attempt = restart_count();
  sink_ = std::make_unique<observe::MetricsSink>(lead_ ? options_.metrics_path : "", options_.steps,
                                                 options_.bar && lead_, /*append=*/attempt > 0 || start_ > 0);
  if (attempt == 0) return;
  const char* reason = std::getenv("SCALETRAIN_RESTART_REASON");
  sink_->write_record(nlohmann::json{{"record", "restart"},
                                     {"attempt", attempt},
                                     {"resumed_from_step", start_},
                                     {"reason", reason ? reason : ""}}
                          .dump());
}

observe::StepMetrics TrainingLoop::step(const StepHooks& hooks) {
  if (!sink_) throw std::logic_error("TrainingLoop::step before start");
  const int64_t stop = stop_step();
  tracer_->begin_step(step_ + 1);
  observe::StepMetrics m;
  {
    trace::Span span("step", "step", step_ + 1);
    const int64_t step = step_;
    m = run_step(parts_, step, [&](double loss_scale) { return hooks.build(step, loss_scale); }).metrics;
  }
  ++step_;
  if (const auto b = parts_.engine->pipeline_bubble()) {
    bubbles_.push_back(b->measured);
    expected_bubble_ = b->expected;
  }
  if (hooks.finish) hooks.finish(m);
  if (lead_) sink_->write(m, options_.lines && (m.step % options_.log_every == 0 || m.step == stop));
  tracer_->end_step(m.step);
  if (ckpt_ && checkpoint_due(step_, options_.checkpoint_every, stop)) save();
  return m;
}

std::vector<observe::StepMetrics> TrainingLoop::run(const StepHooks& hooks) {
  std::vector<observe::StepMetrics> out;
  while (step_ < stop_step()) out.push_back(step(hooks));
  finish();
  return out;
}

void TrainingLoop::finish() {
  if (ckpt_) ckpt_->finish();  // commits an asynchronous save (collective)
  if (tracer_) tracer_->finish();
}

void TrainingLoop::save() {
  if (!ckpt_) throw UsageError(options_.who + ": no checkpoint directory is set: there is nowhere to save");
  if (last_saved_ == step_) return;
  trace::Span span("checkpoint", "save checkpoint", step_);
  checkpoint::SaveState state;
  state.run.step = step_;
  state.run.optimizer_steps = opt_steps_;
  if (parts_.scaler) state.run.loss_scaler = parts_.scaler->state().to_map();
  state.run.rng_cpu = checkpoint::cpu_rng_state();
  // Note [FP8 scaling state]: agreed over the whole job (pipeline stages hold different layers).
  state.run.fp8_scaling = precision::fp8_scaling_state(parts_.fp8, {world_.group().get()});
  state.model = saved_->model;
  ckpt_->save(saved_->layout, saved_->optimizer.get(), state);
  launch::heartbeat();
  last_saved_ = step_;
  if (lead_ && options_.lines)
    std::printf("%s: checkpoint %s %s (training stalled %.3f s)\n", options_.who.c_str(),
                options_.checkpoint.async ? "started" : "saved",
                checkpoint::step_dir(options_.checkpoint.root, step_).c_str(), ckpt_->last_stall_s());
}

}  // namespace scaletrain::train

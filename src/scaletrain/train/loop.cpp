// The training step of every run (loop.h).
//
// Note [Training step]: one optimizer step, for our families and for a
// user's module alike.
//   1. The caller builds the step's micro-batches for the loss scale of the
//      step (loss.h's BuildStepWork): micro-batch k's loss is multiplied by
//      loss_scale x weights[k] (1/accum, or its share of the step's target
//      tokens: Note [Masked loss]) before its backward.
//   2. The engine runs their forwards and backwards (in turn, or in a
//      pipeline schedule) and reduces the gradients as it goes.
//   3. FP8's amaxes of the step are agreed over the ranks that saw parts of
//      the batch or pieces of the layers.
//   4. With loss scaling the optimizer's gradients are unscaled and checked
//      for inf/NaN over the engine's gradient groups, so an overflow on any
//      rank skips the update on every rank (the schedule still advances).
//   5. The global mean loss (one scalar all-reduce per batch group), known
//      before the update: a loss that is not finite stops the run with the
//      parameters of the last good step, unless the scaler skipped it.
//   6. Unless skipped: the global gradient norm (clipped when grad_clip > 0;
//      a norm that is not finite stops the run), the optimizer step at the
//      step's learning rate, the engine's after_step. Gradients are zeroed.
#include "scaletrain/train/loop.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "scaletrain/comm/activity.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

// Where a non-finite gradient first shows on this rank, for the error that
// stops the run: the first parameter (in this rank's layout order) whose
// gradient holds a NaN or an infinity, and the element (in the flattened
// full parameter).
std::string first_nonfinite_grad(DataParallel& engine, int rank) {
  try {
    const checkpoint::Layout l = engine.checkpoint_layout();
    for (const auto& slot : l.slots) {
      const at::Tensor g = slot.tensor.grad();
      if (!g.defined()) continue;
      const at::Tensor flat = g.reshape({-1});
      for (const auto& p : slot.pieces) {
        const at::Tensor bad = flat.narrow(0, p.local_offset, p.numel).isfinite().logical_not().nonzero();
        if (bad.numel() > 0)
          return "; on rank " + std::to_string(rank) + " the first parameter with a non-finite gradient is " + p.name +
                 " (element " + std::to_string(p.param_offset + bad[0][0].item<int64_t>()) + ")";
      }
    }
    return "; every gradient on rank " + std::to_string(rank) + " is finite";
  } catch (const std::exception&) {
    return "";
  }
}

// Steps 4-6 of Note [Training step]; `loss_sum` is this rank's weighted sum.
StepOutcome update_parameters(const StepParts& parts, int64_t step, double loss_sum) {
  DataParallel& engine = *parts.engine;
  StepOutcome out;
  if (parts.scaler) {
    std::vector<at::Tensor> grads;
    for (const auto& p : parts.params) grads.push_back(p.grad());
    out.skipped = parts.scaler->unscale_and_check(grads, engine.grad_groups());
    parts.scaler->update(out.skipped);
  }
  observe::StepMetrics& m = out.metrics;
  m.step = step + 1;
  auto l = torch::full({1}, loss_sum, torch::kDouble);
  for (comm::Group* g : parts.batch_groups)
    if (g && g->size() > 1) g->all_reduce(l, comm::ReduceOp::Avg).wait();
  m.loss = l.item<double>();
  const std::string kept = "; stopped before the optimizer step (the parameters are step " + std::to_string(step) + "'s";
  if (!out.skipped && !std::isfinite(m.loss))
    throw std::runtime_error("step " + std::to_string(m.step) + ": the loss is " + std::to_string(m.loss) +
                             ", not finite" + kept + "; a lower learning rate or gradient clipping may help)" +
                             first_nonfinite_grad(engine, parts.rank));
  m.lr = parts.lr(step);
  if (!out.skipped) {
    trace::Span span("optimizer", "clip and optimizer step");
    m.grad_norm = engine.clip_grad_norm(parts.grad_clip);
    if (!std::isfinite(m.grad_norm))
      throw std::runtime_error("step " + std::to_string(m.step) + ": the gradient norm is " +
                               std::to_string(m.grad_norm) + ", not finite (the loss was " + std::to_string(m.loss) +
                               ")" + kept + ")" + first_nonfinite_grad(engine, parts.rank));
    parts.optimizer_step(m.lr);
    engine.after_step();
  }
  engine.zero_grad();
  return out;
}

}  // namespace

StepOutcome run_step(const StepParts& parts, int64_t step, const BuildStepWork& build) {
  const auto t0 = std::chrono::steady_clock::now();
  DataParallel& engine = *parts.engine;
  engine.reset_stats();
  const double loss_scale = parts.scaler ? parts.scaler->scale() : 1.0;
  const StepWork work = build(loss_scale);
  // Gradients are cast to FP8 relative to what the loss was multiplied by
  // (Note [FP8 linears]): the scale over the micro-batches; callers that
  // weigh micro-batches apart set each one's in StepWork::prepare.
  const auto accum = static_cast<double>(std::max<size_t>(work.inputs.size(), 1));
  for (const auto& l : parts.fp8) l->set_loss_multiplier(loss_scale / accum);
  const double loss_sum = engine.step(work);
  precision::fp8_end_step(parts.fp8, parts.fp8_groups);
  StepOutcome out = update_parameters(parts, step, loss_sum);
  observe::StepMetrics& m = out.metrics;
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.samples_per_s = static_cast<double>(parts.global_batch) / std::max(m.step_ms, 1e-9) * 1000.0;
  m.comm_wait_ms = engine.comm_wait_ms();
  m.loss_scale = loss_scale;
  m.skipped_steps = parts.scaler ? parts.scaler->skipped_steps() : 0;
  launch::heartbeat();  // Note [Heartbeats]
  return out;
}

// Note [Heartbeats]: under `scaletrain launch --heartbeat-timeout` the
// trainer beats on progress: while it sets up, and after every step. A rank
// blocked in a collective makes no progress either, but only because a peer
// does not come; so while this process waits in a collective, a small thread
// beats for it (comm::collectives_waiting()). A rank that was stopped (all its
// threads) or is stuck computing goes silent, and the launcher kills that one.
CollectiveHeartbeat::CollectiveHeartbeat() {
  if (!std::getenv("SCALETRAIN_HEARTBEAT_FD")) return;
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stop_; }))
      if (comm::collectives_waiting() > 0) launch::heartbeat();
  });
}

CollectiveHeartbeat::~CollectiveHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool checkpoint_due(int64_t done, int64_t every, int64_t stop) {
  return every > 0 ? done % every == 0 || done == stop : done == stop;
}

}  // namespace scaletrain::train

#pragma once
// What the trainer shows of a run's insides: Chrome traces of chosen steps
// (metrics.trace_steps, Note [Tracing] in util/trace.h) and the communication
// summary at the end of a run (Note [Communication profile] in comm/group.h).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/observe/metrics.h"

namespace scaletrain::observe {

// Records `steps` (metrics.trace_steps: {first, last}, 1-based) on every
// rank and writes `dir`/rank<N>.json per rank and `dir`/trace.json (rank 0:
// every rank's events, one process per rank) after the last traced step.
// Clocks are aligned through the store when it is built (Note [Trace clocks]
// in tracing.cpp). Inactive (and free) when `steps` is empty.
class StepTracer {
 public:
  // Collective (through the store) when tracing is asked for.
  StepTracer(std::vector<int64_t> steps, std::string dir, comm::World& world, std::string description);
  bool active() const { return !steps_.empty(); }
  // Around step `step` (1-based).
  void begin_step(int64_t step);
  void end_step(int64_t step);
  // At the end of the run: writes what was recorded if the run stopped
  // inside the traced range (collective through the store).
  void finish();

 private:
  void write();

  std::vector<int64_t> steps_;  // {first, last}, or empty
  std::string dir_, description_;
  comm::World* world_;
  std::string prefix_;  // store keys of this run attempt
  int64_t offset_ns_ = 0, error_ns_ = 0, origin_ns_ = 0;
  bool recording_ = false, written_ = false;
  std::vector<int64_t> traced_;  // steps actually recorded
};

// The run's communication per (group, op) over every rank, printed by rank 0
// and written to the metrics file as {"record": "comm", ...}; a pipeline adds
// its measured bubble (median over `bubbles`, this rank's per-step values)
// next to the schedule's formula. Collective through the store.
void report_comm_summary(comm::World& world, int64_t steps, const std::vector<double>& bubbles,
                         std::optional<double> expected_bubble, bool lead, MetricsSink& sink);

}  // namespace scaletrain::observe

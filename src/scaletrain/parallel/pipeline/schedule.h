#pragma once
// Pipeline schedules as data: the ordered list of forward and backward
// actions each stage runs in one training step, and a check, run before any
// tensor moves, that the lists of all stages can complete together.
//
// Terms: p stages (ranks of the pp group), m micro-batches per step, v model
// chunks per stage (virtual stages; > 1 only for the interleaved schedule).
// The model's layers are cut into p*v consecutive chunks; stage s holds
// chunks s, s + p, s + 2p, ... (Megatron's interleaving), so chunk c lives on
// stage c % p as its local chunk c / p.
//
//   schedule     order on stage s                                  forwards in flight
//   gpipe        every forward, then every backward                m
//   1f1b         p-s-1 warm-up forwards, then one forward and one  min(p-s, m)
//                backward alternately, then the remaining backwards
//   interleaved  1f1b over (micro-batch, chunk) pairs, p micro-    2(p-s-1) + (v-1)p + 1
//                batches per chunk in turn (Megatron-LM's order)   chunk-passes (of 1/v the size)
//
// Note [Pipeline deadlock check]: stages exchange activations and gradients
// with blocking receives and non-blocking sends, so a stage waits only when a
// tensor it needs has not been produced. Whether a set of per-stage orders
// completes is then a property of the orders alone: simulate() replays them,
// letting every stage advance while its next action's inputs exist. If no
// stage can advance before all are done the schedule would hang, and
// check_schedule() names the stage and the action it would wait in. The same
// replay with a cost per action gives the schedule's idle time (its bubble)
// for equal stages, which the benchmark compares against measurement.
#include <string>
#include <vector>

namespace scaletrain::parallel::pipeline {

enum class Schedule { GPipe, OneFOneB, Interleaved };

Schedule parse_schedule(const std::string& s);  // gpipe | 1f1b | interleaved
std::string to_string(Schedule s);

struct Action {
  enum class Kind { Forward, Backward };
  Kind kind = Kind::Forward;
  int microbatch = 0;
  int chunk = 0;  // global chunk index in [0, p*v)
};
std::string to_string(const Action& a);  // "F3@c1" / "B0@c2"

struct ScheduleShape {
  Schedule schedule = Schedule::OneFOneB;
  int stages = 1;          // p
  int microbatches = 1;    // m
  int virtual_stages = 1;  // v
};

// Throws a one-line UsageError for shapes no schedule of this kind can run:
// m < 1, v != 1 outside interleaved, interleaved with m not a multiple of p,
// and any order that the replay finds would deadlock.
void check_schedule(const ScheduleShape& shape);

// The actions of stage `stage`, in the order it runs them (no validation).
std::vector<Action> stage_actions(const ScheduleShape& shape, int stage);

// Replays all stages' orders (Note [Pipeline deadlock check]) with a forward
// of one chunk costing forward_cost/v and a backward backward_cost/v.
struct Replay {
  bool completes = false;
  std::string stuck;    // when it does not: "stage 1 waits in B0@c1 for B0@c2"
  double makespan = 0;  // time until the last stage finishes
  // Mean over stages of idle / makespan: the bubble fraction.
  double bubble = 0;
  int max_in_flight = 0;  // most forwards without their backward on one stage
};
Replay simulate(const ScheduleShape& shape, const std::vector<std::vector<Action>>& orders, double forward_cost = 1,
                double backward_cost = 2);
Replay simulate(const ScheduleShape& shape, double forward_cost = 1, double backward_cost = 2);

// The textbook bubble: (p-1)/(m+p-1) for gpipe and 1f1b, and the same with
// each stage's work split in v chunks, (p-1)/(v*m + p-1), for interleaved
// (whose ratio to the useful time is Megatron's (p-1)/(v*m)).
double expected_bubble(const ScheduleShape& shape);

}  // namespace scaletrain::parallel::pipeline

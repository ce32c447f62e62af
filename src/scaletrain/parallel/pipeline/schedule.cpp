#include "scaletrain/parallel/pipeline/schedule.h"

#include <algorithm>
#include <map>

#include "scaletrain/util/error.h"

namespace scaletrain::parallel::pipeline {

Schedule parse_schedule(const std::string& s) {
  if (s == "gpipe") return Schedule::GPipe;
  if (s == "1f1b") return Schedule::OneFOneB;
  if (s == "interleaved") return Schedule::Interleaved;
  throw UsageError("unknown parallel.schedule '" + s + "' (gpipe | 1f1b | interleaved)");
}

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved:
      return "interleaved";
  }
  return "?";
}

std::string to_string(const Action& a) {
  return std::string(a.kind == Action::Kind::Forward ? "F" : "B") + std::to_string(a.microbatch) + "@c" +
         std::to_string(a.chunk);
}

namespace {

Action forward(int mb, int chunk) { return {Action::Kind::Forward, mb, chunk}; }
Action backward(int mb, int chunk) { return {Action::Kind::Backward, mb, chunk}; }

// Megatron-LM's interleaved order: the k-th forward (backward) of a stage
// works on micro-batch (k / pv) * p + k % p, in local chunk (k / p) % v
// (backward: counted from the last chunk), so p micro-batches pass through
// one chunk before the stage turns to the next.
std::vector<Action> interleaved(const ScheduleShape& sh, int s) {
  const int p = sh.stages, m = sh.microbatches, v = sh.virtual_stages, total = m * v;
  auto mb = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fwd = [&](int k) { return forward(mb(k), ((k / p) % v) * p + s); };
  auto bwd = [&](int k) { return backward(mb(k), (v - 1 - (k / p) % v) * p + s); };
  // With m == p every forward can go first without holding more than the
  // steady state would; otherwise the warm-up fills the pipeline's depth.
  const int warmup = m == p ? total : std::min(total, (p - s - 1) * 2 + (v - 1) * p);
  std::vector<Action> out;
  out.reserve(2 * static_cast<size_t>(total));
  for (int k = 0; k < warmup; ++k) out.push_back(fwd(k));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(fwd(warmup + k));
    out.push_back(bwd(k));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(bwd(k));
  return out;
}

}  // namespace

std::vector<Action> stage_actions(const ScheduleShape& sh, int s) {
  const int p = sh.stages, m = sh.microbatches;
  std::vector<Action> out;
  switch (sh.schedule) {
    case Schedule::GPipe:
      for (int i = 0; i < m; ++i) out.push_back(forward(i, s));
      for (int i = 0; i < m; ++i) out.push_back(backward(i, s));
      break;
    case Schedule::OneFOneB: {
      const int warmup = std::min(p - s - 1, m);
      for (int i = 0; i < warmup; ++i) out.push_back(forward(i, s));
      for (int i = 0; i < m - warmup; ++i) {
        out.push_back(forward(warmup + i, s));
        out.push_back(backward(i, s));
      }
      for (int i = m - warmup; i < m; ++i) out.push_back(backward(i, s));
      break;
    }
    case Schedule::Interleaved:
      out = interleaved(sh, s);
      break;
  }
  return out;
}

Replay simulate(const ScheduleShape& sh, const std::vector<std::vector<Action>>& orders, double tf, double tb) {
  const int p = sh.stages, chunks = sh.stages * sh.virtual_stages;
  const double cf = tf / sh.virtual_stages, cb = tb / sh.virtual_stages;
  // Finish time of every action done so far, by (kind, micro-batch, chunk).
  std::map<std::tuple<int, int, int>, double> done;
  auto key = [](Action::Kind k, int mb, int c) { return std::make_tuple(static_cast<int>(k), mb, c); };
  auto finished = [&](Action::Kind k, int mb, int c, double* at) {
    auto it = done.find(key(k, mb, c));
    if (it == done.end()) return false;
    *at = std::max(*at, it->second);
    return true;
  };
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0), busy(static_cast<size_t>(p), 0);
  Replay r;
  std::vector<int> in_flight(static_cast<size_t>(p), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& order = orders[static_cast<size_t>(s)];
      for (size_t& i = next[static_cast<size_t>(s)]; i < order.size(); ++i) {
        const Action& a = order[i];
        double start = clock[static_cast<size_t>(s)];
        bool ready;
        if (a.kind == Action::Kind::Forward)
          ready = a.chunk == 0 || finished(Action::Kind::Forward, a.microbatch, a.chunk - 1, &start);
        else
          ready = finished(Action::Kind::Forward, a.microbatch, a.chunk, &start) &&
                  (a.chunk == chunks - 1 || finished(Action::Kind::Backward, a.microbatch, a.chunk + 1, &start));
        if (!ready) break;
        const double cost = a.kind == Action::Kind::Forward ? cf : cb;
        clock[static_cast<size_t>(s)] = start + cost;
        busy[static_cast<size_t>(s)] += cost;
        done[key(a.kind, a.microbatch, a.chunk)] = start + cost;
        int& f = in_flight[static_cast<size_t>(s)];
        f += a.kind == Action::Kind::Forward ? 1 : -1;
        r.max_in_flight = std::max(r.max_in_flight, f);
        progress = true;
      }
    }
  }
  r.completes = true;
  for (int s = 0; s < p && r.completes; ++s) {
    const auto& order = orders[static_cast<size_t>(s)];
    const size_t i = next[static_cast<size_t>(s)];
    if (i == order.size()) continue;
    r.completes = false;
    const Action& a = order[i];
    Action need = a.kind == Action::Kind::Forward ? forward(a.microbatch, a.chunk - 1)
                  : done.count(key(Action::Kind::Forward, a.microbatch, a.chunk)) == 0
                      ? forward(a.microbatch, a.chunk)
                      : backward(a.microbatch, a.chunk + 1);
    r.stuck = "stage " + std::to_string(s) + " waits in " + to_string(a) + " for " + to_string(need) +
              ", which never comes";
  }
  if (!r.completes) return r;
  r.makespan = *std::max_element(clock.begin(), clock.end());
  double idle = 0;
  for (int s = 0; s < p; ++s) idle += r.makespan - busy[static_cast<size_t>(s)];
  r.bubble = r.makespan > 0 ? idle / p / r.makespan : 0;
  return r;
}

Replay simulate(const ScheduleShape& sh, double tf, double tb) {
  std::vector<std::vector<Action>> orders;
  orders.reserve(static_cast<size_t>(sh.stages));
  for (int s = 0; s < sh.stages; ++s) orders.push_back(stage_actions(sh, s));
  return simulate(sh, orders, tf, tb);
}

void check_schedule(const ScheduleShape& sh) {
  const std::string where = "parallel.schedule=" + to_string(sh.schedule) + " with pp=" + std::to_string(sh.stages) +
                            ", microbatches=" + std::to_string(sh.microbatches) +
                            ", virtual_stages=" + std::to_string(sh.virtual_stages);
  if (sh.stages < 1) throw UsageError("parallel.pp must be at least 1, got " + std::to_string(sh.stages));
  if (sh.microbatches < 1) throw UsageError(where + ": needs at least one micro-batch");
  if (sh.virtual_stages < 1) throw UsageError(where + ": virtual_stages must be at least 1");
  if (sh.schedule != Schedule::Interleaved && sh.virtual_stages != 1)
    throw UsageError(where + ": virtual stages need the interleaved schedule");
  if (sh.schedule == Schedule::Interleaved && sh.microbatches % sh.stages != 0)
    throw UsageError(where + ": the interleaved schedule needs a multiple of pp micro-batches (at least " +
                     std::to_string(sh.stages) + "); it sends p micro-batches through each chunk in turn");
  const Replay r = simulate(sh);
  if (!r.completes) throw UsageError(where + " would deadlock: " + r.stuck);
}

double expected_bubble(const ScheduleShape& sh) {
  const double p = sh.stages, m = sh.microbatches, v = sh.virtual_stages;
  return (p - 1) / (v * m + p - 1);
}

}  // namespace scaletrain::parallel::pipeline

#include "scaletrain/observe/tracing.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

#include "scaletrain/comm/group.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::observe {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Keys of this run attempt: a restarted job may find the last attempt's keys
// in a store that outlived it.
std::string attempt_prefix(const std::string& what) {
  const char* rc = std::getenv("SCALETRAIN_RESTART_COUNT");
  return what + "/" + (rc ? rc : "0") + "/";
}

// Writes `content` to `path` through a temporary file, so a reader never
// sees half a file.
void write_file(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
    if (!out) throw UsageError("metrics.trace_dir: cannot write " + tmp.string());
  }
  fs::rename(tmp, path);
}

}  // namespace

// Note [Trace clocks]: each process stamps events with its own steady clock,
// whose zero is arbitrary, so the ranks' traces must be put on one time
// axis. Before the first traced step every rank measures its offset to rank
// 0's clock through the store, as NTP does: it notes t1, sets a ping key,
// waits for rank 0's answer (rank 0's clock when it saw the ping, t0) and
// notes t2; then offset = t0 - (t1 + t2) / 2, wrong by at most half the
// round trip (t2 - t1) / 2. Of 8 rounds the one with the shortest round trip
// counts. Rank 0 answers the ranks one after another. The bound goes in the
// trace (otherData.clocks), so a reader knows what a gap of a few
// microseconds between ranks means; on one host through a local store it is
// tens of microseconds.
StepTracer::StepTracer(std::vector<int64_t> steps, std::string dir, comm::World& world, std::string description)
    : steps_(std::move(steps)), dir_(std::move(dir)), description_(std::move(description)), world_(&world) {
  if (steps_.empty()) return;
  trace::name_thread("compute");
  prefix_ = attempt_prefix("trace");
  c10d::Store& store = *world.store();
  constexpr int kRounds = 8;
  const int n = world.size(), rank = world.rank();
  if (rank == 0) {
    origin_ns_ = trace::now_ns();
    store.set(prefix_ + "origin", bytes(std::to_string(origin_ns_)));
    for (int r = 1; r < n; ++r)
      for (int k = 0; k < kRounds; ++k) {
        const std::string key = prefix_ + "clock/" + std::to_string(r) + "/" + std::to_string(k);
        store.get(key + "/ping");
        store.set(key + "/pong", bytes(std::to_string(trace::now_ns())));
      }
  } else {
    int64_t best = -1;
    for (int k = 0; k < kRounds; ++k) {
      const std::string key = prefix_ + "clock/" + std::to_string(rank) + "/" + std::to_string(k);
      const int64_t t1 = trace::now_ns();
      store.set(key + "/ping", bytes("1"));
      const int64_t t0 = std::stoll(text(store.get(key + "/pong")));
      const int64_t t2 = trace::now_ns();
      if (best < 0 || t2 - t1 < best) {
        best = t2 - t1;
        offset_ns_ = t0 - (t1 + t2) / 2;
        error_ns_ = (t2 - t1) / 2;
      }
    }
    origin_ns_ = std::stoll(text(store.get(prefix_ + "origin")));
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UsageError("metrics.trace_dir " + dir_ + " cannot be created: " + ec.message());
}

void StepTracer::begin_step(int64_t step) {
  if (steps_.empty() || step < steps_[0] || step > steps_[1]) return;
  if (!recording_) {
    trace::take();  // nothing from before the range
    recording_ = true;
    trace::set_on(true);
  }
  traced_.push_back(step);
}

void StepTracer::end_step(int64_t step) {
  if (!recording_ || step < steps_[1]) return;
  write();
}

void StepTracer::finish() {
  if (recording_ && !written_) write();
}

void StepTracer::write() {
  trace::set_on(false);
  recording_ = false;
  written_ = true;
  const trace::Recording rec = trace::take();
  const int rank = world_->rank(), n = world_->size();
  const std::string events = trace::to_chrome_events(rec, rank, "rank " + std::to_string(rank), offset_ns_, origin_ns_);
  const json clock{{"rank", rank}, {"offset_us", offset_ns_ / 1000.0}, {"error_us", error_ns_ / 1000.0}};
  json other{{"steps", traced_}, {"world_size", n}, {"run", description_}};
  {
    json mine{{"traceEvents", json::parse(events)}, {"displayTimeUnit", "ms"}, {"otherData", other}};
    mine["otherData"]["clocks"] = json::array({clock});
    write_file(fs::path(dir_) / ("rank" + std::to_string(rank) + ".json"), mine.dump());
  }
  c10d::Store& store = *world_->store();
  store.set(prefix_ + "events/" + std::to_string(rank), bytes(json{{"clock", clock}, {"events", events}}.dump()));
  if (rank != 0) return;
  json merged{{"traceEvents", json::array()}, {"displayTimeUnit", "ms"}, {"otherData", other}};
  merged["otherData"]["clocks"] = json::array();
  for (int r = 0; r < n; ++r) {
    const json part = json::parse(text(store.get(prefix_ + "events/" + std::to_string(r))));
    for (auto& e : json::parse(part["events"].get<std::string>())) merged["traceEvents"].push_back(std::move(e));
    merged["otherData"]["clocks"].push_back(part["clock"]);
  }
  const fs::path path = fs::path(dir_) / "trace.json";
  write_file(path, merged.dump());
  std::printf(
      "scaletrain: trace of steps %lld-%lld written to %s (every rank's) and %s/rank<N>.json; open it in "
      "chrome://tracing or ui.perfetto.dev, or draw it with scaletrain plot --timeline\n",
      static_cast<long long>(steps_[0]), static_cast<long long>(traced_.empty() ? steps_[0] : traced_.back()),
      path.string().c_str(), dir_.c_str());
  std::fflush(stdout);
}

namespace {

// This rank's communication totals (comm::comm_profile) and, for a pipeline,
// its measured bubble next to the schedule's.
json own_comm_rows(comm::World& world, const std::vector<double>& bubbles, std::optional<double> expected_bubble) {
  json mine{{"rank", world.rank()}, {"rows", json::array()}};
  for (const comm::CommTotals& c : comm::comm_profile())
    mine["rows"].push_back({{"group", c.group},
                            {"op", c.op},
                            {"group_size", c.group_size},
                            {"count", c.count},
                            {"bytes", c.bytes},
                            {"bus_bytes", c.bus_bytes},
                            {"exposed_seconds", c.exposed_seconds},
                            {"timed", c.timed},
                            {"seconds", c.seconds},
                            {"timed_bus_bytes", c.timed_bus_bytes}});
  if (expected_bubble) {
    std::vector<double> b = bubbles;
    std::sort(b.begin(), b.end());
    mine["pipeline_bubble"] = {{"measured", b.empty() ? 0.0 : b[b.size() / 2]}, {"expected", *expected_bubble}};
  }
  return mine;
}

// The lead rank's table: one line per (group, op, size) over the ranks that
// took part, then the pipeline bubble of each stage.
void print_comm_table(const json& ranks, int64_t steps, std::optional<double> expected_bubble) {
  struct Row {
    int ranks = 0;
    double count = 0, bytes = 0, timed = 0, timed_bus_bytes = 0, seconds = 0, exposed_max = 0;
  };
  std::map<std::tuple<std::string, std::string, int>, Row> rows;
  for (const auto& r : ranks)
    for (const auto& c : r["rows"]) {
      Row& row = rows[{c["group"].get<std::string>(), c["op"].get<std::string>(), c["group_size"].get<int>()}];
      ++row.ranks;
      row.count += c["count"].get<double>();
      row.bytes += c["bytes"].get<double>();
      row.timed += c["timed"].get<double>();
      row.timed_bus_bytes += c["timed_bus_bytes"].get<double>();
      row.seconds += c["seconds"].get<double>();
      row.exposed_max = std::max(row.exposed_max, c["exposed_seconds"].get<double>());
    }
  if (rows.empty() && !expected_bubble) {
    std::printf("scaletrain: communication over %lld steps: none (every group has one rank)\n",
                static_cast<long long>(steps));
    std::fflush(stdout);
    return;
  }
  std::printf(
      "scaletrain: communication over %lld steps, per rank (means over the ranks in each group; exposed: "
      "blocked in wait, the slowest rank's)\n",
      static_cast<long long>(steps));
  std::printf("  %-14s %-14s %5s %8s %10s %10s %11s %10s\n", "group", "op", "ranks", "calls", "MiB", "time ms",
              "exposed ms", "busbw GB/s");
  bool untimed = false;
  for (const auto& [key, row] : rows) {
    const auto& [group, op, size] = key;
    char time[32] = "-", busbw[32] = "-";
    if (row.timed > 0) {
      std::snprintf(time, sizeof time, "%.1f%s", row.seconds / row.ranks * 1e3, row.timed < row.count ? "*" : "");
      std::snprintf(busbw, sizeof busbw, "%.3f", row.seconds > 0 ? row.timed_bus_bytes / row.seconds / 1e9 : 0.0);
    }
    untimed = untimed || row.timed < row.count;
    std::printf("  %-14s %-14s %5d %8.1f %10.2f %10s %11.1f %10s\n", group.c_str(), op.c_str(), size,
                row.count / row.ranks, row.bytes / row.ranks / 1048576.0, time, row.exposed_max * 1e3, busbw);
  }
  if (untimed)
    std::printf(
        "  (- and *: calls whose completion the backend does not report, such as Gloo's send and recv, "
        "have no time and no bandwidth, only their exposed wait)\n");
  if (expected_bubble) {
    std::printf("  pipeline bubble (share of a step a stage does not compute; median of the steps after the first):");
    for (const auto& r : ranks)
      if (r.contains("pipeline_bubble"))
        std::printf(" rank %d %.3f", r["rank"].get<int>(), r["pipeline_bubble"]["measured"].get<double>());
    std::printf("; the schedule's formula: %.3f\n", *expected_bubble);
  }
  std::fflush(stdout);
}

}  // namespace

void report_comm_summary(comm::World& world, int64_t steps, const std::vector<double>& bubbles,
                         std::optional<double> expected_bubble, bool lead, MetricsSink& sink) {
  const json mine = own_comm_rows(world, bubbles, expected_bubble);
  const std::string prefix = attempt_prefix("comm_summary");
  c10d::Store& store = *world.store();
  store.set(prefix + std::to_string(world.rank()), bytes(mine.dump()));
  if (!lead) return;
  if (!comm::comm_profile_enabled()) {
    std::printf("scaletrain: communication not counted (SCALETRAIN_COMM_PROFILE=0)\n");
    std::fflush(stdout);
    return;
  }
  json ranks = json::array();
  for (int r = 0; r < world.size(); ++r) ranks.push_back(json::parse(text(store.get(prefix + std::to_string(r)))));
  json record{{"record", "comm"}, {"steps", steps}, {"ranks", ranks}};
  sink.write_record(record.dump());

  print_comm_table(ranks, steps, expected_bubble);
}

}  // namespace scaletrain::observe

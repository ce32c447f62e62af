// Note [Tracing] in trace.h.
#include "scaletrain/util/trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <mutex>

namespace scaletrain::trace {

namespace detail {
std::atomic<bool> g_on{false};
}

namespace {

struct Store {
  std::mutex mu;
  Recording rec;
};

Store& store() {
  static Store* s = new Store();  // never destroyed: threads may record during exit
  return *s;
}

thread_local int t_lane = -1;

int lane_locked(Store& s, const std::string* name) {
  if (t_lane < 0) {
    t_lane = static_cast<int>(s.rec.lanes.size());
    s.rec.lanes.push_back(name ? *name : "thread " + std::to_string(t_lane));
  } else if (name) {
    s.rec.lanes[static_cast<size_t>(t_lane)] = *name;
  }
  return t_lane;
}

// Comm lanes start here, after any thread's lane.
constexpr int kCommTid = 100;

}  // namespace

void set_on(bool on) { detail::g_on.store(on, std::memory_order_relaxed); }

void Span::end() {
  if (!live_) return;
  live_ = false;
  e_.end_ns = now_ns();
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  e_.lane = lane_locked(s, nullptr);
  s.rec.spans.push_back(e_);
}

void span(const char* cat, const char* name, int64_t index, int64_t start_ns, int64_t end_ns) {
  if (!on()) return;
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  SpanEvent e;
  e.cat = cat;
  e.name = name;
  e.index = index;
  e.start_ns = start_ns;
  e.end_ns = end_ns;
  e.lane = lane_locked(s, nullptr);
  s.rec.spans.push_back(e);
}

void name_thread(const std::string& name) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  lane_locked(s, &name);
}

int thread_lane() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  return lane_locked(s, nullptr);
}

void comm_event(CommEvent e) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  s.rec.comms.push_back(std::move(e));
}

Recording take() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  Recording out;
  out.spans = std::move(s.rec.spans);
  out.comms = std::move(s.rec.comms);
  out.lanes = s.rec.lanes;  // lanes stay assigned to their threads
  s.rec.spans.clear();
  s.rec.comms.clear();
  return out;
}

namespace {

// Spans measured by autograd hooks can end a few nanoseconds after the
// next one began (two hooks on one tensor fire one after the other, and the
// first is the next span's start). Such a span is the next one's sibling,
// not its parent: the later one starts where the earlier ends, so every
// lane nests properly (what trace viewers require of "X" events). `events`
// are in lane order, each lane in time order.
void nest_lanes(std::vector<nlohmann::json>& events) {
  using nlohmann::json;
  std::vector<json*> open;  // enclosing spans on the current lane
  int lane = -1;
  for (auto& e : events) {
    const int tid = e["tid"].get<int>();
    if (tid != lane) {
      open.clear();
      lane = tid;
    }
    double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
    while (!open.empty()) {
      const double top_end = (*open.back())["ts"].get<double>() + (*open.back())["dur"].get<double>();
      if (ts >= top_end) {
        open.pop_back();
      } else if (ts + dur > top_end) {  // overlaps the top's end: starts after it
        dur = std::max(0.0, ts + dur - top_end);
        ts = top_end;
        e["ts"] = ts;
        e["dur"] = dur;
        open.pop_back();
      } else {
        break;
      }
    }
    open.push_back(&e);
  }
}

// The metadata events that name the process and its lanes (threads and comm
// lanes), each lane once, in lane order.
nlohmann::json metadata_events(const std::vector<nlohmann::json>& events, const Recording& r, int pid,
                               const std::string& process_name) {
  using nlohmann::json;
  json out = json::array();
  out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", process_name}}}});
  out.push_back(
      {{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
  std::map<int, std::string> threads;
  for (const json& e : events) {
    const int tid = e["tid"].get<int>();
    if (threads.count(tid)) continue;
    threads[tid] = tid >= kCommTid
                       ? "comm " + std::to_string(tid - kCommTid)
                       : (static_cast<size_t>(tid - 1) < r.lanes.size() ? r.lanes[static_cast<size_t>(tid - 1)]
                                                                        : "thread " + std::to_string(tid - 1));
  }
  for (const auto& [tid, name] : threads) {
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}});
    out.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
  }
  return out;
}

}  // namespace

std::string to_chrome_events(const Recording& r, int pid, const std::string& process_name, int64_t offset_ns,
                             int64_t origin_ns) {
  using nlohmann::json;
  auto us = [&](int64_t t) { return static_cast<double>(t + offset_ns - origin_ns) / 1000.0; };
  auto span_name = [](const char* name, int64_t index) {
    return index < 0 ? std::string(name) : std::string(name) + " " + std::to_string(index);
  };
  std::vector<json> events;
  auto complete = [&](std::string name, const char* cat, int tid, int64_t start, int64_t end, json args) {
    json e{{"name", std::move(name)}, {"cat", cat},     {"ph", "X"},
           {"ts", us(start)},         {"dur", static_cast<double>(std::max<int64_t>(0, end - start)) / 1000.0},
           {"pid", pid},              {"tid", tid}};
    if (!args.is_null()) e["args"] = std::move(args);
    events.push_back(std::move(e));
  };
  for (const SpanEvent& s : r.spans) {
    json args;
    if (s.index >= 0) args["index"] = s.index;
    complete(span_name(s.name, s.index), s.cat, s.lane + 1, s.start_ns, s.end_ns, std::move(args));
  }
  // Collectives on comm lanes: each takes the first lane free at its launch.
  std::vector<const CommEvent*> comms;
  for (const CommEvent& c : r.comms) comms.push_back(&c);
  std::stable_sort(comms.begin(), comms.end(),
                   [](const CommEvent* a, const CommEvent* b) { return a->launch_ns < b->launch_ns; });
  std::vector<int64_t> lane_free;  // end of the last collective on each comm lane
  for (const CommEvent* c : comms) {
    size_t lane = 0;
    while (lane < lane_free.size() && lane_free[lane] > c->launch_ns) ++lane;
    if (lane == lane_free.size()) lane_free.push_back(0);
    const int64_t done = std::max(c->done_ns, c->launch_ns);
    lane_free[lane] = done;
    const double secs = static_cast<double>(done - c->launch_ns) / 1e9;
    const double wait_us = static_cast<double>(c->wait_end_ns - c->wait_start_ns) / 1000.0;
    json args{{"op", c->op},       {"group", c->group}, {"group_size", c->group_size},
              {"seq", c->seq},     {"bytes", c->bytes}, {"exposed_us", wait_us}};
    if (!c->completion_reported)
      args["completion"] = "not reported by the backend: drawn until its wait returned";
    else if (secs > 0 && c->bytes > 0)
      args["busbw_GBps"] = static_cast<double>(c->bytes) * c->bus_factor / secs / 1e9;
    complete(std::string(c->op) + " " + c->group, "comm", kCommTid + static_cast<int>(lane), c->launch_ns, done,
             std::move(args));
    complete(std::string("wait ") + c->op, "wait", c->wait_lane + 1, c->wait_start_ns, c->wait_end_ns,
             json{{"group", c->group}, {"seq", c->seq}});
  }
  // Per thread, in time order; a parent before the spans it contains.
  auto in_order = [](const json& a, const json& b) {
    const int ta = a["tid"].get<int>(), tb = b["tid"].get<int>();
    if (ta != tb) return ta < tb;
    const double sa = a["ts"].get<double>(), sb = b["ts"].get<double>();
    if (sa != sb) return sa < sb;
    return a["dur"].get<double>() > b["dur"].get<double>();
  };
  std::stable_sort(events.begin(), events.end(), in_order);
  nest_lanes(events);
  std::stable_sort(events.begin(), events.end(), in_order);
  json out = metadata_events(events, r, pid, process_name);
  for (auto& e : events) out.push_back(std::move(e));
  return out.dump();
}

}  // namespace scaletrain::trace

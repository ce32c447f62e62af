// The communication profile (Note [Communication profile] in group.h): the
// per-process totals of the collectives, and their trace events.
#include "scaletrain/comm/group_internal.h"

#include "scaletrain/util/trace.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace scaletrain::comm {

// --- Communication profile (Note [Communication profile] in group.h) -------

namespace detail {
struct CommProfile {
  const char* op = "";
  std::string group;
  int size = 0;
  uint64_t seq = 0;
  int64_t bytes = 0;
  int64_t launch_ns = 0;
  bool completion_reported = false;  // a completion callback is attached
  std::atomic<int64_t> done_ns{0};   // set by that callback (0: none came)
};
}  // namespace detail

namespace {

struct ProfileTotals {
  std::mutex mu;
  std::map<std::tuple<std::string, std::string, int>, CommTotals> by_key;  // (group, op, size)
};

ProfileTotals& totals() {
  static ProfileTotals* t = new ProfileTotals();  // never destroyed: collectives may end during exit
  return *t;
}

}  // namespace

namespace detail {

std::shared_ptr<CommProfile> launch_profile(const char* op, const std::string& group, int size, uint64_t seq,
                                            int64_t bytes, bool futures, const std::vector<compat::WorkPtr>& ws) {
  auto p = std::make_shared<CommProfile>();
  p->op = op;
  p->group = group;
  p->size = size;
  p->seq = seq;
  p->bytes = bytes;
  p->launch_ns = trace::now_ns();
  // Gloo completes a collective's future on its worker thread when the
  // data has arrived; NCCL's future completes at launch (the device work is
  // only enqueued), so NCCL calls, like Gloo's send and recv, go untimed.
  // Those are never asked: a work without a future throws a c10::Error,
  // whose backtrace libc10 symbolizes (about 25 ms here, each call).
  if (futures) {
    for (auto& work : ws) {
      try {
        std::weak_ptr<CommProfile> weak = p;
        work->getFuture()->addCallback([weak](c10::ivalue::Future&) {
          if (auto q = weak.lock()) q->done_ns.store(trace::now_ns());
        });
        p->completion_reported = true;
      } catch (const std::exception&) {  // a work type without a future: untimed
      }
    }
  }
  return p;
}

// Counts a collective whose backend work has completed; `wait_*`: the
// waiting thread's blocked interval.
void count_collective(const CommProfile& p, int64_t wait_start, int64_t wait_end) {
  int64_t done = p.done_ns.load();
  const bool timed = p.completion_reported && done != 0;
  if (!timed) done = wait_end;
  const double factor = bus_factor(p.op, p.size);
  {
    ProfileTotals& t = totals();
    std::lock_guard<std::mutex> lock(t.mu);
    CommTotals& c = t.by_key[{p.group, p.op, p.size}];
    if (c.count == 0) {
      c.op = p.op;
      c.group = p.group;
      c.group_size = p.size;
    }
    ++c.count;
    c.bytes += p.bytes;
    c.bus_bytes += static_cast<double>(p.bytes) * factor;
    c.exposed_seconds += static_cast<double>(wait_end - wait_start) / 1e9;
    if (timed) {
      ++c.timed;
      c.seconds += static_cast<double>(std::max<int64_t>(0, done - p.launch_ns)) / 1e9;
      c.timed_bus_bytes += static_cast<double>(p.bytes) * factor;
    }
  }
  if (!trace::on()) return;
  trace::CommEvent e;
  e.group = p.group;
  e.op = p.op;
  e.group_size = p.size;
  e.seq = p.seq;
  e.bytes = p.bytes;
  e.bus_factor = factor;
  e.launch_ns = p.launch_ns;
  e.done_ns = done;
  e.completion_reported = timed;
  e.wait_start_ns = wait_start;
  e.wait_end_ns = wait_end;
  e.wait_lane = trace::thread_lane();
  trace::comm_event(std::move(e));
}

}  // namespace detail

bool comm_profile_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("SCALETRAIN_COMM_PROFILE");
    return !(v && std::string(v) == "0");
  }();
  return enabled;
}

std::vector<CommTotals> comm_profile() {
  ProfileTotals& t = totals();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<CommTotals> out;
  for (const auto& [key, c] : t.by_key) out.push_back(c);
  return out;
}

void reset_comm_profile() {
  ProfileTotals& t = totals();
  std::lock_guard<std::mutex> lock(t.mu);
  t.by_key.clear();
}

double bus_factor(const std::string& op, int n) {
  if (n <= 1) return 0;
  const double frac = static_cast<double>(n - 1) / n;
  if (op == "all_reduce") return 2 * frac;
  if (op == "reduce_scatter" || op == "all_gather" || op == "all_to_all" || op == "all_to_all_v" || op == "gather" ||
      op == "scatter")
    return frac;
  return 1;
}

}  // namespace scaletrain::comm

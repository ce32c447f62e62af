#pragma once
// Timed spans of a few chosen steps, for a Chrome trace (metrics.trace_steps).
//
// Note [Tracing]: every layer may mark what it does with a Span (forward of a
// unit, a pipeline action, the optimizer step, a checkpoint write), and comm's
// Group records each collective it waited on (comm_event()). Recording is
// off except while the trainer traces a step (set_on()); a Span then costs
// one relaxed atomic load, and names are string literals with an optional
// integer (a unit, a micro-batch), so nothing is built for a span that is not
// kept. While on, events go to one process-wide list under a mutex: a traced
// step makes hundreds of them, not millions.
//
// Times are this process's steady clock in nanoseconds. The trainer aligns
// the ranks' clocks through the store before the first traced step (Note
// [Trace clocks] in observe/tracing.cpp) and hands the offset to to_chrome_json().
//
// Threads: a thread that records is a lane of its own, named by
// name_thread() (the training loop names itself "compute") or "thread N".
// Collectives are drawn on lanes of their own ("comm 0", "comm 1", ...): a
// collective runs from its launch to its completion, which overlaps the
// compute that goes on meanwhile, and collectives in flight at the same time
// take different lanes, so no lane holds two overlapping spans.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::trace {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace detail {
extern std::atomic<bool> g_on;
}
// Whether events are recorded now.
inline bool on() { return detail::g_on.load(std::memory_order_relaxed); }
void set_on(bool on);

// A span of work on the calling thread. `cat` groups spans by kind (forward,
// backward, optimizer, data, checkpoint, step, pipeline); `name` is shown,
// followed by `index` when it is not negative ("forward unit 3").
struct SpanEvent {
  const char* cat = "";
  const char* name = "";
  int64_t index = -1;
  int64_t start_ns = 0, end_ns = 0;
  int lane = 0;  // the recording thread's lane (thread_lanes() names them)
};

// One collective that was waited on while recording was on.
struct CommEvent {
  std::string group;
  const char* op = "";
  int group_size = 0;
  uint64_t seq = 0;
  int64_t bytes = 0;                        // the collective's data size (comm::Group::payload_bytes)
  double bus_factor = 0;                    // bus bytes / bytes (nccl-tests' convention)
  int64_t launch_ns = 0, done_ns = 0;       // issued; completed (or waited, when not reported)
  bool completion_reported = true;          // false: the backend reports no completion
  int64_t wait_start_ns = 0, wait_end_ns = 0;  // the waiting thread blocked on it
  int wait_lane = 0;
};

class Span {
 public:
  Span(const char* cat, const char* name, int64_t index = -1) {
    if (!on()) return;
    e_.cat = cat;
    e_.name = name;
    e_.index = index;
    e_.start_ns = now_ns();
    live_ = true;
  }
  ~Span() { end(); }
  // Ends the span early (idempotent).
  void end();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  SpanEvent e_;
  bool live_ = false;
};

// Names the calling thread's lane (call once per thread, before it records).
void name_thread(const std::string& name);
// This thread's lane id (assigned on first use).
int thread_lane();
void comm_event(CommEvent e);
// A span measured by hand (one that starts in one callback and ends in
// another); recorded only while on.
void span(const char* cat, const char* name, int64_t index, int64_t start_ns, int64_t end_ns);

// Everything recorded so far, handed over and cleared.
struct Recording {
  std::vector<SpanEvent> spans;
  std::vector<CommEvent> comms;
  std::vector<std::string> lanes;  // lane id -> thread name
};
Recording take();

// The recording as a Chrome trace (the JSON object format with a
// "traceEvents" array, which chrome://tracing and Perfetto open): process
// `pid` named `process_name`, one thread per lane and per comm lane, every
// span a complete ("X") event whose ts is (time + offset_ns - origin_ns) in
// microseconds. Collective events carry op, group, seq, bytes, exposed wait
// and bus bandwidth in their args, and each wait is a span "wait <op>" on the
// thread that waited. Returns the "traceEvents" array's elements as JSON text
// (an array), so several ranks' arrays can be concatenated into one file.
std::string to_chrome_events(const Recording& r, int pid, const std::string& process_name, int64_t offset_ns,
                             int64_t origin_ns);

}  // namespace scaletrain::trace

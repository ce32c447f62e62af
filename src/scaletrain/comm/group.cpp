// The collectives API over c10d backends. See Note [Gloo 1.13 gaps] in group.h.
// Longer than 600 lines (issue 35): collectives, the scratch pool, the
// tracker and the communication profile; those are its seams.
#include "scaletrain/comm/group.h"

#include "scaletrain/comm/activity.h"
#include "scaletrain/util/trace.h"

#include <c10/util/Exception.h>
#if defined(SCALETRAIN_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <tuple>
#include <mutex>
#include <sstream>

namespace scaletrain::comm {

// --- Scratch buffers (Note [Scratch buffers] in group.h) ----------------------

namespace detail {

class ScratchPool : public std::enable_shared_from_this<ScratchPool> {
 public:
  // One checked-out buffer. `finish()` says the operation using it is over;
  // only then does destruction hand the buffer back to the pool.
  class Lease {
   public:
    Lease(std::weak_ptr<ScratchPool> pool, at::Tensor bytes, at::Tensor tensor)
        : pool_(std::move(pool)), bytes_(std::move(bytes)), tensor_(std::move(tensor)) {}
    ~Lease() {
      if (!finished_ || !bytes_.defined()) return;
      if (auto pool = pool_.lock()) pool->give_back(std::move(bytes_));
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    const at::Tensor& tensor() const { return tensor_; }
    void finish() { finished_ = true; }

   private:
    std::weak_ptr<ScratchPool> pool_;
    at::Tensor bytes_;   // the pooled storage (undefined when not pooled)
    at::Tensor tensor_;  // the caller's typed 1-D view of it
    bool finished_ = false;
  };
  using LeasePtr = std::shared_ptr<Lease>;

  // An uninitialised contiguous 1-D tensor of `numel` elements.
  LeasePtr take(int64_t numel, const at::TensorOptions& options) {
    if (options.device().type() != at::kCPU || numel == 0)  // host: the pool is host memory
      return std::make_shared<Lease>(weak_from_this(), at::Tensor(), at::empty({numel}, options));
    const int64_t nbytes = numel * static_cast<int64_t>(options.dtype().itemsize());
    at::Tensor bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Best fit among the free buffers; if none is large enough, the
      // largest one is replaced by a bigger one (the pool only grows).
      size_t best = free_.size(), largest = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        const int64_t cap = free_[i].numel();
        if (cap >= nbytes && (best == free_.size() || cap < free_[best].numel())) best = i;
        if (largest == free_.size() || cap > free_[largest].numel()) largest = i;
      }
      size_t pick = best != free_.size() ? best : largest;
      if (pick != free_.size()) {
        bytes = std::move(free_[pick]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(pick));
      }
      if (!bytes.defined() || bytes.numel() < nbytes) {
        if (bytes.defined()) held_ -= bytes.numel();
        bytes = at::Tensor();
        held_ += nbytes;
      }
    }
    if (!bytes.defined()) bytes = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte));
    at::Tensor typed = bytes.narrow(0, 0, nbytes).view(options.dtype().toScalarType());
    return std::make_shared<Lease>(weak_from_this(), std::move(bytes), std::move(typed));
  }

  int64_t held_bytes() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  void give_back(at::Tensor bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(bytes));
  }

  mutable std::mutex mu_;
  std::vector<at::Tensor> free_;  // 1-D uint8 CPU tensors not checked out
  int64_t held_ = 0;              // bytes of all pooled buffers, free or out
};

}  // namespace detail

namespace {

using detail::ScratchPool;

bool is_16bit_float(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The raw bytes of a contiguous tensor, as a 1-D uint8 tensor sharing storage.
at::Tensor bytes_of(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::Avg:
      return c10d::ReduceOp::AVG;
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

std::string first_line(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string s = ce ? ce->what_without_backtrace() : e.what();
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

void check_contiguous(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.is_contiguous(), "scaletrain ", op, ": tensors must be contiguous");
}

// Reduces the rows of `rows` ([n, k], any dtype) into `dst` (k contiguous
// elements), row 0 first. Same-dtype reductions run as one ATen reduction
// straight into `dst`; 16-bit floats (or a change of dtype) accumulate row by
// row in fp32, in a scratch buffer unless `dst` is itself fp32.
void reduce_rows_into(const at::Tensor& rows, ReduceOp op, at::Tensor dst, ScratchPool& pool) {
  const int64_t n = rows.size(0);
  const std::array<int64_t, 1> dim0{0};
  if (rows.scalar_type() == dst.scalar_type() && !is_16bit_float(rows.scalar_type())) {
    switch (op) {
      case ReduceOp::Sum:
        at::sum_out(dst, rows, dim0);
        return;
      case ReduceOp::Avg:
        at::sum_out(dst, rows, dim0).div_(n);
        return;
      case ReduceOp::Max:
        at::amax_out(dst, rows, dim0);
        return;
      case ReduceOp::Min:
        at::amin_out(dst, rows, dim0);
        return;
    }
  }
  const at::ScalarType acc_type = is_16bit_float(rows.scalar_type()) ? at::kFloat : rows.scalar_type();
  ScratchPool::LeasePtr lease;
  at::Tensor acc = dst;
  if (dst.scalar_type() != acc_type) {
    lease = pool.take(dst.numel(), dst.options().dtype(acc_type));
    acc = lease->tensor();
  }
  acc.copy_(rows[0]);
  for (int64_t i = 1; i < n; ++i) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc.add_(rows[i]);
        break;
      case ReduceOp::Max:
        at::maximum_out(acc, acc, rows[i]);
        break;
      case ReduceOp::Min:
        at::minimum_out(acc, acc, rows[i]);
        break;
    }
  }
  if (op == ReduceOp::Avg) acc.div_(n);
  if (lease) {
    dst.copy_(acc);
    lease->finish();
  }
}

// `full` flattened and zero-padded to `numel` elements, in a scratch buffer.
ScratchPool::LeasePtr padded_copy(ScratchPool& pool, const at::Tensor& full, int64_t numel) {
  auto lease = pool.take(numel, full.options());
  const at::Tensor& t = lease->tensor();
  t.narrow(0, 0, full.numel()).copy_(full.reshape({-1}));
  t.narrow(0, full.numel(), numel - full.numel()).zero_();
  return lease;
}

}  // namespace

// --- CollectiveTracker (Note [Which rank, which collective] in group.h) -----

namespace {

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string to_string(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// "" when every rank called the same collective; else the message naming the
// ranks that differ from the majority (ties go to group rank 0's side).
std::string compare_fingerprints(const std::string& group, uint64_t seq, const std::vector<int>& ranks,
                                 const std::vector<std::string>& fps) {
  std::map<std::string, int> count;
  for (const auto& f : fps) ++count[f];
  std::string major = fps[0];
  for (const auto& [f, c] : count)
    if (c > count[major]) major = f;
  std::ostringstream m;
  int odd = 0;
  for (size_t r = 0; r < fps.size(); ++r) {
    if (fps[r] == major) continue;
    m << (odd++ ? "; " : "") << "rank " << ranks[r] << " (group rank " << r << ") called " << fps[r];
  }
  if (odd == 0) return "";
  std::ostringstream out;
  out << "collective mismatch on group '" << group << "' at seq " << seq << ": " << m.str() << "; ";
  if (fps.size() == 2)
    out << "rank " << ranks[fps[0] == major ? 0 : 1] << " called " << major;
  else
    out << "the other " << fps.size() - static_cast<size_t>(odd) << " ranks called " << major;
  return out.str();
}

struct Record {
  bool answered = false;
  uint64_t started = 0, finished = 0, waiting = 0;  // seq + 1 (0: none)
  std::string started_op, finished_op;
  double seconds = 0;  // in the current state (waiting, or computing since the last finish)
};

// Parses record()'s line: "started op finished op waiting seconds", tab-separated.
Record parse_record(const std::string& line) {
  Record r;
  std::vector<std::string> f;
  std::stringstream ss(line);
  for (std::string x; std::getline(ss, x, '\t');) f.push_back(x);
  if (f.size() != 6) return r;
  try {
    r.started = std::stoull(f[0]);
    r.started_op = f[1];
    r.finished = std::stoull(f[2]);
    r.finished_op = f[3];
    r.waiting = std::stoull(f[4]);
    r.seconds = std::stod(f[5]);
    r.answered = true;
  } catch (const std::exception&) {
    r.answered = false;
  }
  return r;
}

std::string seq_text(uint64_t s, const std::string& op) {
  return s == 0 ? std::string("none") : "seq " + std::to_string(s - 1) + " " + op;
}

}  // namespace

CollectiveTracker::CollectiveTracker(Options options) : o_(std::move(options)) {}

void CollectiveTracker::launching(uint64_t seq, const std::string& op, const std::string& fingerprint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = seq + 1;
    started_op_ = op;
  }
  if (o_.ranks.size() < 2) return;
  if (!o_.fingerprint_store) return check_first_of_kind(seq, op, fingerprint);
  c10d::Store& st = *o_.fingerprint_store;
  const std::string base = "fp/" + std::to_string(seq) + "/";
  std::string verdict;
  try {
    st.set(base + std::to_string(o_.rank), to_bytes(fingerprint));
    if (o_.rank == 0) {
      std::vector<std::string> fps(o_.ranks.size());
      fps[0] = fingerprint;
      for (size_t r = 1; r < fps.size(); ++r) fps[r] = to_string(st.get(base + std::to_string(r)));
      verdict = compare_fingerprints(o_.group, seq, o_.ranks, fps);
      st.set(base + "v", to_bytes("=" + verdict));
      // Every rank has read seq - 2's verdict before it set seq - 1's key,
      // which rank 0 has just read: those keys are no longer needed.
      if (seq >= 2) {
        const std::string old = "fp/" + std::to_string(seq - 2) + "/";
        for (size_t r = 0; r < fps.size(); ++r) st.deleteKey(old + std::to_string(r));
        st.deleteKey(old + "v");
      }
    } else {
      verdict = to_string(st.get(base + "v")).substr(1);
    }
  } catch (const std::exception& e) {
    throw CommError(explain("fingerprint check of " + op + " on group '" + o_.group + "' (seq " + std::to_string(seq) +
                            ") failed: " + first_line(e)));
  }
  if (!verdict.empty()) throw CommError(verdict);
}

// Note [First-of-kind check] (group.h).
void CollectiveTracker::check_first_of_kind(uint64_t seq, const std::string& op, const std::string& fingerprint) {
  constexpr size_t kMaxKinds = 4096;  // beyond this, new kinds go unchecked
  if (!o_.first_store) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.size() >= kMaxKinds || !seen_.insert(fingerprint).second) return;
  }
  c10d::Store& st = *o_.first_store;
  const std::string base = std::to_string(seq) + "/";
  std::vector<std::string> fps(o_.ranks.size());
  fps[static_cast<size_t>(o_.rank)] = fingerprint;
  size_t r = 0;
  try {
    st.set(base + std::to_string(o_.rank), to_bytes(fingerprint));
    for (r = 0; r < fps.size(); ++r)
      if (static_cast<int>(r) != o_.rank) fps[r] = to_string(st.get(base + std::to_string(r)));
  } catch (const std::exception& e) {
    throw CommError(explain("first " + fingerprint + " on group '" + o_.group + "' (seq " + std::to_string(seq) +
                            "): rank " + std::to_string(o_.ranks[r]) +
                            " did not compare its collective of this seq (it had called its kind before and this rank "
                            "had not, so the ranks called different collectives, or it never came): " +
                            first_line(e)));
  }
  const std::string verdict = compare_fingerprints(o_.group, seq, o_.ranks, fps);
  if (!verdict.empty()) throw CommError(verdict);
}

void CollectiveTracker::finished(uint64_t seq, const std::string& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (seq + 1 > finished_) {
    finished_ = seq + 1;
    finished_op_ = op;
  }
  since_ = Clock::now();
}

void CollectiveTracker::waiting(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_on_ = seq + 1;
  since_ = Clock::now();
}

void CollectiveTracker::done_waiting() {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_on_ = 0;
  since_ = Clock::now();
}

std::string CollectiveTracker::record() const {
  std::lock_guard<std::mutex> lock(mu_);
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", std::chrono::duration<double>(Clock::now() - since_).count());
  return std::to_string(started_) + "\t" + started_op_ + "\t" + std::to_string(finished_) + "\t" + finished_op_ +
         "\t" + std::to_string(waiting_on_) + "\t" + secs;
}

std::string CollectiveTracker::explain(const std::string& what) const {
  if (!o_.ask || o_.ranks.size() < 2) return what;
  const std::string mine = record();  // before the others are asked (which takes time)
  std::vector<std::string> answers;
  std::string store_silent;  // the store did not answer: its host is the culprit
  try {
    answers = o_.ask(o_.group, o_.ranks);
  } catch (const StoreSilent& e) {
    store_silent = e.what();
  } catch (const std::exception&) {
    answers.clear();
  }
  answers.resize(o_.ranks.size());
  answers[static_cast<size_t>(o_.rank)] = mine;
  std::vector<Record> recs;
  for (const auto& a : answers) recs.push_back(parse_record(a));
  std::ostringstream t;
  t << what << "\n  ranks of group '" << o_.group << "' (collectives by sequence number):";
  char line[512];
  std::snprintf(line, sizeof line, "\n  %-6s %-26s %-26s %s", "rank", "last started", "last finished", "now");
  t << line;
  int culprit = -1;
  std::string why;
  uint64_t most = 0;
  for (const auto& r : recs)
    if (r.answered) most = std::max(most, r.started);
  for (size_t i = 0; i < recs.size(); ++i) {
    const Record& r = recs[i];
    std::string now;
    if (!r.answered) {
      now = "no answer (exited, stopped, or stuck where it cannot answer)";
    } else if (r.waiting) {
      char b[96];
      std::snprintf(b, sizeof b, "waiting on seq %llu for %.1f s", static_cast<unsigned long long>(r.waiting - 1),
                    r.seconds);
      now = b;
    } else {
      char b[96];
      std::snprintf(b, sizeof b, "not in a collective for %.1f s", r.seconds);
      now = b;
    }
    std::snprintf(line, sizeof line, "\n  %-6d %-26s %-26s %s", o_.ranks[i], seq_text(r.started, r.started_op).c_str(),
                  seq_text(r.finished, r.finished_op).c_str(), now.c_str());
    t << line;
  }
  // The culprit: a member that did not answer, else the one furthest behind.
  for (size_t i = 0; i < recs.size() && culprit < 0; ++i)
    if (!recs[i].answered) {
      culprit = static_cast<int>(i);
      why = "did not answer (exited, stopped, or stuck where it cannot answer)";
    }
  if (culprit < 0) {
    uint64_t least = most;
    for (size_t i = 0; i < recs.size(); ++i)
      if (recs[i].started < least) {
        least = recs[i].started;
        culprit = static_cast<int>(i);
      }
    if (culprit >= 0)
      why = "is behind: it has not started seq " + std::to_string(most - 1) + " (last started: " +
            seq_text(recs[static_cast<size_t>(culprit)].started, recs[static_cast<size_t>(culprit)].started_op) + ")";
  }
  if (!store_silent.empty())
    t << "\nculprit: rank 0 (it serves the store, which did not answer the diagnosis either: " << store_silent
      << ")";
  else if (culprit >= 0)
    t << "\nculprit: rank " << o_.ranks[static_cast<size_t>(culprit)] << " " << why;
  else
    t << "\nno rank is behind: every rank started seq " << (most == 0 ? 0 : most - 1)
      << " (the transport itself failed or stalled)";
  return t.str();
}

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

// Counts a collective whose backend work has completed; `wait_*`: the
// waiting thread's blocked interval.
void count_collective(const detail::CommProfile& p, int64_t wait_start, int64_t wait_end) {
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

}  // namespace

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

// --- Work -------------------------------------------------------------------

namespace {
std::atomic<int> g_waiting{0};  // see activity.h
struct WaitingScope {
  WaitingScope() { ++g_waiting; }
  ~WaitingScope() { --g_waiting; }
  WaitingScope(const WaitingScope&) = delete;
  WaitingScope& operator=(const WaitingScope&) = delete;
};
}  // namespace

int collectives_waiting() { return g_waiting.load(); }

void Work::wait() {
  WaitingScope waiting;
  std::shared_ptr<CollectiveTracker> tracker = std::move(tracker_);
  tracker_ = nullptr;
  std::shared_ptr<detail::CommProfile> profile = std::move(profile_);
  profile_ = nullptr;
  if (tracker && !pending_.empty()) tracker->waiting(seq_);
  try {
    const int64_t wait_start = profile && !pending_.empty() ? trace::now_ns() : 0;
    for (auto& w : pending_) timeout_.count() > 0 ? w->wait(timeout_) : w->wait();
    if (wait_start) count_collective(*profile, wait_start, trace::now_ns());
    pending_.clear();
    if (then_) {
      auto then = std::move(then_);
      then_ = nullptr;
      Work next = then();
      next.wait();
    }
  } catch (const CommError&) {
    if (tracker) tracker->done_waiting();
    throw;
  } catch (const std::exception& e) {
    pending_.clear();
    then_ = nullptr;
    const std::string what = label_ + " failed: " + first_line(e);
    if (!tracker) throw CommError(what);
    std::string table = tracker->explain(what);
    tracker->done_waiting();
    throw CommError(table);
  }
  if (tracker) {
    tracker->finished(seq_, op_);
    tracker->done_waiting();
  }
}

void Work::and_then(std::function<Work()> next) {
  if (!then_) {
    then_ = std::move(next);
    return;
  }
  then_ = [first = std::move(then_), next = std::move(next)]() {
    first().wait();
    return next();
  };
}

// --- Group ------------------------------------------------------------------

Group::Group(std::string name, std::vector<int> ranks, int rank, BackendKind kind, compat::BackendPtr backend,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      rank_(rank),
      kind_(kind),
      backend_(std::move(backend)),
      timeout_(timeout),
      scratch_(std::make_shared<ScratchPool>()) {}

int64_t Group::scratch_bytes() const { return scratch_->held_bytes(); }

std::string Group::label(const char* op, uint64_t seq) const {
  std::ostringstream s;
  s << op << " on group '" << name_ << "' (size " << size() << ", rank " << rank_ << ", "
    << (point_to_point(op) ? "p2p seq " : "seq ") << seq << ")";
  return s.str();
}

bool Group::point_to_point(const char* op) { return std::strcmp(op, "send") == 0 || std::strcmp(op, "recv") == 0; }

namespace {
// The fingerprint describe() noted for the next launch on this thread.
thread_local std::string t_described;
const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}
}  // namespace

void Group::describe(const char* op, std::initializer_list<at::Tensor> tensors, const std::string& extra) {
  if (!tracker_) return;
  std::ostringstream s;
  s << op << "(";
  const char* sep = "";
  for (const auto& t : tensors) {
    s << sep << c10::toString(t.scalar_type()) << t.sizes();
    sep = ", ";
  }
  if (!extra.empty()) s << sep << extra;
  s << ")";
  t_described = s.str();
}

void Group::launching(const char* op) {
  std::string fp = std::move(t_described);
  t_described.clear();
  if (!tracker_ || point_to_point(op)) return;
  try {
    tracker_->launching(seq_.load(), op, fp.empty() ? std::string(op) : fp);
  } catch (const CommError&) {
    // The refused collective still uses up its sequence number (on every
    // rank, as each saw the mismatch), so the next one's store keys are fresh.
    ++seq_;
    throw;
  }
}

Work Group::start(const char* op, std::vector<compat::WorkPtr> ws, int64_t bytes, const char* moved_as) {
  Work w;
  const bool p2p = point_to_point(op);
  const uint64_t seq = p2p ? p2p_seq_++ : seq_++;
  if (!ws.empty() && comm_profile_enabled()) {  // Note [Communication profile]
    auto p = std::make_shared<detail::CommProfile>();
    p->op = moved_as ? moved_as : op;
    p->group = name_;
    p->size = size();
    p->seq = seq;
    p->bytes = bytes;
    p->launch_ns = trace::now_ns();
    // Gloo completes a collective's future on its worker thread when the
    // data has arrived; NCCL's future completes at launch (the device work is
    // only enqueued), so NCCL calls, like Gloo's send and recv (no future),
    // go untimed.
    if (gloo()) {
      for (auto& work : ws) {
        try {
          std::weak_ptr<detail::CommProfile> weak = p;
          work->getFuture()->addCallback([weak](c10::ivalue::Future&) {
            if (auto q = weak.lock()) q->done_ns.store(trace::now_ns());
          });
          p->completion_reported = true;
        } catch (const std::exception&) {  // send/recv works have no future
        }
      }
    }
    w.profile_ = std::move(p);
  }
  w.label_ = label(op, seq);
  // NCCL's wait with a timeout polls on the host until the kernel is done
  // (no overlap); its watchdog enforces the group's timeout instead. Zero
  // means a plain wait().
  w.timeout_ = gloo() ? timeout_ : std::chrono::milliseconds(0);
  w.pending_ = std::move(ws);
  if (!p2p && tracker_) {
    w.tracker_ = tracker_;
    w.seq_ = seq;
    w.op_ = op;
  }
  return w;
}

Work Group::start(const char* op, compat::WorkPtr w, int64_t bytes, const char* moved_as) {
  std::vector<compat::WorkPtr> ws;
  if (w) ws.push_back(std::move(w));
  return start(op, std::move(ws), bytes, moved_as);
}

// Launching can throw too (a closed connection is noticed on send): wrap it.
#define ST_LAUNCH(op, expr)                                                                                \
  [&]() -> compat::WorkPtr {                                                                               \
    launching(op);                                                                                         \
    try {                                                                                                  \
      return expr;                                                                                         \
    } catch (const std::exception& e) {                                                                    \
      throw CommError(label(op, (point_to_point(op) ? p2p_seq_ : seq_).load()) + " failed to start: " + \
                      first_line(e));                                                                      \
    }                                                                                                      \
  }()

// Note [Staged tensors]: NCCL moves device memory only, and Gloo as used here
// (byte views, reduce_scatter through all_to_all, send/recv) host memory
// only. A tensor on the other side (a host scalar sum or shape list on a GPU
// run, an offloaded shard's norm; a device tensor forced onto Gloo) is copied
// to where the backend works, moved, and, if the collective writes it, copied
// back when the Work is waited. CPU runs on Gloo never stage.
bool Group::foreign(const at::Tensor& t) const { return gloo() ? !t.device().is_cpu() : !t.is_cuda(); }

Work Group::staged(const std::vector<at::Tensor>& tensors, const std::vector<bool>& outputs,
                   const std::function<Work(const std::vector<at::Tensor>&)>& run) {
  std::vector<at::Tensor> moved;
  for (const at::Tensor& t : tensors) {
    if (!foreign(t))
      moved.push_back(t);
    else if (gloo())
      moved.push_back(t.to(at::Device(at::DeviceType::CPU)));  // host: Gloo's side
    else
      moved.push_back(t.to(at::Device(at::DeviceType::CUDA)));  // the current device (train/device.h use_device)
  }
  Work w = run(moved);
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (outputs[i] && !moved[i].is_same(tensors[i])) back.emplace_back(tensors[i], moved[i]);
  if (!back.empty())
    w.and_then([back]() {
      at::NoGradGuard no_grad;
      for (const auto& [original, copy] : back) original.copy_(copy);
      return Work();
    });
  return w;
}

Work Group::broadcast(at::Tensor tensor, int root) {
  check_contiguous(tensor, "broadcast");
  if (foreign(tensor)) return staged({tensor}, {true}, [&](const auto& t) { return broadcast(t[0], root); });
  if (size() == 1) return start("broadcast", compat::WorkPtr());
  describe("broadcast", {tensor}, "root " + std::to_string(root));
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("broadcast", ST_LAUNCH("broadcast", backend_->broadcast(ts, o)), tensor.nbytes());
}

Work Group::all_reduce(at::Tensor tensor, ReduceOp op) {
  check_contiguous(tensor, "all_reduce");
  if (foreign(tensor)) return staged({tensor}, {true}, [&](const auto& t) { return all_reduce(t[0], op); });
  if (size() == 1) return start("all_reduce", compat::WorkPtr());
  describe("all_reduce", {tensor}, reduce_name(op));
  if (gloo() && is_16bit_float(tensor.scalar_type())) {
    // Two stages: reduce_scatter (fp32 sum) then all_gather of the shards.
    // The second stage is issued when this Work is waited on; like every
    // launch, waits happen in the same order on all ranks (SPMD), so the
    // ranks' operation sequences still match.
    // The shard is scratch, checked out until the all_gather has completed.
    auto shard_lease = scratch_->take(shard_numel(tensor.numel()), tensor.options());
    at::Tensor shard = shard_lease->tensor();
    Work rs = reduce_scatter_by_all_to_all(tensor, shard, op, "all_reduce");
    auto reduce_then = std::move(rs.then_);
    rs.then_ = [this, shard, tensor, reduce_then, shard_lease]() {
      reduce_then().wait();
      Work ag = all_gather(shard, tensor);
      auto gather_then = std::move(ag.then_);
      ag.then_ = [gather_then, shard_lease]() {
        if (gather_then) gather_then().wait();
        shard_lease->finish();
        return Work();
      };
      return ag;
    };
    return rs;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.timeout = timeout_;
  bool local_avg = gloo() && op == ReduceOp::Avg;
  o.reduceOp = local_avg ? c10d::ReduceOp(c10d::ReduceOp::SUM) : to_c10d(op);
  Work w = start("all_reduce", ST_LAUNCH("all_reduce", backend_->allreduce(ts, o)), tensor.nbytes());
  if (local_avg) {
    int n = size();
    w.then_ = [tensor, n]() mutable {
      tensor.div_(n);
      return Work();
    };
  }
  return w;
}

Work Group::reduce_scatter_by_all_to_all(at::Tensor full, at::Tensor shard, ReduceOp op, const char* op_name) {
  const int n = size();
  const int64_t k = shard_numel(full.numel());
  TORCH_CHECK(shard.numel() == k, "scaletrain ", op_name, ": shard has ", shard.numel(), " elements, expected ceil(",
              full.numel(), "/", n, ") = ", k);
  // See Note [Scratch buffers]: the padded input and the receive buffer are
  // checked out of the pool, and the received rows are reduced straight into
  // `shard`.
  ScratchPool::LeasePtr in_lease;
  at::Tensor in = full.reshape({-1});
  if (in.numel() != n * k) {
    in_lease = padded_copy(*scratch_, full, n * k);
    in = in_lease->tensor();
  }
  ScratchPool::LeasePtr out_lease = scratch_->take(n * k, full.options());
  at::Tensor out_bytes = bytes_of(out_lease->tensor()), in_bytes = bytes_of(in);
  std::vector<int64_t> equal_splits;  // empty = equal splits
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  Work w =
      start(op_name, ST_LAUNCH(op_name, backend_->alltoall_base(out_bytes, in_bytes, equal_splits, equal_splits, o)),
            full.nbytes(), "reduce_scatter");
  std::shared_ptr<ScratchPool> pool = scratch_;
  w.then_ = [pool, out_lease, in_lease, shard, n, k, op]() {
    reduce_rows_into(out_lease->tensor().view({n, k}), op, shard.reshape({-1}), *pool);
    out_lease->finish();
    if (in_lease) in_lease->finish();
    return Work();
  };
  return w;
}

Work Group::reduce_scatter(at::Tensor full, at::Tensor shard, ReduceOp op) {
  check_contiguous(full, "reduce_scatter");
  check_contiguous(shard, "reduce_scatter");
  if (foreign(full) || foreign(shard))
    return staged({full, shard}, {false, true}, [&](const auto& t) { return reduce_scatter(t[0], t[1], op); });
  if (size() == 1) {
    TORCH_CHECK(shard.numel() == full.numel(), "scaletrain reduce_scatter: shard size mismatch");
    shard.reshape({-1}).copy_(full.reshape({-1}));
    return start("reduce_scatter", compat::WorkPtr());
  }
  describe("reduce_scatter", {full, shard}, reduce_name(op));
  if (gloo()) return reduce_scatter_by_all_to_all(full, shard, op, "reduce_scatter");
  // NCCL has a native flat reduce-scatter; pad the input to size() chunks.
  const int64_t k = shard_numel(full.numel());
  ScratchPool::LeasePtr in_lease;
  at::Tensor in = full.reshape({-1});
  if (in.numel() != size() * k) {
    in_lease = padded_copy(*scratch_, full, size() * k);
    in = in_lease->tensor();
  }
  at::Tensor out = shard.reshape({-1});
  c10d::ReduceScatterOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = timeout_;
  Work w = start("reduce_scatter", ST_LAUNCH("reduce_scatter", backend_->_reduce_scatter_base(out, in, o)), full.nbytes());
  if (in_lease) {
    w.then_ = [in_lease]() {  // keeps the padded input checked out until done
      in_lease->finish();
      return Work();
    };
  }
  return w;
}

Work Group::all_gather(at::Tensor shard, at::Tensor full) {
  check_contiguous(shard, "all_gather");
  check_contiguous(full, "all_gather");
  if (foreign(shard) || foreign(full))
    return staged({shard, full}, {false, true}, [&](const auto& t) { return all_gather(t[0], t[1]); });
  const int n = size();
  const int64_t k = shard.numel();
  TORCH_CHECK(shard_numel(full.numel()) == k, "scaletrain all_gather: output of ", full.numel(),
              " elements does not match ", n, " shards of ", k);
  if (n == 1) {
    full.reshape({-1}).copy_(shard.reshape({-1}));
    return start("all_gather", compat::WorkPtr());
  }
  describe("all_gather", {shard, full});
  // Gather straight into `full` when it holds exactly n shards, else into a
  // padded buffer whose padding is dropped afterwards.
  const bool exact = full.numel() == n * k;
  ScratchPool::LeasePtr dst_lease = exact ? nullptr : scratch_->take(n * k, full.options());
  at::Tensor dst = exact ? full.reshape({-1}) : dst_lease->tensor();
  c10d::AllgatherOptions o;
  o.timeout = timeout_;
  Work w;
  if (gloo()) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int i = 0; i < n; ++i) outs[0].push_back(bytes_of(dst.narrow(0, i * k, k)));
    std::vector<at::Tensor> ins{bytes_of(shard)};
    w = start("all_gather", ST_LAUNCH("all_gather", backend_->allgather(outs, ins, o)), full.nbytes());
  } else {
    at::Tensor in = shard.reshape({-1});
    w = start("all_gather", ST_LAUNCH("all_gather", backend_->_allgather_base(dst, in, o)), full.nbytes());
  }
  if (!exact) {
    w.then_ = [dst_lease, full]() {
      full.reshape({-1}).copy_(dst_lease->tensor().narrow(0, 0, full.numel()));
      dst_lease->finish();
      return Work();
    };
  }
  return w;
}

Work Group::all_to_all(at::Tensor input, at::Tensor output) {
  check_contiguous(input, "all_to_all");
  check_contiguous(output, "all_to_all");
  if (foreign(input) || foreign(output))
    return staged({input, output}, {false, true}, [&](const auto& t) { return all_to_all(t[0], t[1]); });
  TORCH_CHECK(input.numel() == output.numel() && input.numel() % size() == 0,
              "scaletrain all_to_all: input and output must have equal sizes divisible by the group size");
  if (size() == 1) {
    output.copy_(input);
    return start("all_to_all", compat::WorkPtr());
  }
  describe("all_to_all", {input, output});
  at::Tensor out = bytes_of(output), in = bytes_of(input);
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  return start("all_to_all", ST_LAUNCH("all_to_all", backend_->alltoall_base(out, in, equal_splits, equal_splits, o)),
               input.nbytes());
}

Work Group::all_to_all_v(at::Tensor input, at::Tensor output, const std::vector<int64_t>& in_rows,
                         const std::vector<int64_t>& out_rows) {
  check_contiguous(input, "all_to_all_v");
  check_contiguous(output, "all_to_all_v");
  if (foreign(input) || foreign(output))
    return staged({input, output}, {false, true},
                  [&](const auto& t) { return all_to_all_v(t[0], t[1], in_rows, out_rows); });
  const auto n = static_cast<size_t>(size());
  TORCH_CHECK(in_rows.size() == n && out_rows.size() == n, "scaletrain all_to_all_v: one split per rank expected");
  int64_t in_total = 0, out_total = 0;
  for (size_t j = 0; j < n; ++j) {
    TORCH_CHECK(in_rows[j] >= 0 && out_rows[j] >= 0, "scaletrain all_to_all_v: negative split");
    in_total += in_rows[j];
    out_total += out_rows[j];
  }
  TORCH_CHECK(input.dim() >= 1 && output.dim() >= 1 && input.size(0) == in_total && output.size(0) == out_total &&
                  input.sizes().slice(1) == output.sizes().slice(1) && input.scalar_type() == output.scalar_type(),
              "scaletrain all_to_all_v: ", input.sizes(), " -> ", output.sizes(), " does not match the splits");
  if (size() == 1) {
    output.copy_(input);
    return start("all_to_all_v", compat::WorkPtr());
  }
  {
    // Row counts differ by rank (that is the point of the op): the
    // fingerprint holds what all ranks share, the dtype and a row's shape.
    std::ostringstream row;
    row << c10::toString(input.scalar_type()) << "[rows";
    for (int64_t d = 1; d < input.dim(); ++d) row << ", " << input.size(d);
    row << "]";
    describe("all_to_all_v", {}, row.str());
  }
  int64_t row_bytes = static_cast<int64_t>(input.element_size());
  for (int64_t d = 1; d < input.dim(); ++d) row_bytes *= input.size(d);
  std::vector<int64_t> in_bytes, out_bytes;
  for (size_t j = 0; j < n; ++j) {
    in_bytes.push_back(in_rows[j] * row_bytes);
    out_bytes.push_back(out_rows[j] * row_bytes);
  }
  at::Tensor out = bytes_of(output), in = bytes_of(input);
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  return start("all_to_all_v", ST_LAUNCH("all_to_all_v", backend_->alltoall_base(out, in, out_bytes, in_bytes, o)),
               input.nbytes());
}

Work Group::reduce(at::Tensor tensor, int root, ReduceOp op) {
  check_contiguous(tensor, "reduce");
  if (foreign(tensor)) return staged({tensor}, {true}, [&](const auto& t) { return reduce(t[0], root, op); });
  if (size() == 1) return start("reduce", compat::WorkPtr());
  describe("reduce", {tensor}, std::string(reduce_name(op)) + ", root " + std::to_string(root));
  if (gloo() && (is_16bit_float(tensor.scalar_type()) || op == ReduceOp::Avg)) {
    // Gather the raw payloads at the root (into the rows of one scratch
    // buffer) and reduce there in fp32.
    ScratchPool::LeasePtr rows_lease;
    std::vector<at::Tensor> outs;
    const int n = size();
    const int64_t numel = tensor.numel();
    if (rank_ == root) {
      rows_lease = scratch_->take(n * numel, tensor.options());
      for (int i = 0; i < n; ++i) outs.push_back(rows_lease->tensor().narrow(0, i * numel, numel).view(tensor.sizes()));
    }
    Work w = gather(tensor, outs, root);
    if (rank_ == root) {
      std::shared_ptr<ScratchPool> pool = scratch_;
      w.then_ = [pool, rows_lease, tensor, n, numel, op]() {
        reduce_rows_into(rows_lease->tensor().view({n, numel}), op, tensor.reshape({-1}), *pool);
        rows_lease->finish();
        return Work();
      };
    }
    return w;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::ReduceOptions o;
  o.rootRank = root;
  o.reduceOp = to_c10d(op);
  o.timeout = timeout_;
  return start("reduce", ST_LAUNCH("reduce", backend_->reduce(ts, o)), tensor.nbytes());
}

Work Group::gather(at::Tensor input, std::vector<at::Tensor> outputs, int root) {
  check_contiguous(input, "gather");
  if (rank_ == root) {
    TORCH_CHECK(static_cast<int>(outputs.size()) == size(), "scaletrain gather: root needs ", size(), " outputs");
    for (auto& t : outputs) check_contiguous(t, "gather");
  }
  if (size() == 1) {
    outputs[0].copy_(input);
    return start("gather", compat::WorkPtr());
  }
  describe("gather", {input}, "root " + std::to_string(root));
  std::vector<std::vector<at::Tensor>> outs;
  if (rank_ == root) {
    outs.emplace_back();
    for (auto& t : outputs) outs[0].push_back(gloo() ? bytes_of(t) : t);
  }
  std::vector<at::Tensor> ins{gloo() ? bytes_of(input) : input};
  c10d::GatherOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("gather", ST_LAUNCH("gather", backend_->gather(outs, ins, o)), input.nbytes() * size());
}

Work Group::scatter(std::vector<at::Tensor> inputs, at::Tensor output, int root) {
  check_contiguous(output, "scatter");
  if (rank_ == root)
    TORCH_CHECK(static_cast<int>(inputs.size()) == size(), "scaletrain scatter: root needs ", size(), " inputs");
  if (size() == 1) {
    output.copy_(inputs[0]);
    return start("scatter", compat::WorkPtr());
  }
  describe("scatter", {output}, "root " + std::to_string(root));
  std::vector<std::vector<at::Tensor>> ins;
  if (rank_ == root) {
    ins.emplace_back();
    for (auto& t : inputs) ins[0].push_back(gloo() ? bytes_of(t.contiguous()) : t.contiguous());
  }
  std::vector<at::Tensor> outs{gloo() ? bytes_of(output) : output};
  c10d::ScatterOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("scatter", ST_LAUNCH("scatter", backend_->scatter(outs, ins, o)), output.nbytes() * size());
}

Work Group::send(at::Tensor tensor, int dst, int tag) {
  check_contiguous(tensor, "send");
  if (foreign(tensor)) return staged({tensor}, {false}, [&](const auto& t) { return send(t[0], dst, tag); });
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  return start("send", ST_LAUNCH("send", backend_->send(ts, dst, tag)), tensor.nbytes());
}

Work Group::recv(at::Tensor tensor, int src, int tag) {
  check_contiguous(tensor, "recv");
  if (foreign(tensor)) return staged({tensor}, {true}, [&](const auto& t) { return recv(t[0], src, tag); });
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  return start("recv", ST_LAUNCH("recv", backend_->recv(ts, src, tag)), tensor.nbytes());
}

Work Group::barrier() {
  if (size() == 1) return start("barrier", compat::WorkPtr());
  c10d::BarrierOptions o;
  o.timeout = timeout_;
#if defined(SCALETRAIN_WITH_CUDA)
  // NCCL's barrier otherwise guesses the GPU (group rank modulo the count).
  if (!gloo()) o.device_ids = {static_cast<int64_t>(c10::cuda::current_device())};
#endif
  return start("barrier", ST_LAUNCH("barrier", backend_->barrier(o)));
}

#undef ST_LAUNCH

}  // namespace scaletrain::comm

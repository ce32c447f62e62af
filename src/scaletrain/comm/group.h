#pragma once
// A process group and the one collectives API every strategy uses.
//
// Every collective returns a Work handle: call wait() for the synchronous form,
// or keep the handle and wait later to overlap communication with compute.
// Errors (a timeout, a peer that vanished) surface from wait() as CommError,
// naming the operation, the group and the operation's sequence number.
//
// Flat-tensor convention shared by reduce_scatter and all_gather: a flat tensor
// of N elements is split into `size()` chunks of shard_numel(N) = ceil(N/size)
// elements, the last ones padded. reduce_scatter(full, shard) leaves rank r
// with the reduction of chunk r; all_gather(shard, full) is its inverse and
// drops the padding. Uneven sizes are padded, never rejected.
//
// Note [Gloo 1.13 gaps]: ProcessGroupGloo has no reduce_scatter and no
// _allgather_base, does not support AVG, and refuses 16-bit float arithmetic.
// So on Gloo: reduce_scatter = all_to_all of chunks + a local sum (each rank
// sends and receives (n-1)/n of the data, the ring optimum); AVG = SUM then a
// local division; bf16/fp16 reductions move their 16-bit payloads as bytes and
// are summed locally in fp32; an all-reduce of such a tensor is that
// reduce_scatter followed by an all_gather. Pure data movement (broadcast,
// all_gather, all_to_all, gather, scatter, send/recv) moves any dtype as bytes.
//
// Note [Scratch buffers]: the Gloo reduce_scatter needs a receive buffer of the
// full size, and uneven sizes need padded copies. Allocating them per call
// costs more than the transfer itself for large tensors: a fresh buffer of
// many MiB comes from mmap, and every page faults on first touch (measured: a
// 64 MiB reduce_scatter on 2 ranks reached half the bus bandwidth of the raw
// all_to_all). So each Group keeps a grow-only pool of CPU byte buffers. An
// operation checks a buffer out for its whole life and returns it when its
// local post-processing (the Work's `then_`) has finished; an operation that
// fails or is dropped unwaited never returns its buffer (the backend may still
// be writing into it), it is simply freed. The pool is thread-safe, so Works
// may be waited on from any thread and many may be in flight: each holds its
// own buffers. It holds at most as many buffers as were ever checked out at
// once, each as large as the largest request it served. CUDA tensors bypass
// it: the caching allocator already reuses device memory, stream-aware.
#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <set>
#include <string>
#include <vector>

#include "scaletrain/comm/compat.h"

namespace c10d {
class Store;
}

namespace scaletrain::comm {

enum class ReduceOp { Sum, Avg, Max, Min };

// A failed or timed-out collective.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& what) : std::runtime_error(what) {}
};

class CollectiveTracker;  // below: Note [Which rank, which collective]

// Note [Communication profile]: every collective that moves data (a group of
// more than one rank) is counted when it is waited on, per (op, group):
// calls, bytes, the time from launch to completion, and the time the waiting
// thread was blocked on it (exposed: what overlap did not hide). Bytes are
// the collective's data size as nccl-tests count it (the tensor for
// all_reduce and broadcast, the whole input of reduce_scatter, the whole
// output of all_gather, this rank's input of all_to_all); bus bytes are bytes
// times the op's factor (2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter,
// all_gather and all_to_all, 1 for the rest), so bus bytes over time is the
// bus bandwidth, comparable across group sizes. Completion is the backend's
// (Gloo's future); a call whose backend reports none (Gloo's send and recv,
// NCCL) has no time and no bandwidth, only its exposed wait. Time runs
// from launch, so a collective queued behind others on its group counts its
// queueing too: busbw here is what the run achieved, not what the link can.
// A 16-bit all_reduce on Gloo (Note [Gloo 1.13 gaps]) counts as what moved:
// a reduce_scatter and an all_gather. The same events feed the trace
// (util/trace.h) while a step is traced. Counting costs two clock reads and a
// map update per collective; the trainer resets the counts after setup.
struct CommTotals {
  std::string op, group;
  int group_size = 0;
  int64_t count = 0;
  int64_t bytes = 0;
  double bus_bytes = 0;
  double exposed_seconds = 0;  // blocked in wait(), summed
  // Launch to completion, summed over the calls whose completion the backend
  // reported (`timed` of them; Gloo's send and recv report none), and their bus bytes.
  int64_t timed = 0;
  double seconds = 0;
  double timed_bus_bytes = 0;
};
// SCALETRAIN_COMM_PROFILE=0 in the environment turns counting off (the
// summary is then empty, and traces hold no collectives): for measuring what
// counting costs (bench/RESULTS.md).
bool comm_profile_enabled();
// This process's totals since the last reset, ordered by group then op.
std::vector<CommTotals> comm_profile();
void reset_comm_profile();
// nccl-tests' bus bandwidth factor of `op` on `n` ranks.
double bus_factor(const std::string& op, int n);

namespace detail {
struct CommProfile;  // one collective's record (comm/profile.cpp)
}

// Handle of an operation in flight. Move-only; waiting twice is a no-op.
class Work {
 public:
  Work() = default;
  Work(Work&&) noexcept = default;
  Work& operator=(Work&&) noexcept = default;

  // Blocks until the operation (and its local post-processing) completes.
  void wait();
  bool done() const { return pending_.empty() && !then_; }
  // Appends a stage: once this work (and its own stages) completed, wait()
  // runs `next`, which may start a further operation whose Work is waited too.
  void and_then(std::function<Work()> next);

 private:
  friend class Group;
  std::string label_;  // "all_reduce on group 'dp' (seq 12)"
  std::chrono::milliseconds timeout_{0};
  // Set for a group-wide collective: its sequence number and the group's
  // tracker (Note [Which rank, which collective]).
  std::shared_ptr<CollectiveTracker> tracker_;
  uint64_t seq_ = 0;
  const char* op_ = "";
  // Note [Communication profile]: set for a collective that moves data.
  std::shared_ptr<detail::CommProfile> profile_;
  std::vector<compat::WorkPtr> pending_;
  // Runs after `pending_` completed; may start a further stage (a Work).
  std::function<Work()> then_;
};

enum class BackendKind { Gloo, Nccl };

// Note [Which rank, which collective]
// A hang in a collective is noticed by the ranks that wait, not by the rank
// that caused it (one that was stopped, is still computing, or took another
// branch). Two mechanisms name the culprit:
//  - Every group records the last collective each rank started and finished
//    (sequence numbers count the group's collectives; point-to-point sends
//    and receives have their own count). When a wait fails, the rank asks
//    every member through the store for its record (each process answers
//    from a small responder thread, so a rank busy computing still answers)
//    and the error carries the table and a last line "culprit: rank N ...":
//    the rank that did not answer, else the one furthest behind.
//  - Debug mode (WorldOptions::debug_collectives, parallel.debug_collectives,
//    SCALETRAIN_DEBUG_COLLECTIVES=1) compares, before any data moves, every
//    rank's fingerprint of the collective (op, group, sequence number, dtypes
//    and shapes, reduce op, root) through the store; a mismatch raises on
//    every rank, naming the rank that differs and both fingerprints. It costs
//    a few store round trips per collective: meant for tests and debugging.
//  - Note [First-of-kind check]: outside debug mode, the first collective
//    of each fingerprint on a group is compared the same way (once per
//    kind, so a training loop pays nothing after its first step). Ranks
//    that disagree on a shape would otherwise reach the backend, where Gloo
//    may abort the process from its own thread (gloo::EnforceNotMet, which
//    nothing can catch). A mismatch among kinds every rank has seen before
//    is not caught this way; a rank that checks while its peer does not
//    (the peer had seen its kind) waits for the peer's fingerprint until
//    the timeout and then says so, while the peer's collective times out
//    waiting for it: both diagnosed, neither reaching the backend's data.
// The store work lives in CollectiveTracker (comm/tracker.cpp); World owns the
// responder (world.cpp).
class CollectiveTracker {
 public:
  // Asks every member of a group (by global rank) for its record; returns
  // one answer per member, "" for a member that did not answer in time.
  // Throws StoreSilent when the store the question goes through does not
  // answer (its host, world rank 0, is stopped or gone).
  struct StoreSilent : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  using Ask = std::function<std::vector<std::string>(const std::string& group, const std::vector<int>& ranks)>;
  struct Options {
    std::string group;        // the group's name
    std::vector<int> ranks;   // its members' global ranks
    int rank = 0;             // this process's rank in the group
    // Debug mode: the store that fingerprints go through (null: off). A
    // connection of its own, so groups never wait on each other's requests.
    c10::intrusive_ptr<c10d::Store> fingerprint_store;
    // Outside debug mode: the store through which the first collective of
    // each kind is compared (Note [First-of-kind check]; null: off).
    c10::intrusive_ptr<c10d::Store> first_store;
    Ask ask;  // null: a failed wait reports no table
  };
  explicit CollectiveTracker(Options options);

  // Before data moves: records the start and, in debug mode, compares the
  // fingerprint with every member's (throws CommError on a mismatch).
  void launching(uint64_t seq, const std::string& op, const std::string& fingerprint);
  void finished(uint64_t seq, const std::string& op);
  // Brackets a wait on a collective, so the record says what the rank does.
  void waiting(uint64_t seq);
  void done_waiting();
  // This rank's record, as one answer line.
  std::string record() const;
  // The error of a failed wait: `what`, then the table of every member's
  // record and the culprit line (when members can be asked).
  std::string explain(const std::string& what) const;

 private:
  using Clock = std::chrono::steady_clock;
  Options o_;
  mutable std::mutex mu_;
  uint64_t started_ = 0, finished_ = 0;  // seq + 1 of the last one (0: none yet)
  std::string started_op_, finished_op_;
  uint64_t waiting_on_ = 0;  // seq + 1 waited on now (0: not waiting)
  Clock::time_point since_ = Clock::now();
  std::set<std::string> seen_;  // fingerprints already compared (Note [First-of-kind check])
  void check_first_of_kind(uint64_t seq, const std::string& op, const std::string& fingerprint);
};

namespace detail {
class ScratchPool;  // see Note [Scratch buffers]; defined in group_internal.h
}  // namespace detail

class Group {
 public:
  // `ranks` are the global ranks of the members, in group-rank order.
  Group(std::string name, std::vector<int> ranks, int rank, BackendKind kind, compat::BackendPtr backend,
        std::chrono::milliseconds timeout);

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }
  BackendKind kind() const { return kind_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Elements of one rank's chunk of a flat tensor of `numel` elements.
  int64_t shard_numel(int64_t numel) const { return (numel + size() - 1) / size(); }
  // Collectives issued so far (the sequence number of the next one); sends
  // and receives are counted apart, as ranks issue different numbers of them.
  uint64_t sequence() const { return seq_.load(); }
  // See Note [Which rank, which collective]; set by World.
  void set_tracker(std::shared_ptr<CollectiveTracker> tracker) { tracker_ = std::move(tracker); }
  const std::shared_ptr<CollectiveTracker>& tracker() const { return tracker_; }
  // Bytes held by this group's scratch pool (see Note [Scratch buffers]).
  int64_t scratch_bytes() const;

  [[nodiscard]] Work broadcast(at::Tensor tensor, int root);
  [[nodiscard]] Work all_reduce(at::Tensor tensor, ReduceOp op = ReduceOp::Sum);
  [[nodiscard]] Work reduce(at::Tensor tensor, int root, ReduceOp op = ReduceOp::Sum);
  // full: N elements (any shape, contiguous); shard: shard_numel(N) elements.
  [[nodiscard]] Work reduce_scatter(at::Tensor full, at::Tensor shard, ReduceOp op = ReduceOp::Sum);
  [[nodiscard]] Work all_gather(at::Tensor shard, at::Tensor full);
  // Equal splits: chunk j of `input` goes to rank j, chunk i of `output` comes from rank i.
  [[nodiscard]] Work all_to_all(at::Tensor input, at::Tensor output);
  // Uneven splits along dim 0: rows [sum(in_rows[<j]), +in_rows[j]) of `input`
  // go to rank j; rank i's rows land at [sum(out_rows[<i]), +out_rows[i]) of
  // `output`. Every rank's in_rows[j] must be rank j's out_rows[rank] (send
  // the counts first, e.g. with all_to_all). Rows have the same shape and dtype on both sides.
  [[nodiscard]] Work all_to_all_v(at::Tensor input, at::Tensor output, const std::vector<int64_t>& in_rows,
                                  const std::vector<int64_t>& out_rows);
  // On root, outputs has size() tensors shaped like input; elsewhere ignored.
  [[nodiscard]] Work gather(at::Tensor input, std::vector<at::Tensor> outputs, int root);
  // On root, inputs has size() tensors shaped like output; elsewhere ignored.
  [[nodiscard]] Work scatter(std::vector<at::Tensor> inputs, at::Tensor output, int root);
  [[nodiscard]] Work send(at::Tensor tensor, int dst, int tag = 0);
  [[nodiscard]] Work recv(at::Tensor tensor, int src, int tag = 0);
  [[nodiscard]] Work barrier();

 private:
  // `bytes`: the data size (Note [Communication profile]); `moved_as`: the op
  // it counts as when that is not `op` (a stage of a composite).
  Work start(const char* op, compat::WorkPtr w, int64_t bytes = 0, const char* moved_as = nullptr);
  Work start(const char* op, std::vector<compat::WorkPtr> ws, int64_t bytes = 0, const char* moved_as = nullptr);
  std::string label(const char* op, uint64_t seq) const;
  static bool point_to_point(const char* op);
  // Called right before the backend launches `op`: the tracker's record and
  // debug-mode fingerprint check (uses what describe() noted last).
  void launching(const char* op);
  // Notes the arguments of the collective about to launch, for the fingerprint.
  void describe(const char* op, std::initializer_list<at::Tensor> tensors, const std::string& extra = "");
  bool gloo() const { return kind_ == BackendKind::Gloo; }
  // Note [Staged tensors]: whether `t` lives where this backend cannot move it,
  // and the wrapper that moves such tensors through a copy on the other side.
  bool foreign(const at::Tensor& t) const;
  Work staged(const std::vector<at::Tensor>& tensors, const std::vector<bool>& outputs,
              const std::function<Work(const std::vector<at::Tensor>&)>& run);
  // Gloo stage of reduce_scatter: all_to_all of raw chunks, local fp32 sum.
  Work reduce_scatter_by_all_to_all(at::Tensor full, at::Tensor shard, ReduceOp op, const char* op_name);

  std::string name_;
  std::vector<int> ranks_;
  int rank_;
  BackendKind kind_;
  compat::BackendPtr backend_;
  std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<uint64_t> p2p_seq_{0};
  std::shared_ptr<detail::ScratchPool> scratch_;
  std::shared_ptr<CollectiveTracker> tracker_;
};

}  // namespace scaletrain::comm

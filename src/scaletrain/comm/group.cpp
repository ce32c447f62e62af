// The collectives API over c10d backends. See Note [Gloo 1.13 gaps] in group.h.
// Work and Group live here; the scratch pool in scratch.cpp, the collective
// tracker in tracker.cpp, the communication profile in profile.cpp (shared
// pieces: group_internal.h).
#include "scaletrain/comm/group.h"

#include "scaletrain/comm/activity.h"
#include "scaletrain/comm/group_internal.h"
#include "scaletrain/util/trace.h"

#include <c10/util/Exception.h>
#if defined(SCALETRAIN_WITH_CUDA)
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cstring>
#include <sstream>

namespace scaletrain::comm {

namespace {

using detail::count_collective;
using detail::first_line;
using detail::is_16bit_float;
using detail::padded_copy;
using detail::reduce_rows_into;
using detail::ScratchPool;

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

void check_contiguous(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.is_contiguous(), "scaletrain ", op, ": tensors must be contiguous");
}

}  // namespace

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
  if (!ws.empty() && comm_profile_enabled())  // Note [Communication profile]
    w.profile_ = detail::launch_profile(moved_as ? moved_as : op, name_, size(), seq, bytes, gloo() && !p2p, ws);
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
      moved.push_back(t.to(at::Device(at::DeviceType::CUDA)));  // the current device (train/plan/device.h use_device)
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

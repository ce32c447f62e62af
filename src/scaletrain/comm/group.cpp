// The collectives API over c10d backends. See Note [Gloo 1.13 gaps] in group.h.
#include "scaletrain/comm/group.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace scaletrain::comm {
namespace {

bool is_16bit_float(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The raw bytes of a contiguous tensor, as a 1-D uint8 tensor sharing storage.
at::Tensor bytes_of(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case ReduceOp::Avg: return c10d::ReduceOp::AVG;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

// Reduces the rows of `rows` ([n, k], any float dtype) in fp32 or wider.
at::Tensor reduce_rows(const at::Tensor& rows, ReduceOp op) {
  at::Tensor r = is_16bit_float(rows.scalar_type()) ? rows.to(at::kFloat) : rows;
  switch (op) {
    case ReduceOp::Sum: return r.sum(0);
    case ReduceOp::Avg: return r.sum(0).div_(rows.size(0));
    case ReduceOp::Max: return std::get<0>(r.max(0));
    case ReduceOp::Min: return std::get<0>(r.min(0));
  }
  return r.sum(0);
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

}  // namespace

// --- Work -------------------------------------------------------------------

void Work::wait() {
  try {
    for (auto& w : pending_) w->wait(timeout_);
    pending_.clear();
    if (then_) {
      auto then = std::move(then_);
      then_ = nullptr;
      Work next = then();
      next.wait();
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    pending_.clear();
    then_ = nullptr;
    throw CommError(label_ + " failed: " + first_line(e));
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

Group::Group(std::string name, std::vector<int> ranks, int rank, BackendKind kind,
             compat::BackendPtr backend, std::chrono::milliseconds timeout)
    : name_(std::move(name)),
      ranks_(std::move(ranks)),
      rank_(rank),
      kind_(kind),
      backend_(std::move(backend)),
      timeout_(timeout) {}

std::string Group::label(const char* op, uint64_t seq) const {
  std::ostringstream s;
  s << op << " on group '" << name_ << "' (size " << size() << ", rank " << rank_ << ", seq " << seq << ")";
  return s.str();
}

Work Group::start(const char* op, std::vector<compat::WorkPtr> ws) {
  Work w;
  w.label_ = label(op, seq_++);
  w.timeout_ = timeout_;
  w.pending_ = std::move(ws);
  return w;
}

Work Group::start(const char* op, compat::WorkPtr w) {
  std::vector<compat::WorkPtr> ws;
  if (w) ws.push_back(std::move(w));
  return start(op, std::move(ws));
}

// Launching can throw too (a closed connection is noticed on send): wrap it.
#define ST_LAUNCH(op, expr)                                                       \
  [&]() -> compat::WorkPtr {                                                      \
    try {                                                                         \
      return expr;                                                                \
    } catch (const std::exception& e) {                                           \
      throw CommError(label(op, seq_.load()) + " failed to start: " + first_line(e)); \
    }                                                                             \
  }()

Work Group::broadcast(at::Tensor tensor, int root) {
  check_contiguous(tensor, "broadcast");
  if (size() == 1) return start("broadcast", compat::WorkPtr());
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("broadcast", ST_LAUNCH("broadcast", backend_->broadcast(ts, o)));
}

Work Group::all_reduce(at::Tensor tensor, ReduceOp op) {
  check_contiguous(tensor, "all_reduce");
  if (size() == 1) return start("all_reduce", compat::WorkPtr());
  if (gloo() && is_16bit_float(tensor.scalar_type())) {
    // Two stages: reduce_scatter (fp32 sum) then all_gather of the shards.
    // The second stage is issued when this Work is waited on; like every
    // launch, waits happen in the same order on all ranks (SPMD), so the
    // ranks' operation sequences still match.
    auto shard = at::empty({shard_numel(tensor.numel())}, tensor.options());
    Work rs = reduce_scatter_by_all_to_all(tensor, shard, op, "all_reduce");
    auto reduce_then = std::move(rs.then_);
    rs.then_ = [this, shard, tensor, reduce_then]() {
      reduce_then().wait();
      return all_gather(shard, tensor);
    };
    return rs;
  }
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions o;
  o.timeout = timeout_;
  bool local_avg = gloo() && op == ReduceOp::Avg;
  o.reduceOp = local_avg ? c10d::ReduceOp(c10d::ReduceOp::SUM) : to_c10d(op);
  Work w = start("all_reduce", ST_LAUNCH("all_reduce", backend_->allreduce(ts, o)));
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
  TORCH_CHECK(shard.numel() == k, "scaletrain ", op_name, ": shard has ", shard.numel(),
              " elements, expected ceil(", full.numel(), "/", n, ") = ", k);
  at::Tensor in = full.reshape({-1});
  if (in.numel() != n * k) {
    in = at::zeros({n * k}, full.options());
    in.narrow(0, 0, full.numel()).copy_(full.reshape({-1}));
  }
  at::Tensor out = at::empty({n * k}, full.options());
  at::Tensor out_bytes = bytes_of(out), in_bytes = bytes_of(in);
  std::vector<int64_t> equal_splits;  // empty = equal splits
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  Work w = start(op_name, ST_LAUNCH(op_name, backend_->alltoall_base(out_bytes, in_bytes, equal_splits,
                                                                     equal_splits, o)));
  w.then_ = [out, in, shard, n, k, op]() mutable {
    shard.reshape({-1}).copy_(reduce_rows(out.view({n, k}), op));
    return Work();
  };
  return w;
}

Work Group::reduce_scatter(at::Tensor full, at::Tensor shard, ReduceOp op) {
  check_contiguous(full, "reduce_scatter");
  check_contiguous(shard, "reduce_scatter");
  if (size() == 1) {
    TORCH_CHECK(shard.numel() == full.numel(), "scaletrain reduce_scatter: shard size mismatch");
    shard.reshape({-1}).copy_(full.reshape({-1}));
    return start("reduce_scatter", compat::WorkPtr());
  }
  if (gloo()) return reduce_scatter_by_all_to_all(full, shard, op, "reduce_scatter");
  // NCCL has a native flat reduce-scatter; pad the input to size() chunks.
  const int64_t k = shard_numel(full.numel());
  at::Tensor in = full.reshape({-1});
  if (in.numel() != size() * k) {
    in = at::zeros({size() * k}, full.options());
    in.narrow(0, 0, full.numel()).copy_(full.reshape({-1}));
  }
  at::Tensor out = shard.reshape({-1});
  c10d::ReduceScatterOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = timeout_;
  Work w = start("reduce_scatter", ST_LAUNCH("reduce_scatter", backend_->_reduce_scatter_base(out, in, o)));
  w.then_ = [in]() { return Work(); };  // keeps the padded input alive until done
  return w;
}

Work Group::all_gather(at::Tensor shard, at::Tensor full) {
  check_contiguous(shard, "all_gather");
  check_contiguous(full, "all_gather");
  const int n = size();
  const int64_t k = shard.numel();
  TORCH_CHECK(shard_numel(full.numel()) == k, "scaletrain all_gather: output of ", full.numel(),
              " elements does not match ", n, " shards of ", k);
  if (n == 1) {
    full.reshape({-1}).copy_(shard.reshape({-1}));
    return start("all_gather", compat::WorkPtr());
  }
  // Gather straight into `full` when it holds exactly n shards, else into a
  // padded buffer whose padding is dropped afterwards.
  const bool exact = full.numel() == n * k;
  at::Tensor dst = exact ? full.reshape({-1}) : at::empty({n * k}, full.options());
  c10d::AllgatherOptions o;
  o.timeout = timeout_;
  Work w;
  if (gloo()) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int i = 0; i < n; ++i) outs[0].push_back(bytes_of(dst.narrow(0, i * k, k)));
    std::vector<at::Tensor> ins{bytes_of(shard)};
    w = start("all_gather", ST_LAUNCH("all_gather", backend_->allgather(outs, ins, o)));
  } else {
    at::Tensor in = shard.reshape({-1});
    w = start("all_gather", ST_LAUNCH("all_gather", backend_->_allgather_base(dst, in, o)));
  }
  if (!exact) {
    w.then_ = [dst, full]() mutable {
      full.reshape({-1}).copy_(dst.narrow(0, 0, full.numel()));
      return Work();
    };
  }
  return w;
}

Work Group::all_to_all(at::Tensor input, at::Tensor output) {
  check_contiguous(input, "all_to_all");
  check_contiguous(output, "all_to_all");
  TORCH_CHECK(input.numel() == output.numel() && input.numel() % size() == 0,
              "scaletrain all_to_all: input and output must have equal sizes divisible by the group size");
  if (size() == 1) {
    output.copy_(input);
    return start("all_to_all", compat::WorkPtr());
  }
  at::Tensor out = bytes_of(output), in = bytes_of(input);
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions o;
  o.timeout = timeout_;
  return start("all_to_all", ST_LAUNCH("all_to_all", backend_->alltoall_base(out, in, equal_splits, equal_splits, o)));
}

Work Group::reduce(at::Tensor tensor, int root, ReduceOp op) {
  check_contiguous(tensor, "reduce");
  if (size() == 1) return start("reduce", compat::WorkPtr());
  if (gloo() && (is_16bit_float(tensor.scalar_type()) || op == ReduceOp::Avg)) {
    // Gather the raw payloads at the root and reduce there in fp32.
    std::vector<at::Tensor> outs;
    if (rank_ == root)
      for (int i = 0; i < size(); ++i) outs.push_back(at::empty_like(tensor));
    Work w = gather(tensor, outs, root);
    if (rank_ == root) {
      w.then_ = [outs, tensor, op]() mutable {
        std::vector<at::Tensor> flat;
        for (auto& t : outs) flat.push_back(t.reshape({-1}));
        tensor.reshape({-1}).copy_(reduce_rows(at::stack(flat), op));
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
  return start("reduce", ST_LAUNCH("reduce", backend_->reduce(ts, o)));
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
  std::vector<std::vector<at::Tensor>> outs;
  if (rank_ == root) {
    outs.emplace_back();
    for (auto& t : outputs) outs[0].push_back(gloo() ? bytes_of(t) : t);
  }
  std::vector<at::Tensor> ins{gloo() ? bytes_of(input) : input};
  c10d::GatherOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("gather", ST_LAUNCH("gather", backend_->gather(outs, ins, o)));
}

Work Group::scatter(std::vector<at::Tensor> inputs, at::Tensor output, int root) {
  check_contiguous(output, "scatter");
  if (rank_ == root)
    TORCH_CHECK(static_cast<int>(inputs.size()) == size(), "scaletrain scatter: root needs ", size(), " inputs");
  if (size() == 1) {
    output.copy_(inputs[0]);
    return start("scatter", compat::WorkPtr());
  }
  std::vector<std::vector<at::Tensor>> ins;
  if (rank_ == root) {
    ins.emplace_back();
    for (auto& t : inputs) ins[0].push_back(gloo() ? bytes_of(t.contiguous()) : t.contiguous());
  }
  std::vector<at::Tensor> outs{gloo() ? bytes_of(output) : output};
  c10d::ScatterOptions o;
  o.rootRank = root;
  o.timeout = timeout_;
  return start("scatter", ST_LAUNCH("scatter", backend_->scatter(outs, ins, o)));
}

Work Group::send(at::Tensor tensor, int dst, int tag) {
  check_contiguous(tensor, "send");
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  return start("send", ST_LAUNCH("send", backend_->send(ts, dst, tag)));
}

Work Group::recv(at::Tensor tensor, int src, int tag) {
  check_contiguous(tensor, "recv");
  std::vector<at::Tensor> ts{gloo() ? bytes_of(tensor) : tensor};
  return start("recv", ST_LAUNCH("recv", backend_->recv(ts, src, tag)));
}

Work Group::barrier() {
  if (size() == 1) return start("barrier", compat::WorkPtr());
  c10d::BarrierOptions o;
  o.timeout = timeout_;
  return start("barrier", ST_LAUNCH("barrier", backend_->barrier(o)));
}

#undef ST_LAUNCH

}  // namespace scaletrain::comm

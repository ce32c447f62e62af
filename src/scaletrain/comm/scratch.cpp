// The scratch pool (Note [Scratch buffers] in group.h): Group's grow-only pool
// of host byte buffers, and the reductions and padded copies that use it.
#include "scaletrain/comm/group_internal.h"

#include <array>
#include <cstddef>
#include <mutex>

namespace scaletrain::comm::detail {

ScratchPool::LeasePtr ScratchPool::take(int64_t numel, const at::TensorOptions& options) {
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

}  // namespace scaletrain::comm::detail

#include "scaletrain/parallel/tensor/tp_comm.h"

#include <cstdint>
#include <string>

#include "scaletrain/util/error.h"

namespace scaletrain::parallel::tensor {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Note [Group in the autograd context]: AutogradContext::saved_data holds
// IValues, which cannot hold a plain pointer, so the group travels as its
// address in an int64. Backward runs before the graph is freed, and the
// group outlives the graph (see tp_comm.h), so the address stays valid.
void stash(AutogradContext* ctx, comm::Group* g, int64_t dim = 0) {
  ctx->saved_data["group"] = static_cast<int64_t>(reinterpret_cast<std::intptr_t>(g));
  ctx->saved_data["dim"] = dim;
}
comm::Group& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<comm::Group*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
}
int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

int64_t checked_dim(const torch::Tensor& x, int64_t dim, const comm::Group& g, const char* what) {
  if (dim < 0) dim += x.dim();
  if (dim < 0 || dim >= x.dim())
    throw UsageError(std::string(what) + ": dimension " + std::to_string(dim) + " out of range for a " +
                     std::to_string(x.dim()) + "-d tensor");
  return dim;
}

void check_divisible(const torch::Tensor& x, int64_t dim, const comm::Group& g, const char* what) {
  if (x.size(dim) % g.size() != 0)
    throw UsageError(std::string(what) + ": tensor parallel degree tp=" + std::to_string(g.size()) +
                     " does not divide dimension " + std::to_string(dim) + " of size " + std::to_string(x.size(dim)));
}

// f: identity forward, all-reduce backward.
struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g) {
    stash(ctx, g);
    return {x};  // autograd turns an input returned as output into a view with our backward
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto gx = grad[0].contiguous().clone();
    all_reduce_(gx, group_of(ctx));
    return {gx, torch::Tensor()};
  }
};

// g: all-reduce forward, identity backward.
struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g) {
    auto y = x.contiguous().clone();  // never reduce the caller's tensor in place
    all_reduce_(y, *g);
    return {y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) { return {grad[0], torch::Tensor()}; }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g, int64_t dim) {
    stash(ctx, g, dim);
    return {all_gather_along(x, *g, dim)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {reduce_scatter_along(grad[0], group_of(ctx), dim_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

struct ReduceScatterToSequence : torch::autograd::Function<ReduceScatterToSequence> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g, int64_t dim) {
    stash(ctx, g, dim);
    return {reduce_scatter_along(x, *g, dim)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_gather_along(grad[0], group_of(ctx), dim_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g, int64_t dim) {
    stash(ctx, g, dim);
    return {chunk_of(x, dim, g->rank(), g->size())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_gather_along(grad[0], group_of(ctx), dim_of(ctx)), torch::Tensor(), torch::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* g, int64_t dim) {
    stash(ctx, g, dim);
    return {all_gather_along(x, *g, dim)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto& g = group_of(ctx);
    return {chunk_of(grad[0], dim_of(ctx), g.rank(), g.size()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

void all_reduce_(torch::Tensor& x, comm::Group& g, comm::ReduceOp op) {
  if (g.size() == 1) return;
  g.all_reduce(x, op).wait();
}

torch::Tensor all_gather_along(const torch::Tensor& x, comm::Group& g, int64_t dim) {
  dim = checked_dim(x, dim, g, "all_gather_along");
  if (g.size() == 1) return x;
  torch::NoGradGuard no_grad;
  auto shard = x.contiguous();
  auto full = torch::empty({g.size() * shard.numel()}, shard.options());
  g.all_gather(shard, full).wait();
  // full is [tp, *shard.shape]; moving the rank axis just before `dim` and
  // merging it with `dim` puts rank r's chunk at [r * n, (r + 1) * n).
  auto sizes = shard.sizes().vec();
  sizes.insert(sizes.begin(), g.size());
  auto out_sizes = shard.sizes().vec();
  out_sizes[dim] *= g.size();
  return full.view(sizes).movedim(0, dim).reshape(out_sizes);
}

torch::Tensor reduce_scatter_along(const torch::Tensor& x, comm::Group& g, int64_t dim) {
  dim = checked_dim(x, dim, g, "reduce_scatter_along");
  check_divisible(x, dim, g, "reduce_scatter_along");
  if (g.size() == 1) return x;
  torch::NoGradGuard no_grad;
  // [.., D, ..] -> [.., tp, D/tp, ..] -> [tp, .., D/tp, ..]: chunk r is rank r's.
  auto sizes = x.sizes().vec();
  sizes[dim] /= g.size();
  sizes.insert(sizes.begin() + dim, g.size());
  auto full = x.reshape(sizes).movedim(dim, 0).contiguous();
  auto shard_sizes = x.sizes().vec();
  shard_sizes[dim] /= g.size();
  auto shard = torch::empty(shard_sizes, x.options());
  g.reduce_scatter(full, shard).wait();
  return shard;
}

torch::Tensor chunk_of(const torch::Tensor& x, int64_t dim, int rank, int size) {
  if (dim < 0) dim += x.dim();
  if (x.size(dim) % size != 0)
    throw UsageError("tensor parallel degree tp=" + std::to_string(size) + " does not divide dimension " +
                     std::to_string(dim) + " of size " + std::to_string(x.size(dim)));
  const int64_t n = x.size(dim) / size;
  return x.narrow(dim, rank * n, n).contiguous();
}

torch::Tensor copy_to_tp_region(const torch::Tensor& x, comm::Group& tp) { return CopyToRegion::apply(x, &tp)[0]; }

torch::Tensor reduce_from_tp_region(const torch::Tensor& x, comm::Group& tp) {
  return ReduceFromRegion::apply(x, &tp)[0];
}

torch::Tensor gather_from_sequence(const torch::Tensor& x, comm::Group& tp, int64_t dim) {
  return GatherFromSequence::apply(x, &tp, checked_dim(x, dim, tp, "gather_from_sequence"))[0];
}

torch::Tensor reduce_scatter_to_sequence(const torch::Tensor& x, comm::Group& tp, int64_t dim) {
  dim = checked_dim(x, dim, tp, "reduce_scatter_to_sequence");
  check_divisible(x, dim, tp, "sequence parallelism");
  return ReduceScatterToSequence::apply(x, &tp, dim)[0];
}

torch::Tensor scatter_to_tp_region(const torch::Tensor& x, comm::Group& tp, int64_t dim) {
  dim = checked_dim(x, dim, tp, "scatter_to_tp_region");
  check_divisible(x, dim, tp, "scatter_to_tp_region");
  return ScatterToRegion::apply(x, &tp, dim)[0];
}

torch::Tensor gather_from_tp_region(const torch::Tensor& x, comm::Group& tp, int64_t dim) {
  return GatherFromRegion::apply(x, &tp, checked_dim(x, dim, tp, "gather_from_tp_region"))[0];
}

}  // namespace scaletrain::parallel::tensor

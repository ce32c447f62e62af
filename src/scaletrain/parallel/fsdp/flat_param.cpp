#include "scaletrain/parallel/fsdp/flat_param.h"

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/precision/fp8.h"

#include <c10/core/StorageImpl.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

namespace scaletrain::parallel::fsdp {

FlatParam::FlatParam(std::string unit, std::vector<std::string> names, std::vector<at::Tensor> params,
                     size_t decay_count, comm::Group& group, FlatParamOptions options, bool deferred)
    : unit_(std::move(unit)),
      names_(std::move(names)),
      params_(std::move(params)),
      group_(group),
      options_(options),
      n_(group.size()) {
  if (params_.empty()) throw std::invalid_argument("FlatParam: no parameters in unit " + unit_);
  if (options_.reduce_group != nullptr && options_.reduce_group->ranks() != group.ranks())
    throw std::invalid_argument("FlatParam: the reduce group of unit " + unit_ + " has other ranks than its group");
  const at::TensorOptions topt = params_.front().options();
  trainable_ = params_.front().requires_grad();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (p.scalar_type() != params_.front().scalar_type() || p.device() != params_.front().device() ||
        p.requires_grad() != trainable_)
      throw std::invalid_argument("FlatParam: '" + names_[i] + "' differs in dtype, device or requires_grad");
    offsets_.push_back(numel_);
    numel_ += p.numel();
    if (i + 1 == decay_count) decay_end_ = numel_;
  }
  k_ = (numel_ + n_ - 1) / n_;

  torch::NoGradGuard no_grad;
  // Note [Flat parameters]: one copy into the padded buffer, then every
  // parameter becomes a view of it for good.
  // A deferred model's sharded buffer is never filled whole: at::empty does
  // not touch its pages, and reshard() below releases them.
  full_ = at::empty({padded_numel()}, topt.requires_grad(false));
  full_.narrow(0, numel_, padded_numel() - numel_).zero_();
  if (deferred && options_.replicated_params) full_.zero_();
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor view = full_.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes());
    if (!deferred) view.copy_(params_[i]);
    params_[i].set_data(view);
  }
  at::Tensor mine = full_.narrow(0, static_cast<int64_t>(group_.rank()) * k_, k_);
  init_shard(mine, deferred, topt);
  if (options_.reduce_dtype == at::ScalarType::Undefined) options_.reduce_dtype = full_.scalar_type();
  if (options_.grad_dtype == at::ScalarType::Undefined) options_.grad_dtype = options_.master_dtype;
  if (options_.fp8_gather) {
    if (options_.replicated_params)
      throw std::invalid_argument("FlatParam: FP8 weight gathers need sharded parameters (unit " + unit_ + ")");
    fp8_scales_.assign(params_.size(), 1.0);
  }
  if (trainable_) init_grads(topt);
  if (device_shard_.defined() && !deferred) refresh_device_copy();
  reshard();
}

void FlatParam::init_shard(const at::Tensor& mine, bool deferred, const at::TensorOptions& topt) {
  shard_is_view_ = options_.replicated_params && options_.master_dtype == full_.scalar_type() && !offloaded();
  if (shard_is_view_) {
    shard_ = mine;
  } else if (offloaded()) {  // Note [Offloaded shards]
    shard_ = options_.offload_alloc(k_, options_.master_dtype, /*gradient=*/false);
    if (deferred)
      shard_.zero_();
    else
      shard_.copy_(mine);
    if (!options_.gather_from_host && !options_.replicated_params)
      device_shard_ = at::empty({k_}, topt.requires_grad(false));  // filled by refresh_device_copy()
  } else if (deferred) {
    shard_ = at::zeros({k_}, topt.dtype(options_.master_dtype).requires_grad(false));
  } else {
    shard_ = mine.to(options_.master_dtype, /*non_blocking=*/false, /*copy=*/true);
  }
}

void FlatParam::init_grads(const at::TensorOptions& topt) {
  grad_full_ = at::empty({padded_numel()}, topt.requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i)
    grad_views_.push_back(grad_full_.narrow(0, offsets_[i], params_[i].numel()).view(params_[i].sizes()));
  if (options_.keep_full_grads && shard_is_view_ && options_.reduce_dtype == full_.scalar_type()) {
    // ZeRO-1: reduce in place into this rank's chunk, which is the shard's gradient.
    grad_full_.zero_();
    reduce_out_ = grad_full_.narrow(0, static_cast<int64_t>(group_.rank()) * k_, k_);
    shard_.mutable_grad() = reduce_out_;
  } else {
    // The gradient shard is allocated by the first reduce (setup stays at
    // the parameter shards; frozen-only steps never pay for it).
    reduce_out_ = at::empty({k_}, full_.options().dtype(options_.reduce_dtype));
    options_.keep_full_grads = false;  // the in-place layout needs a shard view of the same dtype
    interfaces::free_storage(grad_full_);
  }
}

void FlatParam::refresh_device_copy() {
  if (!device_shard_.defined()) return;
  torch::NoGradGuard no_grad;
  device_shard_.copy_(shard_);
}

void FlatParam::read_ahead() const {
  if (!offloaded() || !options_.read_ahead || shard_.nbytes() == 0) return;
  // Whole pages around the shard's bytes; advice only, so failures are ignored.
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(shard_.data_ptr()) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(shard_.data_ptr()) + shard_.nbytes();
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_WILLNEED);
}

void FlatParam::load_param(size_t i, const at::Tensor& value) {
  torch::NoGradGuard no_grad;
  const at::Tensor flat = value.reshape({-1});
  TORCH_CHECK(flat.numel() == params_[i].numel(), "FlatParam: value of '", names_[i], "' has ", flat.numel(),
              " elements, expected ", params_[i].numel());
  if (options_.replicated_params) params_[i].copy_(value.view(params_[i].sizes()));
  if (shard_is_view_) return;
  // The overlap of the parameter's range with this rank's chunk.
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  const int64_t lo = std::max(offsets_[i], begin), hi = std::min(offsets_[i] + flat.numel(), begin + k_);
  if (lo < hi) shard_.narrow(0, lo - begin, hi - lo).copy_(flat.narrow(0, lo - offsets_[i], hi - lo));
}

void FlatParam::load_param_slice(size_t i, const SliceFill& fill) {
  torch::NoGradGuard no_grad;
  const at::Tensor& p = params_[i];
  if (options_.replicated_params) {
    at::Tensor whole = at::empty({p.numel()}, p.options().requires_grad(false));
    fill(names_[i], 0, p.numel(), whole);
    return load_param(i, whole);
  }
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  const int64_t lo = std::max(offsets_[i], begin), hi = std::min(offsets_[i] + p.numel(), begin + k_);
  if (lo >= hi) return;
  at::Tensor part = shard_.narrow(0, lo - begin, hi - lo);
  if (part.scalar_type() == p.scalar_type()) return fill(names_[i], lo - offsets_[i], hi - lo, part);
  // Through the parameter's dtype, as load_param rounds a whole value.
  at::Tensor tmp = at::empty({hi - lo}, p.options().requires_grad(false));
  fill(names_[i], lo - offsets_[i], hi - lo, tmp);
  part.copy_(tmp);
}

std::vector<ShardPiece> FlatParam::pieces() const {
  std::vector<ShardPiece> out;
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(offsets_[i], begin), hi = std::min(offsets_[i] + params_[i].numel(), begin + k_);
    if (lo >= hi) continue;
    out.push_back({names_[i], params_[i].sizes().vec(), lo - offsets_[i], lo - begin, hi - lo});
  }
  return out;
}

int64_t FlatParam::shard_decay_numel() const {
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  return std::clamp<int64_t>(decay_end_ - begin, 0, k_);
}

int64_t FlatParam::full_bytes() const { return static_cast<int64_t>(full_.storage().nbytes()); }

std::vector<double> FlatParam::fp8_local_amax() const {
  torch::NoGradGuard no_grad;
  std::vector<double> out(params_.size(), 0.0);
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(offsets_[i], begin), hi = std::min(offsets_[i] + params_[i].numel(), begin + k_);
    if (lo < hi) out[i] = shard_.narrow(0, lo - begin, hi - lo).abs().max().item<double>();
  }
  return out;
}

void FlatParam::set_fp8_amax(const std::vector<double>& amax) {
  if (!options_.fp8_gather) return;
  TORCH_CHECK(amax.size() == fp8_scales_.size(), "FlatParam: one amax per parameter of unit ", unit_);
  for (size_t i = 0; i < amax.size(); ++i)
    fp8_scales_[i] = precision::fp8_scale(amax[i], *options_.fp8_gather, /*margin=*/0, fp8_scales_[i]);
}

comm::Work FlatParam::start_unshard(bool exact) {
  if (unsharded()) return comm::Work();
  interfaces::alloc_storage(full_);
  torch::NoGradGuard no_grad;
  at::Tensor src;
  const bool fp8 = options_.fp8_gather && !exact;
  const at::ScalarType wire = fp8 ? at::kFloat : full_.scalar_type();
  if (device_shard_.defined())
    src = device_shard_;
  else if (offloaded())  // parameter offload: host to device, every gather (a copy even when they are one memory)
    src = shard_.to(full_.device(), wire, /*non_blocking=*/shard_.is_pinned(), /*copy=*/true);
  else
    src = shard_.scalar_type() == wire ? shard_ : shard_.to(wire);
  if (!fp8) return group_.all_gather(src.detach(), full_);
  // Note [FP8 weight gathers]: this rank's pieces as codes, each with its
  // parameter's scale; the padding stays code 0 (+0).
  const precision::Fp8Format format = *options_.fp8_gather;
  at::Tensor codes = at::zeros({k_}, full_.options().dtype(at::kByte).requires_grad(false));
  const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t lo = std::max(offsets_[i], begin), hi = std::min(offsets_[i] + params_[i].numel(), begin + k_);
    if (lo < hi)
      codes.narrow(0, lo - begin, hi - lo)
          .copy_(precision::fp8_quantize(src.narrow(0, lo - begin, hi - lo), format, fp8_scales_[i]));
  }
  at::Tensor gathered = at::empty({padded_numel()}, codes.options());
  std::vector<int64_t> sizes;
  for (const auto& p : params_) sizes.push_back(p.numel());
  comm::Work w = group_.all_gather(codes, gathered);
  w.and_then([full = full_, gathered, offsets = offsets_, sizes, scales = fp8_scales_, format, numel = numel_]() {
    torch::NoGradGuard guard;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i];
      full.narrow(0, offsets[i], n)
          .copy_(precision::fp8_dequantize(gathered.narrow(0, offsets[i], n), format, scales[i], full.scalar_type()));
    }
    full.narrow(0, numel, full.numel() - numel).zero_();
    return comm::Work();
  });
  return w;
}

void FlatParam::reshard() {
  if (!options_.replicated_params) interfaces::free_storage(full_);
}

void FlatParam::alloc_grad_full() {
  if (grad_full_.storage().nbytes() > 0) return;
  interfaces::alloc_storage(grad_full_);
  grad_full_.zero_();
}

void FlatParam::on_grad_ready(size_t i) {
  torch::NoGradGuard no_grad;
  alloc_grad_full();
  at::Tensor& g = params_[i].mutable_grad();
  if (g.is_same(grad_views_[i])) return;
  // AccumulateGrad made a fresh tensor (the slot was empty): move it in. From
  // now on it accumulates into the view in place (no_sync micro-batches).
  if (g.defined()) grad_views_[i].add_(g);
  g = grad_views_[i];
}

comm::Work FlatParam::start_reduce(comm::Group* replicate) {
  torch::NoGradGuard no_grad;
  if (reduced_)
    throw std::logic_error("zero1 reduces gradients once per optimizer step (unit " + unit_ +
                           "): run the micro-batches before the last under no_sync(), and zero_grad() after the step");
  alloc_grad_full();  // a unit none of whose parameters got a gradient contributes zeros
  reduce_in_ = grad_full_.scalar_type() == options_.reduce_dtype ? grad_full_ : grad_full_.to(options_.reduce_dtype);
  // grad_full is spent by this reduce (ZeRO-1 keeps only the chunk it receives): scaled in place.
  if (options_.grad_scale != 1.0) reduce_in_.mul_(options_.grad_scale);
  const auto fp8 = options_.fp8_reduce;
  comm::Group& g = options_.reduce_group != nullptr ? *options_.reduce_group : group_;
  comm::Work w = fp8 ? precision::fp8_reduce_scatter_avg(g, reduce_in_, reduce_out_, *fp8)
                     : g.reduce_scatter(reduce_in_, reduce_out_, comm::ReduceOp::Avg);
  if (replicate != nullptr && replicate->size() > 1) {
    at::Tensor out = reduce_out_;
    w.and_then([replicate, out, fp8]() mutable {
      return fp8 ? precision::fp8_all_reduce_avg(*replicate, out, *fp8) : replicate->all_reduce(out, comm::ReduceOp::Avg);
    });
  }
  return w;
}

void FlatParam::finish_reduce() {
  torch::NoGradGuard no_grad;
  if (options_.keep_full_grads) {
    // The chunk now holds the average; the rest of the local sums are spent.
    const int64_t begin = static_cast<int64_t>(group_.rank()) * k_;
    grad_full_.narrow(0, 0, begin).zero_();
    grad_full_.narrow(0, begin + k_, padded_numel() - begin - k_).zero_();
    reduced_ = true;
    return;
  }
  reduce_in_ = at::Tensor();
  at::Tensor& g = shard_.mutable_grad();
  if (!g.defined()) {
    if (offloaded()) {  // Note [Offloaded shards]: the gradient lives with its shard
      g = options_.offload_alloc(k_, options_.grad_dtype, /*gradient=*/true);
      g.copy_(reduce_out_);
    } else {
      g = reduce_out_.to(options_.grad_dtype, /*non_blocking=*/false, /*copy=*/true);
    }
  } else {
    g.add_(reduce_out_.to(g.device()));
  }
  for (auto& p : params_) p.mutable_grad().reset();
  interfaces::free_storage(grad_full_);
}

void FlatParam::zero_grad() {
  if (!trainable_) return;
  if (shard_.grad().defined()) shard_.mutable_grad().zero_();
  if (grad_full_.storage().nbytes() > 0) grad_full_.zero_();
  reduced_ = false;
}

std::vector<comm::Work> FlatParam::start_refresh_replicated(int64_t bucket_numel) {
  std::vector<comm::Work> works;
  if (!options_.replicated_params) return works;
  torch::NoGradGuard no_grad;
  // The shard may alias its chunk of `full`: gather from a copy.
  at::Tensor src = shard_.to(full_.device(), full_.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  // A call gathers the same `piece` elements of every rank's chunk.
  const int64_t piece = bucket_numel <= 0 ? k_ : std::clamp<int64_t>(bucket_numel / n_, 1, k_);
  if (piece == k_) {
    works.push_back(group_.all_gather(src, full_));
    return works;
  }
  const at::Tensor chunks = full_.view({n_, k_});
  for (int64_t a = 0; a < k_; a += piece) {
    const int64_t len = std::min(piece, k_ - a);
    at::Tensor gathered = at::empty({n_ * len}, full_.options());
    comm::Work w = group_.all_gather(src.narrow(0, a, len), gathered);
    w.and_then([chunks, gathered, a, len, n = n_]() {
      torch::NoGradGuard guard;
      chunks.narrow(1, a, len).copy_(gathered.view({n, len}));
      return comm::Work();
    });
    works.push_back(std::move(w));
  }
  return works;
}

int64_t FlatParam::param_bytes() const {
  int64_t b = full_bytes();
  if (!shard_is_view_) b += shard_.numel() * shard_.element_size();
  if (device_shard_.defined()) b += static_cast<int64_t>(device_shard_.nbytes());
  return b;
}

int64_t FlatParam::offloaded_bytes() const {
  if (!offloaded()) return 0;
  int64_t b = static_cast<int64_t>(shard_.nbytes());
  if (shard_.grad().defined()) b += static_cast<int64_t>(shard_.grad().nbytes());
  return b;
}

int64_t FlatParam::grad_bytes() const {
  if (!trainable_) return 0;
  int64_t b = static_cast<int64_t>(grad_full_.storage().nbytes());
  if (!options_.keep_full_grads && shard_.grad().defined()) b += shard_.grad().numel() * shard_.grad().element_size();
  return b;
}

}  // namespace scaletrain::parallel::fsdp

#pragma once
// One flat buffer of parameters inside a sharded unit, and this rank's shard
// of it.
//
// Note [Flat parameters]: the parameters of a unit that share a dtype and a
// requires_grad flag are laid out back to back in one 1-D buffer `full`,
// padded to size() * k elements with k = ceil(numel / size()), so every rank's
// shard has the same length and any world size works. Each parameter's data
// becomes a view into `full` once, at construction, and stays that view for
// the life of the model. Resharding does not swap the parameters' data: it
// releases the bytes of `full`'s storage (the storage object survives with
// zero bytes) and unsharding allocates and gathers them again. Autograd saves
// views of weights in forward (linear saves weight.t()); those views share the
// same storage object, so after a re-gather in backward they read the
// gathered values again, and while resharded they hold no memory. This is how
// PyTorch's FSDP frees unsharded parameters (storage resize to 0).
//
// The shard (k elements, the master dtype) is what the optimizer updates. When
// parameters stay replicated (ZeRO-1/2) and the master dtype is the parameter
// dtype, the shard is a view of this rank's chunk of `full`, so no bytes are
// duplicated.
//
// Gradients use the same trick: `grad_full` has the padded layout, each
// parameter's .grad is a view into it while it holds memory, and the reduced
// chunk lands in `grad_shard`, which is the shard's .grad.
//
// Note [Offloaded shards]: with an offload allocator the shard and its
// gradient live off the device (host memory, page-locked when the device is a
// GPU, or a file-backed mapping: ZeRO-Offload, ZeRO-Infinity, FSDP's
// CPUOffload), and the optimizer steps them there. Each reduced gradient
// chunk is copied to the host shard's gradient. What the gathers read differs:
//   - optimizer offload: a device copy of the shard in the parameter dtype is
//     kept between steps (refresh_device_copy() after each optimizer step;
//     ZeRO-1/2's replicated `full` is that copy already);
//   - parameter offload (gather_from_host): nothing of the shard stays on the
//     device; each gather copies the host shard to the device first, and a
//     file-backed shard's pages are read ahead when a neighbouring unit is
//     gathered (read_ahead()), so the copy finds them in memory.
// On a CPU device "host" and "device" are the same memory: the same code runs,
// with host-to-host copies, so CI exercises every path.
//
// Note [FP8 weight gathers] (MS-AMP's O3): a buffer of sharded parameters can
// be gathered as FP8 codes, a quarter of fp32's bytes on the wire. Each
// parameter has one scale, fp8_max / amax of the whole parameter, and every
// rank must cast with it: the amax of a parameter spread over several shards
// is agreed with a MAX all-reduce (the engine does it once per optimizer
// step, for every buffer at once, from fp8_local_amax()). Because the scale
// belongs to the parameter and not to the chunk a rank holds, the gathered
// values do not depend on the world size: a parameter decodes to the same
// values on 1 rank as on 8. The codes arrive in a uint8 buffer and are
// decoded into `full`, which keeps the parameter dtype (compute reads it).
// Gathers that must see the exact values (FullParams: evaluation, export)
// ask for them (start_unshard(exact=true)).
#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/precision/fp8_format.h"

namespace scaletrain::parallel::fsdp {

struct FlatParamOptions {
  // Keep `full` allocated between steps (ZeRO-1/2: only optimizer states and
  // gradients are sharded). Otherwise `full` holds memory only while unsharded.
  bool replicated_params = false;
  // Keep `grad_full` allocated between backward passes (ZeRO-1: gradients are
  // kept whole and reduced once per step, in place: the gradient shard is
  // this rank's chunk of grad_full, so no bytes are duplicated).
  bool keep_full_grads = false;
  // Dtype of the shard the optimizer updates (the fp32 master copy).
  at::ScalarType master_dtype = at::kFloat;
  // Dtype gradients are reduce-scattered in; Undefined = the parameters'
  // (an fp32 reduce of bf16 gradients casts the unit's gradients first).
  at::ScalarType reduce_dtype = at::ScalarType::Undefined;
  // Gradients are reduce-scattered (and all-reduced over HYBRID_SHARD's
  // replicas) as FP8 codes in this format (Note [FP8 on the wire] in
  // precision/fp8.h); needs an fp32 reduce_dtype. Unset: reduce_dtype on the wire.
  std::optional<precision::Fp8Format> fp8_reduce;
  // Note [FP8 weight gathers]: parameters are all-gathered as FP8 codes in
  // this format, each parameter with its own scale (set_fp8_amax()); unset:
  // in the parameter dtype.
  std::optional<precision::Fp8Format> fp8_gather;
  // Dtype of the gradient shard; Undefined = master_dtype (fp16 masters keep
  // fp32 gradients, whose small values fp16 would flush to zero).
  at::ScalarType grad_dtype = at::ScalarType::Undefined;
  // Note [Offloaded shards]: allocates `numel` elements of `dtype` off the
  // device for the shard, or for its gradient (`gradient`: never a file);
  // null keeps them beside the parameters.
  std::function<at::Tensor(int64_t numel, at::ScalarType dtype, bool gradient)> offload_alloc;
  // With offload_alloc: keep no device copy of the shard; gathers copy it from the host.
  bool gather_from_host = false;
  // With offload_alloc: read_ahead() asks the kernel for the shard's pages (file-backed shards).
  bool read_ahead = false;
  // Reduce-scatters run here: the buffer's ranks over a second communicator,
  // so they never interleave with its gathers (Note [Unit order] in fsdp.h).
  // Null: the buffer's own group.
  comm::Group* reduce_group = nullptr;
  // The averaged gradient is multiplied by this before it is sent (an
  // expert's: 1 / ep, Note [Experts in the sharded engine] in fsdp.h).
  double grad_scale = 1.0;
};

// The part of one parameter that lies in this rank's shard: elements
// [param_offset, param_offset + numel) of the flattened parameter sit at
// [shard_offset, shard_offset + numel) of the shard (checkpoints, resharding).
struct ShardPiece {
  std::string name;
  std::vector<int64_t> shape;  // the whole parameter's shape
  int64_t param_offset = 0;
  int64_t shard_offset = 0;
  int64_t numel = 0;
};

class FlatParam {
 public:
  // `params` share dtype, device and requires_grad; `decay_count` of them, at
  // the front, get weight decay. `group` is the group the buffer is sharded
  // over. `deferred`: the parameters hold no bytes yet (interfaces/deferred.h);
  // their values arrive through load_param().
  FlatParam(std::string unit, std::vector<std::string> names, std::vector<at::Tensor> params, size_t decay_count,
            comm::Group& group, FlatParamOptions options, bool deferred = false);
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  const std::string& unit() const { return unit_; }
  const std::vector<std::string>& names() const { return names_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  bool trainable() const { return trainable_; }
  int64_t numel() const { return numel_; }          // without padding
  int64_t shard_numel() const { return k_; }        // elements per rank
  int64_t padded_numel() const { return k_ * n_; }  // size() * shard_numel()
  // Leading elements of this rank's shard that get weight decay.
  int64_t shard_decay_numel() const;

  // The optimizer's tensor: this rank's chunk, master dtype, .grad = grad shard.
  at::Tensor& shard() { return shard_; }
  bool unsharded() const { return full_bytes() > 0; }

  // The parameters' pieces in this rank's shard, in shard order.
  std::vector<ShardPiece> pieces() const;

  // Deferred initialization: stores the value of params()[i] (whole, any
  // layout) — only the part in this rank's shard when parameters are sharded.
  void load_param(size_t i, const at::Tensor& value);

  // Deferred initialization from a source that can produce any part of a
  // parameter (a memory-mapped file): `fill(name, begin, count, out)` writes
  // elements [begin, begin + count) of the flattened params()[i] into the 1-D
  // `out` (the parameter's dtype). Only this rank's part is asked for when
  // parameters are sharded; the whole parameter when they are replicated.
  using SliceFill = std::function<void(const std::string& name, int64_t begin, int64_t count, at::Tensor& out)>;
  void load_param_slice(size_t i, const SliceFill& fill);

  // Starts gathering `full` from every rank's shard (allocates it first), as
  // FP8 codes with fp8_gather unless `exact` (Note [FP8 weight gathers]).
  // A replicated buffer is always unsharded: nothing to do.
  [[nodiscard]] comm::Work start_unshard(bool exact = false);
  // Note [FP8 weight gathers]: the largest magnitude of each parameter within
  // this rank's shard (0 for one the shard does not hold); after they are
  // reduced with MAX over the group, set_fp8_amax() sets the scales from them.
  bool fp8_gathered() const { return options_.fp8_gather.has_value(); }
  std::vector<double> fp8_local_amax() const;
  void set_fp8_amax(const std::vector<double>& amax);
  const std::vector<double>& fp8_scales() const { return fp8_scales_; }
  at::ScalarType grad_dtype() const { return options_.grad_dtype; }
  // Releases `full`'s bytes (unless replicated).
  void reshard();
  // Offloaded file-backed shards: starts reading the shard's pages into
  // memory ahead of its gather (Note [Offloaded shards]); nothing otherwise.
  void read_ahead() const;
  // Optimizer offload without parameter offload: copies the stepped host
  // shard to its device copy (after every optimizer step, before a gather).
  void refresh_device_copy();
  bool offloaded() const { return static_cast<bool>(options_.offload_alloc); }
  comm::Group& group() const { return group_; }

  // Called from the AccumulateGrad post-hook of params()[i]: makes sure its
  // .grad is the view into grad_full (allocating grad_full if needed).
  void on_grad_ready(size_t i);
  // Reduce-scatters grad_full (averaged over the group) into a scratch shard
  // and, if `replicate` is given, averages that across replicas too. finish_
  // reduce() adds the result to the gradient shard and releases grad_full
  // unless keep_full_grads.
  [[nodiscard]] comm::Work start_reduce(comm::Group* replicate);
  // Bytes of the gradient buffer the reduce in flight sends (padded, in the reduce dtype).
  int64_t reduce_bytes() const { return reduce_in_.defined() ? static_cast<int64_t>(reduce_in_.nbytes()) : 0; }
  void finish_reduce();
  // Sets gradients to zero: the shard's and, if kept, the full buffer.
  void zero_grad();
  // After the optimizer stepped the shards: replicated buffers gather the
  // updated shards back into `full` (the ZeRO-1/2 parameter all-gather), in
  // calls that each move at most `bucket_numel` elements of `full` (0: one
  // call); a call that moves part of every chunk lands in a temporary and is
  // copied into place when waited. Nothing for sharded buffers.
  [[nodiscard]] std::vector<comm::Work> start_refresh_replicated(int64_t bucket_numel = 0);

  // Bytes this buffer holds now: parameters (full and shard when distinct),
  // gradients (full and shard). Optimizer state is counted by the optimizer.
  int64_t param_bytes() const;
  int64_t grad_bytes() const;
  // Of those, the bytes held off the device (the offloaded shard and its gradient).
  int64_t offloaded_bytes() const;

 private:
  int64_t full_bytes() const;
  void alloc_grad_full();
  // The constructor's steps: this rank's master shard from its chunk
  // `mine` of the full buffer, and the gradient buffers of a trainable unit.
  void init_shard(const at::Tensor& mine, bool deferred, const at::TensorOptions& topt);
  void init_grads(const at::TensorOptions& topt);

  std::string unit_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> offsets_;
  int64_t decay_end_ = 0;  // elements of the flat layout that decay
  comm::Group& group_;
  FlatParamOptions options_;
  bool trainable_;
  int n_;
  int64_t numel_ = 0, k_ = 0;
  at::Tensor full_;   // [n*k], parameter dtype; bytes only while unsharded
  at::Tensor shard_;  // [k], master dtype
  at::Tensor device_shard_;  // [k], parameter dtype, on the device: optimizer offload's copy for gathers
  bool shard_is_view_ = false;
  at::Tensor grad_full_;  // [n*k]; bytes only while gradients accumulate
  std::vector<at::Tensor> grad_views_;
  at::Tensor reduce_in_;   // grad_full cast to reduce_dtype while its reduce is in flight
  at::Tensor reduce_out_;  // [k] scratch of the reduce in flight (ZeRO-1: the shard's chunk)
  bool reduced_ = false;   // ZeRO-1: the chunk holds reduced values until zero_grad()
  std::vector<double> fp8_scales_;  // per parameter (Note [FP8 weight gathers])
};

}  // namespace scaletrain::parallel::fsdp

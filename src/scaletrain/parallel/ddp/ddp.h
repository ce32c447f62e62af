#pragma once
// Data parallelism with bucketed gradient all-reduce overlapped with backward.
//
// Construction broadcasts rank 0's parameters and buffers, then lays the
// gradients of the trainable parameters out in flat buckets, in reverse
// registration order (a proxy for the order backward produces them): the
// first bucket is small (first_bucket_cap_bytes) so communication starts early,
// the last ones are small so little is left to send when backward ends (Note
// [Bucket tail]), the rest hold up to bucket_cap_bytes. Each parameter's .grad becomes a view
// into its bucket, so AccumulateGrad writes straight into the buffer that is
// communicated and nothing is copied on the way out or back. After the first
// backward that communicates, the buckets are laid out again in the order the
// gradients actually became ready (Note [Bucket rebuild]).
//
// During backward a post-hook on each parameter's AccumulateGrad node counts
// the bucket's ready gradients; when a bucket is complete it is divided by the
// world size and its all-reduce is started asynchronously, while autograd goes
// on computing the earlier layers. See Note [Bucket order]. A callback queued
// on the autograd engine waits for the outstanding buckets when backward ends,
// so after loss.backward() returns every rank holds the averaged gradients.
//
// Note [Bucket order]: c10d matches collectives by the order they are issued,
// so every rank must start bucket all-reduces in the same order. Buckets are
// started strictly in index order: a bucket that is ready early waits for the
// ones before it. Gradient arrival order may differ between ranks; this order
// does not.
//
// Note [Bucket rebuild]: registration order is only a guess at the order of
// backward. A parameter used in two places is ready only when both
// contributions are in: a token embedding tied to the output head is
// registered first, but its gradient is complete only at the very end of
// backward, after the embedding lookup's backward. Any other parameter that
// shares a bucket with a late gradient waits for it, so a bucket's all-reduce
// should start as soon as its *last* gradient is ready. As PyTorch's DDP does
// (Reducer::rebuild_buckets), the first backward with sync on records the
// order in which gradients become ready (parameters unused in that backward
// under find_unused_parameters come last, in the order they were filled in),
// and when it has finished its all-reduces the buckets are rebuilt once, with
// the same caps, filled in that order. Rank 0's order is broadcast and used by
// every rank, so all ranks keep identical buckets (Note [Bucket order]). The
// gradients just reduced are copied into the new buckets and every .grad
// becomes a view of them, so the optimizer step that follows, and gradient
// accumulation under no_sync in later steps, see no difference. Optimizers
// keep references to parameters, not to .grad, so nothing else changes.
// Measured on a tied-head model with a position table (libtorch 1.13, CPU):
// the observed order is reverse registration up to swapped pairs (a norm's
// weight/bias, the token embedding just before the position embedding), so
// there the rebuild barely moves anything. The tied embedding is ready last
// whatever the layout; the bucket holding it starts at the end of backward,
// and only the caps decide how many earlier gradients wait with it.
//
// Note [Bucket tail]: a bucket's all-reduce cannot start before its last
// gradient is ready, and whatever is still being sent when backward ends is
// time the step waits. The buckets ready last decide that wait: with 25 MiB
// caps the final bucket holds the first blocks and the embeddings, and all of
// it leaves only after the embedding's backward. So the layout is tapered at
// the end as at the start: walking back from the last gradient, buckets hold
// at most last_bucket_cap_bytes (L), then tail_growth (g) times that, and so
// on until bucket_cap_bytes. Say the link sends R bytes/s and backward makes
// P bytes of gradient per second. A tail bucket of size s is sent in s/R; the
// bucket after it, of size s/g, takes s/(g·P) to become ready. When g <= R/P
// each tail bucket has left before the next is ready, and what remains at the
// end is the last bucket alone, L/R. When g > R/P the tail queues, and the
// wait grows towards the largest tail bucket's share. Uniform small buckets
// (g = 1) are the safe limit but cost one collective each; g = 1.5 keeps the
// count low and suits links down to 1.5x the gradient rate. Measured in
// bench/RESULTS.md section 2.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/precision/fp8_format.h"

namespace scaletrain::parallel {

struct DDPOptions {
  // Maximum bytes of gradients in one bucket (PyTorch's default, 25 MiB).
  int64_t bucket_cap_bytes = 25ll << 20;
  // Cap of the first bucket (the last layers' gradients), small so the first
  // all-reduce starts as early as possible in backward.
  int64_t first_bucket_cap_bytes = 1ll << 20;
  // Cap of the last bucket (the first layers' and the embeddings' gradients,
  // ready when backward ends); walking back from it, each bucket may be
  // tail_growth times the one after it, up to bucket_cap_bytes. 0 turns the
  // small tail off. See Note [Bucket tail].
  int64_t last_bucket_cap_bytes = 1ll << 20;
  double tail_growth = 1.5;
  // Parameters that get no gradient in a step are an error unless this is
  // set; then their gradient counts as zero on that rank.
  bool find_unused_parameters = false;
  // Dtype gradients travel in: kFloat (as computed; float64 stays float64),
  // or kBFloat16 to halve the bytes sent
  // (sums are still taken in fp32; see Note [Gloo 1.13 gaps]).
  at::ScalarType comm_dtype = at::kFloat;
  // Gradients travel as FP8 codes in this format with per-chunk scales
  // (Note [FP8 on the wire] in precision/fp8.h; fp32 gradients only); unset: comm_dtype.
  std::optional<precision::Fp8Format> fp8_comm;
  // Rank 0's buffers (BatchNorm's running statistics) on every rank: broadcast
  // with its parameters at construction and again after each synchronized
  // backward, so the next forward starts from rank 0's, as PyTorch's
  // broadcast_buffers does before each forward (a C++ module has no forward
  // hook; rank 0's buffers do not change between a backward and the next
  // forward). false: each rank keeps its own after construction.
  bool broadcast_buffers = true;
  // Rebuild the buckets once, after the first backward with sync on, in the
  // order gradients became ready (on rank 0) instead of reverse registration
  // order. See Note [Bucket rebuild].
  bool rebuild_buckets = true;
  // Each parameter's .grad is its place in its bucket (no copies; the
  // trainer's setting): the bucket's memory, but not an autograd view, so
  // libtorch's Optimizer::zero_grad() (which detach_()es every .grad) works
  // on it. The default, as PyTorch's gradient_as_bucket_view=False, keeps
  // .grad a tensor of its own: it is copied into its bucket when ready and
  // the average copied back when backward ends. Either way both zero_grad()s
  // work.
  bool gradient_as_bucket_view = false;
  // Expert parallelism (parallel/expert, Note [Expert parallelism]): the
  // parameters `expert_param` selects are averaged over `expert_group` (the
  // ranks that hold the same experts) instead of the engine's group, in
  // buckets of their own, and start from that group's first rank.
  std::function<bool(const std::string& name)> expert_param;
  comm::Group* expert_group = nullptr;
  // An expert's local gradient already sums the contributions of every rank
  // of its ep group (their tokens came to it), where the other gradients
  // hold this rank's alone: expert buckets are multiplied by this (1 / ep)
  // before their average, so both end as the mean over all data-parallel ranks.
  double expert_scale = 1.0;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::Group& group, DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // While a NoSync lives, backward accumulates gradients locally and
  // communicates nothing; the next backward outside it reduces the sum (the
  // gradient-accumulation pattern: no_sync for micro-batches 1..k-1).
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // Zeroes every gradient (set_to_none: drops it; the next backward brings
  // it back). Keeps the bucket views under gradient_as_bucket_view, where
  // torch::optim's own zero_grad() cannot be used.
  void zero_grad(bool set_to_none = true);

  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  const DDPOptions& options() const { return options_; }
  // Whether a live DDP reduces `param`'s gradient: the other engines refuse
  // such a parameter (a module wrapped twice).
  static bool reduces(const at::Tensor& param);
  int num_buckets() const;
  // Whether the buckets have been rebuilt in the observed gradient order.
  bool buckets_rebuilt() const;
  // Parameter names in each bucket, in bucket order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_layout() const;
  // Milliseconds backward spent blocked on communication, and bytes handed to
  // all-reduce, since the last call to reset_stats().
  double comm_wait_ms() const;
  int64_t bytes_reduced() const;
  void reset_stats();

  struct State;  // shared with the autograd hooks (see ddp.cpp)

 private:
  std::shared_ptr<torch::nn::Module> module_;
  DDPOptions options_;
  std::shared_ptr<State> state_;
};

}  // namespace scaletrain::parallel

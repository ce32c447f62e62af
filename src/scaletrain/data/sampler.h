#pragma once
// DistributedSampler: which dataset samples each rank and micro-batch trains on.
//
// Note [Sampler invariant]
// The GLOBAL order of samples depends only on (seed, global batch size), never
// on the data-parallel world size or the micro-batch size. This is what makes
// every parallel layout comparable with a single-process run on the full batch
// (DESIGN.md, "The invariant"), and what lets a run stopped on 4 ranks resume
// on 2 and continue the same loss curve.
//
// Construction:
//   * Epoch e is a permutation of [0, num_samples), a Fisher-Yates shuffle
//     driven by std::mt19937_64 seeded from (seed, e). The bounded draw is our
//     own (rejection sampling) because std::uniform_int_distribution's
//     algorithm is unspecified and differs between libstdc++ and libc++; the
//     engine's output sequence, by contrast, is fixed by the standard.
//   * The global stream is epoch 0's permutation, then epoch 1's, and so on.
//     A global batch may straddle an epoch boundary; it simply takes the end of
//     one permutation and the start of the next.
//   * Global step s consumes stream positions [s*G, (s+1)*G), G = global batch.
//   * Data-parallel rank r of D takes the contiguous slice [r*G/D, (r+1)*G/D)
//     of that global batch, and its micro-batch k of size m takes the
//     sub-slice [k*m, (k+1)*m) of the rank's slice.
// Concatenating all ranks' slices, and within a rank all micro-batches in
// order, therefore reproduces global_batch(s) exactly, for any valid (D, m).
//
// The sampler is stateless given the step: there is no iterator position to
// checkpoint, only the step counter the trainer already saves. Resuming at
// step k, on any world size and micro-batch size, continues the same order.
// (Changing the seed or G changes the order; a resume must keep both.)
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace scaletrain::data {

struct SamplerOptions {
  // Base seed of the shuffle. Part of the run's identity: keep it on resume.
  uint64_t seed = 0;
  // Samples per optimizer step summed over all data-parallel ranks (G). Part
  // of the run's identity: keep it on resume. Must be >= 1.
  int64_t global_batch = 1;
  // If false, every epoch is the identity order 0..num_samples-1 (debugging,
  // and exact comparison against an unshuffled reference). The invariant
  // holds either way.
  bool shuffle = true;
};

class DistributedSampler {
 public:
  // Throws UsageError if num_samples < 1 or global_batch < 1.
  DistributedSampler(int64_t num_samples, SamplerOptions options);

  int64_t num_samples() const { return num_samples_; }
  int64_t global_batch_size() const { return options_.global_batch; }
  const SamplerOptions& options() const { return options_; }

  // Throws UsageError unless G % dp_size == 0 and (G / dp_size) % micro_size
  // == 0 (message names G, D and m). The trainer calls this once at start-up
  // so a bad layout fails before any work; indices() re-checks anyway.
  void validate_layout(int dp_size, int micro_size) const;

  // Number of micro-batches each rank runs per step: G / dp_size / micro_size.
  int64_t micro_batches_per_step(int dp_size, int micro_size) const;

  // The G sample indices of global step `step` (>= 0), in stream order.
  std::vector<int64_t> global_batch(int64_t step) const;

  // The micro_size sample indices that rank dp_rank (of dp_size) trains on in
  // micro-batch micro_index of step `step`. Throws UsageError for an invalid
  // layout or an out-of-range rank, micro index, or negative step.
  std::vector<int64_t> indices(int64_t step, int dp_rank, int dp_size, int micro_index,
                               int micro_size) const;

  // Epoch e's full permutation of [0, num_samples) (>= 0). Exposed for tests
  // and tools; training code should use indices().
  std::vector<int64_t> epoch_order(int64_t epoch) const;

  // The epoch that the first sample of `step` comes from (for logging).
  int64_t epoch_of_step(int64_t step) const;

 private:
  using Permutation = std::shared_ptr<const std::vector<int64_t>>;

  // Fills `out` with stream positions [begin, begin + count).
  void stream_slice(int64_t begin, int64_t count, std::vector<int64_t>& out) const;
  // Epoch e's permutation, from a small cache. Building one costs O(N) time
  // and 8*N bytes, and every micro-batch of a step (and often many steps) hits
  // the same epoch, so the last two epochs built are kept (two because a
  // global batch may straddle an epoch boundary).
  Permutation permutation(int64_t epoch) const;
  std::vector<int64_t> build_permutation(int64_t epoch) const;
  void check_step(int64_t step) const;

  int64_t num_samples_;
  SamplerOptions options_;

  // The cache is not part of the logical state: results are a pure function
  // of the arguments. The mutex makes const methods safe to call from the
  // trainer's data-loading threads concurrently.
  mutable std::mutex cache_mutex_;
  mutable int64_t cached_epoch_[2] = {-1, -1};
  mutable Permutation cached_perm_[2];
  mutable int cache_next_ = 0;  // slot to overwrite on the next miss
};

}  // namespace scaletrain::data

#include "scaletrain/data/sampler.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include "scaletrain/util/error.h"

namespace scaletrain::data {
namespace {

// SplitMix64 finalizer: a bijective mix with good avalanche. Used to turn
// (seed, epoch) into an engine seed so that nearby seeds and consecutive
// epochs give unrelated streams (seeding mt19937_64 with seed + epoch
// directly would make (seed=1, epoch=0) and (seed=0, epoch=1) identical).
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform draw from [0, bound), bound >= 1, with no modulo bias: reject raw
// values below 2^64 mod bound, so the accepted range is an exact multiple of
// bound. The expected number of draws is below 2 for any bound. Written by
// hand because std::uniform_int_distribution differs across standard
// libraries (see Note [Sampler invariant]).
uint64_t bounded(std::mt19937_64& gen, uint64_t bound) {
  // (2^64 - bound) % bound == 2^64 % bound, computed without 128-bit math.
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = gen();
    if (r >= threshold) return r % bound;
  }
}

std::string layout_text(int64_t g, int d, int m) {
  return "global batch G=" + std::to_string(g) + ", data-parallel size D=" + std::to_string(d) +
         ", micro-batch size m=" + std::to_string(m);
}

}  // namespace

DistributedSampler::DistributedSampler(int64_t num_samples, SamplerOptions options)
    : num_samples_(num_samples), options_(options) {
  if (num_samples_ < 1) {
    throw UsageError("sampler: dataset has " + std::to_string(num_samples_) +
                     " samples; need at least 1");
  }
  if (options_.global_batch < 1) {
    throw UsageError("sampler: global batch must be >= 1, got " +
                     std::to_string(options_.global_batch));
  }
}

void DistributedSampler::validate_layout(int dp_size, int micro_size) const {
  const int64_t g = options_.global_batch;
  if (dp_size < 1 || micro_size < 1) {
    throw UsageError("sampler: " + layout_text(g, dp_size, micro_size) +
                     ": D and m must both be >= 1");
  }
  if (g % dp_size != 0) {
    throw UsageError("sampler: " + layout_text(g, dp_size, micro_size) +
                     ": G is not divisible by D");
  }
  if ((g / dp_size) % micro_size != 0) {
    throw UsageError("sampler: " + layout_text(g, dp_size, micro_size) +
                     ": the per-rank batch G/D=" + std::to_string(g / dp_size) +
                     " is not divisible by m");
  }
}

int64_t DistributedSampler::micro_batches_per_step(int dp_size, int micro_size) const {
  validate_layout(dp_size, micro_size);
  return options_.global_batch / dp_size / micro_size;
}

void DistributedSampler::check_step(int64_t step) const {
  const int64_t g = options_.global_batch;
  // (step + 1) * G must fit in int64 for the last stream position.
  const int64_t max_step = std::numeric_limits<int64_t>::max() / g - 1;
  if (step < 0 || step > max_step) {
    throw UsageError("sampler: step " + std::to_string(step) + " is outside [0, " +
                     std::to_string(max_step) + "]");
  }
}

std::vector<int64_t> DistributedSampler::global_batch(int64_t step) const {
  check_step(step);
  std::vector<int64_t> out;
  stream_slice(step * options_.global_batch, options_.global_batch, out);
  return out;
}

std::vector<int64_t> DistributedSampler::indices(int64_t step, int dp_rank, int dp_size,
                                                 int micro_index, int micro_size) const {
  validate_layout(dp_size, micro_size);
  check_step(step);
  if (dp_rank < 0 || dp_rank >= dp_size) {
    throw UsageError("sampler: data-parallel rank " + std::to_string(dp_rank) +
                     " is outside [0, " + std::to_string(dp_size) + ")");
  }
  const int64_t per_rank = options_.global_batch / dp_size;
  const int64_t micros = per_rank / micro_size;
  if (micro_index < 0 || micro_index >= micros) {
    throw UsageError("sampler: micro-batch index " + std::to_string(micro_index) +
                     " is outside [0, " + std::to_string(micros) + ") for " +
                     layout_text(options_.global_batch, dp_size, micro_size));
  }
  const int64_t begin = step * options_.global_batch + dp_rank * per_rank +
                        static_cast<int64_t>(micro_index) * micro_size;
  std::vector<int64_t> out;
  stream_slice(begin, micro_size, out);
  return out;
}

std::vector<int64_t> DistributedSampler::epoch_order(int64_t epoch) const {
  if (epoch < 0) throw UsageError("sampler: epoch " + std::to_string(epoch) + " is negative");
  return *permutation(epoch);
}

int64_t DistributedSampler::epoch_of_step(int64_t step) const {
  check_step(step);
  return step * options_.global_batch / num_samples_;
}

void DistributedSampler::stream_slice(int64_t begin, int64_t count,
                                      std::vector<int64_t>& out) const {
  out.clear();
  out.reserve(static_cast<std::size_t>(count));
  int64_t pos = begin;
  const int64_t end = begin + count;
  while (pos < end) {
    const int64_t epoch = pos / num_samples_;
    const int64_t offset = pos % num_samples_;
    const int64_t take = std::min(end - pos, num_samples_ - offset);
    const Permutation perm = permutation(epoch);
    out.insert(out.end(), perm->begin() + offset, perm->begin() + offset + take);
    pos += take;
  }
}

DistributedSampler::Permutation DistributedSampler::permutation(int64_t epoch) const {
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    for (int i = 0; i < 2; ++i) {
      if (cached_epoch_[i] == epoch) return cached_perm_[i];
    }
  }
  // Build outside the lock: it is O(N), and two threads racing to build the
  // same epoch just produce identical vectors.
  auto perm = std::make_shared<const std::vector<int64_t>>(build_permutation(epoch));
  std::lock_guard<std::mutex> lock(cache_mutex_);
  for (int i = 0; i < 2; ++i) {
    if (cached_epoch_[i] == epoch) return cached_perm_[i];  // another thread won
  }
  cached_epoch_[cache_next_] = epoch;
  cached_perm_[cache_next_] = perm;
  cache_next_ ^= 1;
  return perm;
}

std::vector<int64_t> DistributedSampler::build_permutation(int64_t epoch) const {
  std::vector<int64_t> perm(static_cast<std::size_t>(num_samples_));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  if (!options_.shuffle) return perm;
  std::mt19937_64 gen(splitmix64(splitmix64(options_.seed) ^ static_cast<uint64_t>(epoch)));
  // Fisher-Yates, from the back: position i gets a uniform pick of [0, i].
  for (int64_t i = num_samples_ - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(bounded(gen, static_cast<uint64_t>(i) + 1));
    std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(j)]);
  }
  return perm;
}

}  // namespace scaletrain::data

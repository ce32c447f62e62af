#pragma once
// A weighted mixture of datasets (data.mixture).
//
// Note [Mixture]
// The mixture has as many samples as its datasets together, N = sum n_k, and
// its sample i is a fixed sample of one dataset, decided once from the
// weights and the seed alone, as Megatron's blended datasets do:
//   * which dataset: the one whose share is most behind its weight, i.e. the
//     largest w_k * (i + 1) - (samples of k among the first i); ties go to the
//     first. Any stretch of the mixture then holds each dataset within one
//     sample of its weight;
//   * which of its samples: the c-th time dataset k is chosen it gives sample
//     perm_k[c mod n_k], perm_k a Fisher-Yates shuffle of its n_k samples by
//     std::mt19937_64 seeded from (seed, k). A dataset weighted above its
//     share of N repeats, one below it gives a fixed random subset.
// The DistributedSampler then orders [0, N) as it orders any dataset (Note
// [Sampler invariant]), so the mixture keeps every guarantee of one dataset:
// the same order for any layout, exact resume, elastic world sizes. Changing
// a weight, a dataset or the seed changes the mixture; a resume must keep them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/data/dataset.h"

namespace scaletrain::data {

struct MixturePart {
  std::string path;
  double weight = 0;
};

// "PATH=WEIGHT,PATH=WEIGHT" (a YAML list arrives joined by commas) into
// parts. Throws UsageError naming the entry for a missing '=', a weight
// that is not a finite positive number, or a path given twice.
std::vector<MixturePart> parse_mixture(const std::string& spec);

class Mixture : public SampleSource {
 public:
  // The datasets (all of one vocabulary, opened with the same options) and
  // their weights (> 0, any scale). Throws UsageError otherwise.
  Mixture(std::vector<std::unique_ptr<TokenDataset>> parts, std::vector<double> weights, uint64_t seed);

  int64_t num_samples() const override { return static_cast<int64_t>(index_.size()); }
  uint32_t vocab() const override { return parts_.front()->vocab(); }
  void copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const override;
  void copy_layout(const std::vector<int64_t>& indices, int64_t* segments, int64_t* positions) const override;
  int64_t count_targets(const std::vector<int64_t>& indices) const override;
  std::string describe() const override;

  // Which dataset and which of its samples mixture sample i is (tests, tools).
  std::pair<std::size_t, int64_t> locate(int64_t i) const;

 private:
  std::vector<std::unique_ptr<TokenDataset>> parts_;
  std::vector<double> weights_;  // normalized to sum 1
  // Per mixture sample: dataset in the top 8 bits, its sample in the rest.
  std::vector<uint64_t> index_;
};

}  // namespace scaletrain::data

// A weighted mixture of datasets (mixture.h, Note [Mixture]).
#include "scaletrain/data/mixture.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <stdexcept>

#include "scaletrain/util/error.h"

namespace scaletrain::data {
namespace {

constexpr int kPartBits = 8;  // up to 256 datasets
constexpr uint64_t kSampleMask = (uint64_t{1} << (64 - kPartBits)) - 1;

// A uniform draw in [0, n) from the engine by rejection (the standard's
// distributions differ between libraries; the engine's output does not).
uint64_t draw(std::mt19937_64& rng, uint64_t n) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = rng();
  while (x >= limit);
  return x % n;
}

std::vector<int64_t> shuffled(int64_t n, uint64_t seed, std::size_t part) {
  std::vector<int64_t> p(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = i;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + part + 1);
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(p[static_cast<std::size_t>(i)], p[draw(rng, static_cast<uint64_t>(i) + 1)]);
  return p;
}

}  // namespace

std::vector<MixturePart> parse_mixture(const std::string& spec) {
  std::vector<MixturePart> out;
  std::set<std::string> seen;
  double total = 0;
  std::size_t at = 0;
  while (at <= spec.size()) {
    std::size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string entry = spec.substr(at, end - at);
    at = end + 1;
    const std::size_t eq = entry.rfind('=');
    if (eq == std::string::npos || eq == 0) throw UsageError("data.mixture entry '" + entry + "' is not PATH=WEIGHT");
    MixturePart part{entry.substr(0, eq), 0};
    const std::string w = entry.substr(eq + 1);
    char* stop = nullptr;
    part.weight = std::strtod(w.c_str(), &stop);
    if (w.empty() || *stop != '\0' || !std::isfinite(part.weight) || part.weight <= 0)
      throw UsageError("data.mixture entry '" + entry + "': the weight must be a finite number > 0, got '" + w + "'");
    if (!std::isnormal(part.weight))  // a denormal share is lost when the weights are normalised
      throw UsageError("data.mixture entry '" + entry + "': the weight " + w + " is denormal; scale the weights up");
    total += part.weight;
    if (!std::isfinite(total))
      throw UsageError("data.mixture: the weights overflow when summed (at '" + entry + "'); scale them down");
    if (!seen.insert(part.path).second) throw UsageError("data.mixture names " + part.path + " twice");
    out.push_back(part);
  }
  return out;
}

Mixture::Mixture(std::vector<std::unique_ptr<TokenDataset>> parts, std::vector<double> weights, uint64_t seed)
    : parts_(std::move(parts)), weights_(std::move(weights)) {
  if (parts_.empty() || parts_.size() != weights_.size() || parts_.size() > (std::size_t{1} << kPartBits))
    throw std::invalid_argument("Mixture: need 1 to 256 datasets, one weight each");
  double total = 0;
  int64_t n = 0;
  for (std::size_t k = 0; k < parts_.size(); ++k) {
    if (!(weights_[k] > 0) || !std::isnormal(weights_[k]))
      throw UsageError("data.mixture: the weight of " + parts_[k]->path() + " must be a finite, normal number > 0");
    if (parts_[k]->vocab() != parts_.front()->vocab())
      throw UsageError("data.mixture: " + parts_[k]->path() + " has vocabulary " + std::to_string(parts_[k]->vocab()) +
                       ", " + parts_.front()->path() + " has " + std::to_string(parts_.front()->vocab()));
    total += weights_[k];
    n += parts_[k]->num_samples();
  }
  if (!std::isfinite(total)) throw UsageError("data.mixture: the weights overflow when summed; scale them down");
  for (double& w : weights_) w /= total;
  std::vector<std::vector<int64_t>> perm;
  for (std::size_t k = 0; k < parts_.size(); ++k) perm.push_back(shuffled(parts_[k]->num_samples(), seed, k));
  std::vector<int64_t> taken(parts_.size(), 0);
  index_.reserve(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::size_t best = 0;
    double behind = -1e300;
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      const double gap = weights_[k] * static_cast<double>(i + 1) - static_cast<double>(taken[k]);
      if (gap > behind) {
        behind = gap;
        best = k;
      }
    }
    const auto& p = perm[best];
    const int64_t sample = p[static_cast<std::size_t>(taken[best] % static_cast<int64_t>(p.size()))];
    index_.push_back((static_cast<uint64_t>(best) << (64 - kPartBits)) | static_cast<uint64_t>(sample));
    ++taken[best];
  }
}

std::pair<std::size_t, int64_t> Mixture::locate(int64_t i) const {
  if (i < 0 || i >= num_samples())
    throw std::out_of_range("Mixture: sample " + std::to_string(i) + " outside [0, " + std::to_string(num_samples()) +
                            ")");
  const uint64_t v = index_[static_cast<std::size_t>(i)];
  return {static_cast<std::size_t>(v >> (64 - kPartBits)), static_cast<int64_t>(v & kSampleMask)};
}

void Mixture::copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const {
  const int64_t block = parts_.front()->block_size();
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const auto [k, sample] = locate(indices[row]);
    const int64_t offset = static_cast<int64_t>(row) * block;
    parts_[k]->copy_sample(sample, inputs ? inputs + offset : nullptr, targets ? targets + offset : nullptr);
  }
}

void Mixture::copy_layout(const std::vector<int64_t>& indices, int64_t* segments, int64_t* positions) const {
  const int64_t block = parts_.front()->block_size();
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const auto [k, sample] = locate(indices[row]);
    const int64_t offset = static_cast<int64_t>(row) * block;
    parts_[k]->copy_sample_layout(sample, segments ? segments + offset : nullptr,
                                  positions ? positions + offset : nullptr);
  }
}

int64_t Mixture::count_targets(const std::vector<int64_t>& indices) const {
  int64_t n = 0;
  for (int64_t i : indices) {
    const auto [k, sample] = locate(i);
    n += parts_[k]->count_targets({sample});
  }
  return n;
}

std::string Mixture::describe() const {
  std::string out =
      "a mixture of " + std::to_string(parts_.size()) + " datasets (" + std::to_string(num_samples()) + " samples):";
  for (std::size_t k = 0; k < parts_.size(); ++k) {
    char w[32];
    std::snprintf(w, sizeof w, "%.3g", weights_[k]);
    out += std::string(k ? ";" : "") + " weight " + w + " " + parts_[k]->describe();
  }
  return out;
}

}  // namespace scaletrain::data

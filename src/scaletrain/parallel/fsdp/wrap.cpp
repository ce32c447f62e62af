#include "scaletrain/parallel/fsdp/wrap.h"

#include <stdexcept>

namespace scaletrain::parallel::fsdp {
namespace {

// Note [Backward buckets] in wrap.h. Blocks are taken in backward order
// (j = 0 is the last block); returns units in forward order.
template <typename NameOf>
std::vector<UnitPlan> bucket_units(const std::vector<int64_t>& block_numel, const WrapOptions& o, NameOf name_of) {
  if (o.min_num_params <= 0 || o.first_bucket_numel <= 0 || o.last_bucket_numel < 0 || !(o.tail_growth >= 1))
    throw std::invalid_argument(
        "wrap policy: bucket caps must be positive (the last may be 0) and tail_growth at least 1");
  const auto n = static_cast<int64_t>(block_numel.size());
  auto size_at = [&](int64_t j) { return block_numel[static_cast<size_t>(n - 1 - j)]; };
  // The first unit stays out of the tail, as DDP's first bucket does.
  int64_t first_end = 0;
  for (int64_t acc = 0; first_end < n && (first_end == 0 || acc < o.first_bucket_numel); ++first_end)
    acc += size_at(first_end);
  // The tail, walking back from the last block backward reaches (block 0).
  std::vector<int64_t> tail;  // blocks per tail unit, the very last first
  int64_t head_end = n;
  if (o.last_bucket_numel > 0) {
    double cap = static_cast<double>(o.last_bucket_numel);
    int64_t acc = 0;
    while (head_end > first_end && cap < static_cast<double>(o.min_num_params)) {
      const int64_t k = size_at(head_end - 1);
      if (!tail.empty() && tail.back() > 0 && static_cast<double>(acc + k) > cap) {
        cap *= o.tail_growth;
        acc = 0;
        if (cap >= static_cast<double>(o.min_num_params)) break;
        tail.push_back(0);
      }
      if (tail.empty()) tail.push_back(0);
      ++tail.back();
      acc += k;
      --head_end;
    }
  }
  // The rest from the front: each unit closes once it reaches its cap.
  std::vector<int64_t> counts;  // blocks per unit, in backward order
  for (int64_t j = 0, acc = 0; j < head_end; ++j) {
    const int64_t cap = counts.size() <= 1 ? o.first_bucket_numel : o.min_num_params;
    if (counts.empty() || acc >= cap) {
      counts.push_back(0);
      acc = 0;
    }
    ++counts.back();
    acc += size_at(j);
  }
  counts.insert(counts.end(), tail.rbegin(), tail.rend());
  std::vector<UnitPlan> units;
  int64_t last = n - 1;  // the highest block not yet in a unit
  for (int64_t c : counts) {
    units.push_back({name_of(last - c + 1, last), last - c + 1, last});
    last -= c;
  }
  return {units.rbegin(), units.rend()};
}

}  // namespace

std::vector<UnitPlan> plan_units(const interfaces::Blockwise& model, const std::vector<int64_t>& block_numel,
                                 const WrapOptions& options) {
  const int64_t n = model.num_blocks();
  if (static_cast<int64_t>(block_numel.size()) != n) throw std::invalid_argument("plan_units: one count per block");
  auto name_of = [&](int64_t a, int64_t b) {
    std::string first = model.block_prefix(a), last = model.block_prefix(b);
    first.pop_back();
    last.pop_back();
    return a == b ? first : first + "-" + last;
  };
  std::vector<UnitPlan> units;
  switch (options.policy) {
    case WrapPolicy::None:
      return units;
    case WrapPolicy::Transformer:
      if (!options.layer_cls.empty() && options.layer_cls != model.block_class())
        throw std::invalid_argument("wrap policy: the model has no layer class '" + options.layer_cls +
                                    "' (its blocks are '" + model.block_class() + "')");
      for (int64_t i = 0; i < n; ++i) units.push_back({name_of(i, i), i, i});
      return units;
    case WrapPolicy::Size: {
      if (options.min_num_params <= 0) throw std::invalid_argument("wrap policy: min_num_params must be positive");
      int64_t first = 0, acc = 0;
      for (int64_t i = 0; i < n; ++i) {
        acc += block_numel[i];
        if (acc >= options.min_num_params) {
          units.push_back({name_of(first, i), first, i});
          first = i + 1;
          acc = 0;
        }
      }
      return units;  // blocks [first, n) stay in the root unit
    }
    case WrapPolicy::Buckets:
      return bucket_units(block_numel, options, name_of);
  }
  return units;
}

WrapPolicy parse_wrap_policy(const std::string& s) {
  if (s == "transformer") return WrapPolicy::Transformer;
  if (s == "size") return WrapPolicy::Size;
  if (s == "none") return WrapPolicy::None;
  throw std::invalid_argument("unknown wrap policy '" + s + "' (transformer | size | none)");
}

}  // namespace scaletrain::parallel::fsdp

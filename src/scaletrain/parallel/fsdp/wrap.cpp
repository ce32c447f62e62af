#include "scaletrain/parallel/fsdp/wrap.h"

#include <stdexcept>

namespace scaletrain::parallel::fsdp {

std::vector<UnitPlan> plan_units(const models::Blockwise& model, const std::vector<int64_t>& block_numel,
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
      if (options.layer_cls != model.block_class())
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

#include "scaletrain/parallel/fsdp/module_units.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>

namespace scaletrain::parallel::fsdp {

namespace {

int64_t numel_of(const torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

std::string listed(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < 8; ++i) out += (i ? ", " : "") + items[i];
  if (items.size() > 8) out += ", ...";
  return out.empty() ? "none" : out;
}

// Size policy: children first; a module becomes a unit when no descendant did
// and it holds at least `min` parameters. Returns whether `m` or a
// descendant became one.
bool choose_by_size(const torch::nn::Module& m, const std::string& name, int64_t min, std::set<std::string>& out) {
  bool below = false;
  for (auto& child : m.named_children())
    below |= choose_by_size(*child.value(), name.empty() ? child.key() : name + "." + child.key(), min, out);
  if (below || name.empty() || numel_of(m) < min) return below;
  out.insert(name);
  return true;
}

// A type given as "BasicBlockImpl" matches "my::ns::BasicBlockImpl" too.
bool type_matches(const std::string& name, const std::string& type) {
  return name == type || (name.size() > type.size() + 2 && name.compare(name.size() - type.size(), type.size(), type) == 0 &&
                          name.compare(name.size() - type.size() - 2, 2, "::") == 0);
}

}  // namespace

std::vector<std::string> select_units(const torch::nn::Module& module, const ModuleUnits& units) {
  auto modules = module.named_modules("", /*include_self=*/false);
  std::map<std::string, size_t> order;  // name -> registration (pre-order) index
  std::vector<std::string> all_names, all_types;
  for (size_t i = 0; i < modules.size(); ++i) {
    order[modules[i].key()] = i;
    all_names.push_back(modules[i].key());
    if (std::find(all_types.begin(), all_types.end(), modules[i].value()->name()) == all_types.end())
      all_types.push_back(modules[i].value()->name());
  }
  std::set<std::string> chosen;
  for (const std::string& n : units.names) {
    auto it = order.find(n);
    if (it == order.end())
      throw std::invalid_argument("fully_shard: the module has no submodule '" + n + "' (submodules: " +
                                  listed(all_names) + ")");
    if (numel_of(*modules[it->second].value()) == 0)
      throw std::invalid_argument("fully_shard: unit '" + n + "' holds no parameters");
    chosen.insert(n);
  }
  for (const std::string& t : units.types) {
    bool found = false;
    for (auto& item : modules)
      if (type_matches(item.value()->name(), t)) {
        found = true;
        if (numel_of(*item.value()) > 0) chosen.insert(item.key());
      }
    if (!found)
      throw std::invalid_argument("fully_shard: no submodule is of type '" + t + "' (types: " + listed(all_types) +
                                  ")");
  }
  if (units.min_num_params < 0) throw std::invalid_argument("fully_shard: min_num_params must be >= 0");
  if (units.min_num_params > 0) choose_by_size(module, "", units.min_num_params, chosen);

  std::vector<std::string> out(chosen.begin(), chosen.end());
  std::sort(out.begin(), out.end(), [&](const std::string& a, const std::string& b) { return order[a] < order[b]; });
  for (const std::string& a : out)
    for (const std::string& b : out)
      if (b.size() > a.size() && b.compare(0, a.size() + 1, a + ".") == 0)
        throw std::invalid_argument("fully_shard: units nest: '" + b + "' lies inside '" + a +
                                    "'; choose one of them");
  const bool asked = !units.names.empty() || !units.types.empty() || units.min_num_params > 0;
  if (asked && out.empty())
    throw std::invalid_argument("fully_shard: the wrap policy chose no submodule with parameters (min_num_params " +
                                std::to_string(units.min_num_params) + ", the module holds " +
                                std::to_string(numel_of(module)) + ")");
  return out;
}

}  // namespace scaletrain::parallel::fsdp

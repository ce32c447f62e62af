// Note [Checkpointing a user's module] (module_checkpointing.h).
#include "scaletrain/train/module_checkpointing.h"

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace scaletrain::train {
namespace {

// The selected submodules, by address, with the policy's options. A weak
// reference guards against a module destroyed and another built at the
// same address: an entry whose module is gone selects nothing.
struct Selected {
  std::weak_ptr<const torch::nn::Module> module;
  models::CheckpointOptions options;
  int64_t uses = 0;  // checkpointed() calls that recomputed it
};
std::mutex g_selected_mu;
std::map<const torch::nn::Module*, Selected>& registry() {
  static std::map<const torch::nn::Module*, Selected> selected;
  return selected;
}

Selected* find(const torch::nn::Module& block, std::lock_guard<std::mutex>&) {
  auto it = registry().find(&block);
  if (it == registry().end()) return nullptr;
  if (it->second.module.lock().get() != &block) {
    registry().erase(it);
    return nullptr;
  }
  return &it->second;
}

bool any_given(const parallel::fsdp::ModuleUnits& u) {
  return !u.types.empty() || !u.names.empty() || u.min_num_params > 0;
}

}  // namespace

std::vector<std::string> apply_activation_checkpointing(torch::nn::Module& module, const CheckpointPolicy& policy) {
  if (policy.every < 1)
    throw std::invalid_argument("activation checkpointing: every must be at least 1, got " +
                                std::to_string(policy.every));
  const bool chosen = any_given(policy.blocks);
  if (policy.every > 1 && !chosen)
    throw std::invalid_argument(
        "activation checkpointing: every=" + std::to_string(policy.every) +
        " needs the blocks it counts (CheckpointPolicy::blocks: their class, names or size)");
  std::vector<std::string> names;
  if (chosen) {
    try {
      names = parallel::fsdp::select_units(module, policy.blocks);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("activation checkpointing: ") + e.what());
    }
  }
  std::map<std::string, std::shared_ptr<torch::nn::Module>> by_name;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) by_name[item.key()] = item.value();
  std::vector<std::string> picked;
  std::lock_guard<std::mutex> lock(g_selected_mu);
  auto select = [&](const std::string& name) {
    const std::shared_ptr<torch::nn::Module>& m = by_name.at(name);
    registry()[m.get()] = Selected{m, policy.options};
  };
  if (!chosen) {  // every submodule that calls checkpointed()
    for (const auto& [name, m] : by_name) select(name);
    return {""};
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (i % static_cast<size_t>(policy.every) != 0) {
      registry().erase(by_name.at(names[i]).get());
      continue;
    }
    select(names[i]);
    picked.push_back(names[i]);
  }
  return picked;
}

at::Tensor checkpointed(torch::nn::Module& block, const std::function<at::Tensor(const at::Tensor&)>& body,
                        const at::Tensor& x) {
  models::CheckpointOptions options;
  {
    std::lock_guard<std::mutex> lock(g_selected_mu);
    Selected* s = find(block, lock);
    if (s == nullptr) return body(x);
    options = s->options;
    ++s->uses;
  }
  std::vector<at::Tensor> params;
  for (const auto& p : block.parameters())
    if (p.requires_grad()) params.push_back(p);
  return models::checkpoint(body, x, params, options);
}

bool is_checkpointed(const torch::nn::Module& block) {
  std::lock_guard<std::mutex> lock(g_selected_mu);
  return find(block, lock) != nullptr;
}

int64_t checkpointed_uses(const torch::nn::Module& module) {
  std::vector<const torch::nn::Module*> all{&module};
  for (const auto& m : module.modules(/*include_self=*/false)) all.push_back(m.get());
  std::lock_guard<std::mutex> lock(g_selected_mu);
  int64_t n = 0;
  for (const torch::nn::Module* m : all)
    if (const Selected* s = find(*m, lock)) n += s->uses;
  return n;
}

}  // namespace scaletrain::train

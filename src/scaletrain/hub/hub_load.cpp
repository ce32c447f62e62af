#include "scaletrain/hub/hub_load.h"

#include <set>

#include "scaletrain/util/error.h"
#include "scaletrain/util/strings.h"

namespace scaletrain::hub {
namespace {

// Entries older transformers versions saved that are not parameters.
bool not_a_parameter(const std::string& name) { return util::ends_with(name, "rotary_emb.inv_freq"); }

}  // namespace

void check_hub_weights(const models::CausalLM& model, const hub::HubWeights& hub) {
  const std::string src = "model.init_from " + hub.source();
  std::set<std::string> ours;
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    ours.insert(name);
    if (!hub.has(name)) throw UsageError(src + ": missing tensor '" + name + "'");
    const auto& shape = hub.view(name).shape;
    const auto want = item.value().sizes().vec();
    if (shape != want)
      throw UsageError(src + ": tensor '" + name + "' has shape " + c10::str(c10::IntArrayRef(shape)) +
                       ", the model's is " + c10::str(c10::IntArrayRef(want)));
  }
  for (const auto& name : hub.names())
    if (!ours.count(name) && !not_a_parameter(name))
      throw UsageError(src + ": unexpected tensor '" + name + "' (not a parameter of this " + model.config().family +
                       " model)");
}

void load_hub_weights(models::CausalLM& model, const std::string& path) {
  const hub::HubWeights hub(path);
  check_hub_weights(model, hub);
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) item.value().copy_(hub.read(item.key(), item.value().scalar_type()));
}

interfaces::InitFn hub_init(const models::CausalLM& model, const std::string& path) {
  auto hub = std::make_shared<hub::HubWeights>(path);
  check_hub_weights(model, *hub);
  return [hub](const std::string& name, at::Tensor& out) {
    torch::NoGradGuard no_grad;
    out.copy_(hub->read(name, out.scalar_type()));
  };
}

SliceInitFn hub_slice_init(const models::CausalLM& model, const std::string& path) {
  auto hub = std::make_shared<hub::HubWeights>(path);
  check_hub_weights(model, *hub);
  return [hub](const std::string& name, int64_t begin, int64_t count, at::Tensor& out) {
    hub->read_range(name, begin, count, out);
  };
}

}  // namespace scaletrain::hub

#include "scaletrain/models/lora.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <set>

#include "scaletrain/models/linear.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// FNV-1a: a seed per name that is the same on every platform and run.
uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ULL ^ seed;
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ULL;
  return h;
}

bool deferred(const at::Tensor& t) { return t.numel() > 0 && t.storage().nbytes() == 0; }

}  // namespace

double LoraOptions::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

bool is_adapter_parameter(const std::string& name) {
  return ends_with(name, "lora_A.weight") || ends_with(name, "lora_B.weight");
}

TensorParallelSplit adapter_split(const std::string& name, const TensorParallelSplit& weight) {
  TORCH_CHECK(is_adapter_parameter(name), "scaletrain: '", name, "' is not an adapter parameter");
  const bool a = ends_with(name, "lora_A.weight");
  TensorParallelSplit s;  // replicated
  if (weight.dim == 0) {  // column-parallel
    if (a) s.partial_grad = true;
    else s = {0, weight.blocks, false};
  } else if (weight.dim == 1) {  // row-parallel
    if (a) s = {1, weight.blocks, false};
  }
  return s;
}

void init_adapter(const std::string& name, at::Tensor& out, const LoraOptions& o) {
  torch::NoGradGuard no_grad;
  if (ends_with(name, "lora_B.weight")) {
    out.zero_();
    return;
  }
  TORCH_CHECK(ends_with(name, "lora_A.weight"), "scaletrain: '", name, "' is not an adapter parameter");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(name_seed(o.seed, name));
  // Drawn in fp64 whatever the parameter's dtype, so every dtype starts
  // from the same values rounded.
  at::Tensor v = at::empty(out.sizes(), at::TensorOptions().dtype(at::kDouble));
  if (o.gaussian_init) {
    v.normal_(0.0, 1.0 / static_cast<double>(o.r), gen);
  } else {
    const double bound = 1.0 / std::sqrt(static_cast<double>(out.size(1)));
    v.uniform_(-bound, bound, gen);
  }
  out.copy_(v);
}

interfaces::InitFn with_adapter_init(interfaces::InitFn base, LoraOptions o) {
  return [base = std::move(base), o = std::move(o)](const std::string& name, at::Tensor& out) {
    if (is_adapter_parameter(name))
      init_adapter(name, out, o);
    else
      base(name, out);
  };
}

std::vector<std::string> apply_lora(CausalLM& model, const LoraOptions& o) {
  if (o.r < 1) throw UsageError("finetune.r must be at least 1, got " + std::to_string(o.r));
  if (o.target_modules.empty()) throw UsageError("finetune.target_modules is empty (layer names, or all-linear)");
  const bool all = o.target_modules.size() == 1 && o.target_modules[0] == "all-linear";
  std::set<std::string> wanted(o.target_modules.begin(), o.target_modules.end()), matched;
  if (!all && wanted.count("all-linear"))
    throw UsageError("finetune.target_modules: all-linear stands alone (it already names every linear layer)");

  std::vector<std::pair<std::string, LinearImpl*>> layers;
  std::set<std::string> known;
  for (const auto& item : model.named_modules()) {
    auto* lin = item.value()->as<LinearImpl>();
    if (!lin) continue;
    const std::string& path = item.key();
    const std::string leaf = path.substr(path.rfind('.') == std::string::npos ? 0 : path.rfind('.') + 1);
    known.insert(leaf);
    if (all || wanted.count(leaf)) {
      layers.emplace_back(path, lin);
      matched.insert(leaf);
    }
  }
  if (known.empty()) throw UsageError("finetune: the model has no linear layers to adapt");
  for (const auto& w : wanted)
    if (!all && !matched.count(w)) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      throw UsageError("finetune.target_modules: '" + w + "' names no linear layer of this model (its layers: " +
                       names + ", or all-linear)");
    }

  for (auto& p : model.parameters()) p.requires_grad_(false);
  std::vector<std::string> out;
  for (auto& [path, lin] : layers) {
    const bool later = deferred(lin->quantized() ? lin->weight_nf4 : lin->weight);
    lin->add_adapter(o.r, o.scaling(), o.dropout);
    for (const char* part : {".lora_A.weight", ".lora_B.weight"}) {
      at::Tensor& t = part[6] == 'A' ? lin->lora_A : lin->lora_B;
      if (later)
        interfaces::free_storage(t);
      else
        init_adapter(path + part, t, o);
    }
    out.push_back(path);
  }
  return out;
}

}  // namespace scaletrain::models

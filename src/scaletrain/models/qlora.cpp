#include "scaletrain/models/qlora.h"

#include "scaletrain/models/linear.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {

int64_t quantize_base(CausalLM& model, const precision::NF4Options& o) {
  int64_t n = 0;
  for (const auto& item : model.named_modules()) {
    auto* lin = item.value()->as<LinearImpl>();
    if (!lin) continue;
    lin->quantize(o);
    ++n;
  }
  if (n == 0) throw UsageError("finetune.method qlora: the model has no linear layers to quantize");
  return n;
}

bool is_nf4_parameter(const std::string& name) {
  for (const auto& suffix : nf4_parameter_suffixes())
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        name[name.size() - suffix.size() - 1] == '.')
      return true;
  return false;
}

NF4Source::NF4Source(const CausalLM& model, Read read) : read_(std::move(read)) {
  for (const auto& item : model.named_modules()) {
    const auto* lin = item.value()->as<LinearImpl>();
    if (!lin || !lin->quantized()) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& suffix : nf4_parameter_suffixes())
      layers_[prefix + suffix] = {prefix + "weight",
                                  suffix,
                                  {lin->out_features(), lin->in_features()},
                                  lin->base_dtype(),
                                  lin->nf4_options()};
  }
}

at::Tensor NF4Source::bytes(const std::string& name) {
  auto it = layers_.find(name);
  TORCH_CHECK(it != layers_.end(), "scaletrain: '", name, "' is not an NF4 parameter");
  const Layer& l = it->second;
  if (cached_ != l.weight_name) {
    cached_.clear();
    quantized_ = {};
    at::Tensor w = at::empty(l.shape, at::TensorOptions().dtype(l.dtype));
    read_(l.weight_name, w);
    quantized_ = precision::nf4_quantize(w, l.options);
    cached_ = l.weight_name;
  }
  return nf4_parameter_bytes(quantized_, l.suffix);
}

interfaces::InitFn with_nf4_init(interfaces::InitFn base, const CausalLM& model) {
  auto source = std::make_shared<NF4Source>(model, base);
  return [base = std::move(base), source](const std::string& name, at::Tensor& out) {
    if (source->owns(name))
      out.copy_(source->bytes(name));
    else
      base(name, out);
  };
}

}  // namespace scaletrain::models

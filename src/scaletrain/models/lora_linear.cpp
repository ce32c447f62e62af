// LoraLinear and add_lora_adapters: Note [Adapters in a user's module] in lora_linear.h.
#include "scaletrain/models/lora_linear.h"

#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <ostream>
#include <set>

#include "scaletrain/util/error.h"

namespace scaletrain::models {

LoraLinearImpl::LoraLinearImpl(const torch::nn::LinearOptions& options_) : options(options_) { reset(); }

void LoraLinearImpl::reset() {
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  if (options.bias())
    bias = register_parameter("bias", torch::empty(options.out_features()));
  else
    bias = register_parameter("bias", {}, /*requires_grad=*/false);
  reset_parameters();
}

// The same draws as torch::nn::Linear: a LoraLinear built after the same
// seed holds the same values.
void LoraLinearImpl::reset_parameters() {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const auto fans = torch::nn::init::_calculate_fan_in_and_fan_out(weight);
    const double bound = 1 / std::sqrt(static_cast<double>(std::get<0>(fans)));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

void LoraLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "scaletrain::models::LoraLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias();
  if (has_adapter()) stream << ", r=" << lora_A->weight.size(0) << ", scaling=" << scaling_;
  stream << ")";
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& input) {
  at::Tensor y;
  if (fp8) {  // the bias in the product's dtype, as torch::linear under autocast adds it
    y = fp8->matmul(input, weight);
    if (bias.defined()) y = y + bias.to(y.scalar_type());
  } else {
    y = torch::nn::functional::linear(input, weight, bias);
  }
  if (!has_adapter()) return y;
  const at::Tensor x = dropout_ > 0 ? torch::dropout(input, dropout_, is_training()) : input;
  return y + scaling_ * torch::nn::functional::linear(torch::nn::functional::linear(x, lora_A->weight),
                                                      lora_B->weight);
}

void LoraLinearImpl::add_adapter(const LoraOptions& o, const std::string& path) {
  if (has_adapter()) throw UsageError("LoRA: layer '" + path + "' has an adapter already");
  if (o.r < 1) throw UsageError("LoRA: r must be at least 1, got " + std::to_string(o.r));
  lora_A = register_module("lora_A", LoraFactor(o.r, options.in_features()));
  lora_B = register_module("lora_B", LoraFactor(options.out_features(), o.r));
  for (auto* f : {&lora_A, &lora_B}) {
    auto& w = (*f)->weight;
    {
      torch::NoGradGuard no_grad;
      w.set_data(w.to(weight.device(), weight.scalar_type()));
    }
    init_adapter(path + (f == &lora_A ? ".lora_A.weight" : ".lora_B.weight"), w, o);
  }
  scaling_ = o.scaling();
  dropout_ = o.dropout;
}

namespace {

// Whether `path` is targeted (by name, or by all-linear when `any`), noting the entries used.
bool targeted(const std::string& path, const std::vector<std::string>& targets, bool any, std::set<std::string>& used) {
  bool hit = false;
  for (const std::string& t : targets) {
    const bool match = (t == "all-linear" && any) || path == t ||
                       (path.size() > t.size() && path.compare(path.size() - t.size() - 1, t.size() + 1, "." + t) == 0);
    if (match) {
      used.insert(t);
      hit = true;
    }
  }
  return hit;
}

}  // namespace

std::vector<std::string> add_lora_adapters(torch::nn::Module& module, const LoraOptions& o) {
  if (o.r < 1) throw UsageError("LoRA: r must be at least 1, got " + std::to_string(o.r));
  if (o.target_modules.empty()) throw UsageError("LoRA: no target_modules given (layer names, or all-linear)");
  std::vector<std::string> adapted;
  std::set<std::string> used;
  for (const auto& item : module.named_modules()) {
    const std::string& path = item.key();
    if (auto* layer = dynamic_cast<LoraLinearImpl*>(item.value().get())) {
      if (!targeted(path, o.target_modules, /*any=*/true, used)) continue;
      layer->add_adapter(o, path);
      adapted.push_back(path);
    } else if (dynamic_cast<torch::nn::LinearImpl*>(item.value().get()) &&
               targeted(path, o.target_modules, /*any=*/false, used)) {  // all-linear: the LoraLinears
      throw UsageError("LoRA: '" + path +
                       "' is a torch::nn::Linear, which a C++ module calls through its own field and no function "
                       "can give an adapter from outside: declare it as scaletrain::models::LoraLinear (same "
                       "options and parameter names)");
    }
  }
  for (const std::string& t : o.target_modules)
    if (!used.count(t)) throw UsageError("LoRA: target_modules entry '" + t + "' matches no LoraLinear of the module");
  for (auto& p : module.named_parameters()) p.value().set_requires_grad(is_adapter_parameter(p.key()));
  return adapted;
}

}  // namespace scaletrain::models

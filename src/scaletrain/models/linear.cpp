#include "scaletrain/models/linear.h"

#include <cmath>

namespace scaletrain::models {

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias) {
  // torch::nn::Linear's reset_parameters(): kaiming-uniform with a = sqrt(5)
  // (bound 1/sqrt(in)), then the bias uniform in the same bound.
  weight = register_parameter("weight", torch::empty({out, in}));
  torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (with_bias) {
    bias = register_parameter("bias", torch::empty({out}));
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = torch::linear(x, weight, bias);
  return has_adapter() ? y + adapter(x) : y;
}

torch::Tensor LinearImpl::adapter(const torch::Tensor& x, const std::function<torch::Tensor(const torch::Tensor&)>& middle) {
  if (!has_adapter()) return {};
  const torch::Tensor in = dropout_ > 0 ? torch::dropout(x, dropout_, is_training()) : x;
  torch::Tensor z = torch::linear(in, lora_A);
  if (middle) z = middle(z);
  return torch::linear(z, lora_B) * scaling_;
}

void LinearImpl::add_adapter(int64_t r, double scaling, double dropout) {
  TORCH_CHECK(!has_adapter(), "scaletrain: a layer holds one adapter");
  const auto options = weight.options().requires_grad(true);
  auto a = register_module("lora_A", std::make_shared<torch::nn::Module>());
  auto b = register_module("lora_B", std::make_shared<torch::nn::Module>());
  lora_A = a->register_parameter("weight", torch::zeros({r, weight.size(1)}, options));
  lora_B = b->register_parameter("weight", torch::zeros({weight.size(0), r}, options));
  scaling_ = scaling;
  dropout_ = dropout;
}

}  // namespace scaletrain::models

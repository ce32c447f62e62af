#include "scaletrain/models/linear.h"

#include <cmath>

#include "scaletrain/interfaces/deferred.h"
#include "scaletrain/models/lora_linear.h"

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
  torch::Tensor y;
  if (quantized())
    y = precision::nf4_linear(x, nf4_weight(), bias);
  else if (fp8) {
    // In the product's dtype (the compute dtype), as torch::linear under autocast adds it.
    y = fp8->matmul(x, weight);
    if (bias.defined()) y = y + bias.to(y.scalar_type());
  }
  else
    y = torch::linear(x, weight, bias);
  return has_adapter() ? y + adapter(x) : y;
}

torch::Tensor LinearImpl::product(const torch::Tensor& x) {
  return fp8 ? fp8->matmul(x, weight) : torch::linear(x, weight);
}

std::vector<precision::Fp8LinearPtr> use_fp8(torch::nn::Module& root, const precision::Fp8LinearOptions& o) {
  std::vector<precision::Fp8LinearPtr> out;
  for (const auto& m : root.modules(/*include_self=*/true))
    if (auto* l = m->as<LinearImpl>()) {
      TORCH_CHECK(!l->quantized(), "scaletrain: an NF4 (QLoRA) layer cannot compute in FP8");
      l->fp8 = std::make_shared<precision::Fp8Linear>(o);
      out.push_back(l->fp8);
    } else if (auto* u = m->as<LoraLinearImpl>()) {  // a user module's linears
      u->fp8 = std::make_shared<precision::Fp8Linear>(o);
      out.push_back(u->fp8);
    }
  return out;
}

std::vector<std::string> fp8_weight_names(torch::nn::Module& root) {
  std::vector<std::string> out;
  for (const auto& item : root.named_modules("", /*include_self=*/true))
    if (auto* l = item.value()->as<LinearImpl>(); l != nullptr && !l->quantized())
      out.push_back(item.key().empty() ? "weight" : item.key() + ".weight");
  return out;
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
  // A quantized layer's adapter computes in the dtype its bias or input has;
  // the trainer builds it in the parameter dtype (base_dtype).
  const auto options = torch::TensorOptions().dtype(base_dtype()).requires_grad(true);
  auto a = register_module("lora_A", std::make_shared<torch::nn::Module>());
  auto b = register_module("lora_B", std::make_shared<torch::nn::Module>());
  lora_A = a->register_parameter("weight", torch::zeros({r, in_features()}, options));
  lora_B = b->register_parameter("weight", torch::zeros({out_features(), r}, options));
  scaling_ = scaling;
  dropout_ = dropout;
}

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Sizes of the four parameters of Note [NF4 parameters] for `numel` values.
std::vector<int64_t> nf4_sizes(int64_t numel, const precision::NF4Options& o) {
  const int64_t blocks = ceil_div(numel, o.block_size);
  if (!o.double_quant) return {ceil_div(numel, 2), 4 * blocks, 0, 0};
  return {ceil_div(numel, 2), blocks, 4 * ceil_div(blocks, o.absmax_block_size), 4};
}

at::Tensor fp32_bytes(const at::Tensor& t) { return t.to(at::kFloat).contiguous().view(at::kByte).clone(); }

// The fp32 values of a byte parameter. Its storage offset inside a flat
// buffer need not be a multiple of 4, so the (small) bytes are copied first.
at::Tensor fp32_of(const at::Tensor& bytes) { return bytes.clone().view(at::kFloat); }

}  // namespace

const std::vector<std::string>& nf4_parameter_suffixes() {
  static const std::vector<std::string> s = {"weight_nf4", "weight_absmax", "weight_absmax_scale",
                                             "weight_absmax_offset"};
  return s;
}

at::Tensor nf4_parameter_bytes(const precision::NF4Weight& w, const std::string& suffix) {
  if (suffix == "weight_nf4") return w.packed;
  if (suffix == "weight_absmax") return w.double_quant() ? w.absmax_q : fp32_bytes(w.absmax);
  if (suffix == "weight_absmax_scale") return w.double_quant() ? fp32_bytes(w.absmax_scale) : at::empty({0}, at::kByte);
  if (suffix == "weight_absmax_offset")
    return w.double_quant() ? fp32_bytes(at::full({1}, w.absmax_offset, at::kFloat)) : at::empty({0}, at::kByte);
  TORCH_CHECK(false, "scaletrain: '", suffix, "' is not an NF4 parameter");
}

void LinearImpl::quantize(const precision::NF4Options& o) {
  TORCH_CHECK(!quantized(), "scaletrain: the layer is already quantized");
  TORCH_CHECK(!has_adapter(), "scaletrain: quantize a layer before adding its adapter");
  nf4_shape_ = weight.sizes().vec();
  nf4_options_ = o;
  base_dtype_ = weight.scalar_type();
  const bool later = weight.numel() > 0 && weight.storage().nbytes() == 0;  // deferred (interfaces/deferred.h)
  std::vector<at::Tensor> values;
  if (later) {
    for (int64_t n : nf4_sizes(weight.numel(), o)) {
      values.push_back(at::empty({n}, at::kByte));
      interfaces::free_storage(values.back());
    }
  } else {
    const precision::NF4Weight w = precision::nf4_quantize(weight.detach(), o);
    for (const auto& suffix : nf4_parameter_suffixes()) values.push_back(nf4_parameter_bytes(w, suffix).clone());
  }
  // The four take the weight's place in registration order, so a deferred
  // model's initialization draws (interfaces/deferred.h) keep their order.
  auto before = parameters_;
  parameters_.clear();
  at::Tensor* slots[] = {&weight_nf4, &weight_absmax, &weight_absmax_scale, &weight_absmax_offset};
  for (const auto& item : before) {
    if (item.key() != "weight") {
      parameters_.insert(item.key(), item.value());
      continue;
    }
    for (size_t i = 0; i < 4; ++i)
      *slots[i] = register_parameter(nf4_parameter_suffixes()[i], values[i], /*requires_grad=*/false);
  }
  weight = torch::Tensor();
}

precision::NF4Weight LinearImpl::nf4_weight() const {
  precision::NF4Weight w;
  w.shape = nf4_shape_;
  w.block_size = nf4_options_.block_size;
  w.absmax_block_size = nf4_options_.absmax_block_size;
  w.packed = weight_nf4;
  if (nf4_options_.double_quant) {
    w.absmax_q = weight_absmax;
    w.absmax_scale = fp32_of(weight_absmax_scale);
    w.absmax_offset = fp32_of(weight_absmax_offset).item<float>();
  } else {
    w.absmax = fp32_of(weight_absmax);
  }
  return w;
}

}  // namespace scaletrain::models

#include "scaletrain/optim/adamw.h"

#include "scaletrain/kernels/adamw.h"
#include "scaletrain/optim/file_backed.h"
#include "scaletrain/precision/fp8.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace scaletrain::optim {

namespace {
std::vector<int64_t> decay_counts(const std::vector<at::Tensor>& params, const std::vector<bool>& decay) {
  if (decay.size() != params.size()) throw std::invalid_argument("AdamW: one decay flag per tensor");
  std::vector<int64_t> n;
  for (size_t i = 0; i < params.size(); ++i) n.push_back(decay[i] ? params[i].numel() : 0);
  return n;
}
}  // namespace

AdamW::AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, AdamWOptions options)
    : AdamW(params, decay_counts(params, decay), options) {}

AdamW::AdamW(std::vector<at::Tensor> params, std::vector<int64_t> decay_numel, AdamWOptions options)
    : params_(std::move(params)), decay_numel_(std::move(decay_numel)), options_(options) {
  if (decay_numel_.size() != params_.size()) throw std::invalid_argument("AdamW: one decay count per tensor");
  for (size_t i = 0; i < params_.size(); ++i)
    if (decay_numel_[i] < 0 || decay_numel_[i] > params_[i].numel() ||
        (decay_numel_[i] != 0 && decay_numel_[i] != params_[i].numel() && params_[i].dim() != 1))
      throw std::invalid_argument("AdamW: a partial decay count needs a flat (1-D) tensor");
  const bool fp8 = options_.fp8_moments;
  for (auto& p : params_) {
    if (fp8 && p.scalar_type() != at::kFloat && p.scalar_type() != at::kHalf)
      throw std::invalid_argument("AdamW: FP8 moments update fp32 or fp16 (master) parameters");
    const at::ScalarType m_dtype = fp8 ? at::kByte : p.scalar_type(), v_dtype = fp8 ? at::kHalf : p.scalar_type();
    if (options_.state_dir.empty()) {
      m_.push_back(at::zeros(p.sizes(), p.options().dtype(m_dtype)));
      v_.push_back(at::zeros(p.sizes(), p.options().dtype(v_dtype)));
    } else {
      if (!p.device().is_cpu()) throw std::invalid_argument("AdamW: file-backed states need CPU tensors");
      m_.push_back(file_backed_zeros(options_.state_dir, p.numel(), m_dtype).view(p.sizes()));
      v_.push_back(file_backed_zeros(options_.state_dir, p.numel(), v_dtype).view(p.sizes()));
    }
    m_scale_.push_back(1.0);
    v_scale_.push_back(1.0);
  }
}

namespace {
constexpr double kFp16Max = 65504.0;
}  // namespace

at::Tensor AdamW::exp_avg_value(size_t i) const {
  if (!options_.fp8_moments) return m_.at(i);
  return precision::fp8_dequantize(m_.at(i), precision::Fp8Format::E4M3, m_scale_.at(i), at::kFloat);
}

at::Tensor AdamW::exp_avg_sq_value(size_t i) const {
  if (!options_.fp8_moments) return v_.at(i);
  return v_.at(i).to(at::kFloat) / v_scale_.at(i);
}

void AdamW::store_moments(size_t i, const at::Tensor& m, const at::Tensor& v) {
  // Note [FP8 moments]. The scales keep the previous value for an all-zero moment.
  m_scale_[i] = precision::fp8_scale(precision::reduce_amax(m), precision::Fp8Format::E4M3, 0, m_scale_[i]);
  m_[i].copy_(precision::fp8_quantize(m, precision::Fp8Format::E4M3, m_scale_[i]).view(m_[i].sizes()));
  const double va = precision::reduce_amax(v);
  if (va > 0 && std::isfinite(va)) v_scale_[i] = kFp16Max / va;
  v_[i].copy_((v * v_scale_[i]).to(at::kHalf).view(v_[i].sizes()));
}

void AdamW::set_moments(size_t i, const at::Tensor& m, const at::Tensor& v) {
  torch::NoGradGuard no_grad;
  if (!options_.fp8_moments) {
    if (!m.is_same(m_.at(i))) m_[i].copy_(m.view(m_[i].sizes()));
    if (!v.is_same(v_.at(i))) v_[i].copy_(v.view(v_[i].sizes()));
    return;
  }
  store_moments(i, m.to(at::kFloat), v.to(at::kFloat));
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  kernels::AdamWStep s;
  s.lr = lr;
  s.beta1 = options_.beta1;
  s.beta2 = options_.beta2;
  s.eps = options_.eps;
  s.weight_decay = options_.weight_decay;
  s.bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(step_));
  s.bias_correction2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, static_cast<double>(step_)));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (options_.fp8_moments)
      step_fp8(i, s);
    else if (options_.fused)  // the ATen ops for tensors the kernel does not take
      kernels::fused_adamw_step(p, g, m_[i], v_[i], decay_numel_[i], s);
    else
      kernels::adamw_step_unfused(p, g, m_[i], v_[i], decay_numel_[i], s);
  }
}

void AdamW::step_fp8(size_t i, const kernels::AdamWStep& s) {
  // Note [FP8 moments]: the fp32 update on decoded copies of the moments,
  // stored again after; an fp16 master (O3) is updated on an fp32 copy and
  // rounded back once.
  at::Tensor& master = params_[i];
  const bool narrow = master.scalar_type() != at::kFloat;
  at::Tensor p = narrow ? master.to(at::kFloat) : master;
  at::Tensor m = exp_avg_value(i), v = exp_avg_sq_value(i);
  kernels::adamw_step_unfused(p, master.grad(), m, v, decay_numel_[i], s);
  if (narrow) master.copy_(p);
  store_moments(i, m, v);
}

void AdamW::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

std::vector<bool> decay_matrices(const std::vector<at::Tensor>& params) {
  std::vector<bool> d;
  for (auto& p : params) d.push_back(p.dim() >= 2);
  return d;
}

at::Tensor grad_square_sum(const std::vector<at::Tensor>& params) {
  torch::NoGradGuard no_grad;
  at::Tensor sq;
  for (auto& p : params)
    if (p.grad().defined()) {
      at::Tensor s = p.grad().to(at::kDouble).pow(2).sum().reshape({1});
      sq = sq.defined() ? sq.add_(s.to(sq.device())) : s;
    }
  return sq.defined() ? sq : at::zeros({1}, at::kDouble);  // host: no gradient, a zero the collectives stage
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, const std::vector<comm::Group*>& groups) {
  torch::NoGradGuard no_grad;
  at::Tensor sq = grad_square_sum(params);
  for (comm::Group* g : groups) g->all_reduce(sq).wait();
  const double norm = std::sqrt(sq.item<double>());
  if (max_norm > 0 && norm > max_norm) {
    const double scale = max_norm / (norm + 1e-6);
    for (auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

double lr_at(int64_t step, double peak_lr, const ScheduleOptions& s) {
  if (step < s.warmup_steps) {
    const double w = static_cast<double>(s.warmup_steps);
    const double p = s.warmup == Warmup::Log ? std::log(static_cast<double>(step) + 2.0) / std::log(w + 1.0)
                                             : static_cast<double>(step + 1) / w;
    return peak_lr * (s.warmup_start_ratio + (1.0 - s.warmup_start_ratio) * p);
  }
  if (s.decay == Decay::Constant) return peak_lr;
  const int64_t decay_steps = std::max<int64_t>(1, s.total_steps - s.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / decay_steps);
  const double shape = s.decay == Decay::Linear ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  const double floor = s.min_lr_ratio * peak_lr;
  return floor + (peak_lr - floor) * shape;
}

}  // namespace scaletrain::optim

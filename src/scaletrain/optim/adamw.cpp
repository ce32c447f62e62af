#include "scaletrain/optim/adamw.h"

#include "scaletrain/optim/file_backed.h"

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
  for (auto& p : params_) {
    if (options_.state_dir.empty()) {
      m_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
      v_.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    } else {
      if (!p.device().is_cpu()) throw std::invalid_argument("AdamW: file-backed states need CPU tensors");
      m_.push_back(file_backed_zeros(options_.state_dir, p.numel(), p.scalar_type()).view(p.sizes()));
      v_.push_back(file_backed_zeros(options_.state_dir, p.numel(), p.scalar_type()).view(p.sizes()));
    }
  }
}

void AdamW::step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  const double b1 = options_.beta1, b2 = options_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step_));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(b2, static_cast<double>(step_)));
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    const int64_t nd = decay_numel_[i];
    if (nd > 0 && options_.weight_decay != 0) {
      if (nd == p.numel())
        p.mul_(1.0 - lr * options_.weight_decay);
      else
        p.narrow(0, 0, nd).mul_(1.0 - lr * options_.weight_decay);
    }
    m_[i].lerp_(g, 1.0 - b1);
    v_[i].mul_(b2).addcmul_(g, g, 1.0 - b2);
    at::Tensor denom = (v_[i].sqrt() / bc2_sqrt).add_(options_.eps);
    p.addcdiv_(m_[i], denom, -lr / bc1);
  }
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

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, const std::vector<comm::Group*>& groups) {
  torch::NoGradGuard no_grad;
  at::Tensor sq = at::zeros({1}, at::kDouble);
  for (auto& p : params)
    if (p.grad().defined()) sq += p.grad().to(at::kDouble).pow(2).sum();
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

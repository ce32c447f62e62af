#include "scaletrain/precision/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "scaletrain/util/error.h"

namespace scaletrain::precision {

LossScalerOptions loss_scaler_options(const PrecisionOptions& o) {
  LossScalerOptions s;
  s.static_scale = o.loss_scale;
  s.initial_scale = std::ldexp(1.0, static_cast<int>(o.initial_scale_power));
  s.growth_interval = o.loss_scale_window;
  s.hysteresis = static_cast<int>(o.hysteresis);
  s.min_scale = o.min_loss_scale;
  return s;
}

std::map<std::string, double> LossScalerState::to_map() const {
  return {{"scale", scale},
          {"good_steps", static_cast<double>(good_steps)},
          {"hysteresis_left", static_cast<double>(hysteresis_left)},
          {"skipped", static_cast<double>(skipped)}};
}

LossScalerState LossScalerState::from_map(const std::map<std::string, double>& map) {
  auto get = [&](const char* key) {
    auto it = map.find(key);
    if (it == map.end()) throw UsageError(std::string("loss scaler state has no '") + key + "'");
    return it->second;
  };
  LossScalerState s;
  s.scale = get("scale");
  s.good_steps = static_cast<int64_t>(get("good_steps"));
  s.hysteresis_left = static_cast<int64_t>(get("hysteresis_left"));
  s.skipped = static_cast<int64_t>(get("skipped"));
  return s;
}

LossScaler::LossScaler(LossScalerOptions o) : options_(o) {
  // Written so that NaN fails every check (a comparison with NaN is false).
  if (!(o.static_scale >= 0) || !std::isfinite(o.static_scale))
    throw UsageError("loss scaler: static_scale must be 0 (dynamic) or a finite positive number");
  if (dynamic()) {
    if (!(o.min_scale > 0) || !(o.initial_scale >= o.min_scale) || !std::isfinite(o.initial_scale))
      throw UsageError("loss scaler: need 0 < min_scale <= initial_scale, both finite");
    if (o.growth_interval < 1 || o.hysteresis < 1)
      throw UsageError("loss scaler: growth_interval and hysteresis must be at least 1");
    if (!(o.growth_factor > 1) || !std::isfinite(o.growth_factor) || !(o.backoff_factor > 0) ||
        !(o.backoff_factor < 1))
      throw UsageError("loss scaler: need a finite growth_factor > 1 and 0 < backoff_factor < 1");
  }
  scale_ = dynamic() ? o.initial_scale : o.static_scale;
  hysteresis_left_ = o.hysteresis;
}

bool LossScaler::unscale_and_check(const std::vector<at::Tensor>& grads, const std::vector<comm::Group*>& groups) {
  // The local flag stays a tensor until the end: one device sync, not one per gradient.
  at::Tensor bad;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    auto b = at::logical_not(at::isfinite(g)).any();
    bad = bad.defined() ? at::logical_or(bad, b) : b;
  }
  at::Tensor flag = bad.defined() ? bad.to(at::kFloat).reshape({1}) : at::zeros({1}, at::kFloat);
  for (comm::Group* group : groups) {
    // Gloo reduces CPU tensors, NCCL CUDA ones; Max over float is supported by both.
    const bool on_cuda = group->kind() == comm::BackendKind::Nccl;
    if (on_cuda != flag.is_cuda()) flag = on_cuda ? flag.to(at::kCUDA) : flag.cpu();  // host: Gloo's
    group->all_reduce(flag, comm::ReduceOp::Max).wait();
  }
  const bool overflow = flag.item<float>() > 0;
  if (!overflow) {
    const double inv = 1.0 / scale_;
    for (const auto& g : grads)
      if (g.defined()) g.mul_(inv);
  }
  return overflow;
}

void LossScaler::update(bool overflow) {
  if (overflow) ++skipped_;
  if (!dynamic()) return;
  if (!overflow) {
    if (++good_steps_ % options_.growth_interval == 0) {
      scale_ *= options_.growth_factor;
      hysteresis_left_ = options_.hysteresis;
      good_steps_ = 0;
    }
    return;
  }
  good_steps_ = 0;
  if (hysteresis_left_ > 1) {
    --hysteresis_left_;
    return;
  }
  if (scale_ <= options_.min_scale) {
    std::ostringstream msg;
    msg << "loss scale reached min_loss_scale=" << options_.min_scale << " and gradients still overflow (" << skipped_
        << " steps skipped so far)";
    throw LossScaleError(msg.str());
  }
  scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
}

LossScalerState LossScaler::state() const { return {scale_, good_steps_, hysteresis_left_, skipped_}; }

void LossScaler::load_state(const LossScalerState& s) {
  if (!(s.scale > 0) || s.good_steps < 0 || s.hysteresis_left < 1 || s.skipped < 0)
    throw UsageError("loss scaler state is invalid (scale " + std::to_string(s.scale) + ", hysteresis_left " +
                     std::to_string(s.hysteresis_left) + ")");
  scale_ = s.scale, good_steps_ = s.good_steps, hysteresis_left_ = s.hysteresis_left, skipped_ = s.skipped;
}

}  // namespace scaletrain::precision

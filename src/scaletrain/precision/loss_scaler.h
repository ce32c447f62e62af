#pragma once
// Loss scaling for fp16 training, with DeepSpeed's dynamic-scaling semantics.
//
// Per step: backward on loss * scale(); unscale_and_check(grads, groups)
// agrees on overflow across the groups the gradients are spread over; if it
// reports overflow, skip the optimizer step (and zero the gradients); in all
// cases call update(overflow).
//
// Note [Dynamic loss scale] (DeepSpeed's DynamicLossScaler, non-consecutive
// hysteresis):
// - On overflow with more than one hysteresis credit left, spend one credit
//   and keep the scale. With one credit left, scale *= backoff_factor, never
//   below min_scale; credits are NOT refilled by the backoff, so further
//   overflows keep backing off. An overflow while the scale already equals
//   min_scale throws LossScaleError rather than stalling silently.
// - After growth_interval consecutive good steps (counted since the last
//   overflow or growth), scale *= growth_factor and the credits are refilled.
// - Every overflow step is skipped and counted, in static mode too; static
//   mode never changes the scale.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/precision/options.h"

namespace scaletrain::precision {

struct LossScalerOptions {
  double static_scale = 0;         // a fixed scale; 0 = dynamic scaling
  double initial_scale = 65536;    // dynamic: the first scale tried (2^16)
  int64_t growth_interval = 2000;  // dynamic: consecutive good steps before growing
  int hysteresis = 2;              // dynamic: overflows tolerated before backing off
  double min_scale = 1;            // dynamic: floor of the scale
  double growth_factor = 2;        // dynamic: scale multiplier on growth
  double backoff_factor = 0.5;     // dynamic: scale multiplier on backoff
};

// From the config's precision section (loss_scale, initial_scale_power, ...).
LossScalerOptions loss_scaler_options(const PrecisionOptions& options);

// Gradients still overflow at min_scale: training cannot continue.
class LossScaleError : public std::runtime_error {
 public:
  explicit LossScaleError(const std::string& what) : std::runtime_error(what) {}
};

// What a checkpoint stores.
struct LossScalerState {
  double scale = 0;             // current scale
  int64_t good_steps = 0;       // consecutive good steps since the last overflow or growth
  int64_t hysteresis_left = 0;  // overflow credits left before the next backoff
  int64_t skipped = 0;          // overflow steps skipped so far

  std::map<std::string, double> to_map() const;
  // Throws UsageError naming a missing key.
  static LossScalerState from_map(const std::map<std::string, double>& map);
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  double scale() const { return scale_; }
  bool dynamic() const { return options_.static_scale == 0; }
  int64_t skipped_steps() const { return skipped_; }
  const LossScalerOptions& options() const { return options_; }

  // Multiplies the defined gradients by 1/scale() and returns whether any
  // gradient on any rank of `groups` holds inf or NaN: the local flag is
  // all-reduced (Max) over each group in turn, one small tensor per group, so
  // every rank returns the same answer. On overflow the gradients are left as
  // they are (the step is skipped). Empty `groups`: the local answer.
  bool unscale_and_check(const std::vector<at::Tensor>& grads, const std::vector<comm::Group*>& groups);

  // Advances the state machine of Note [Dynamic loss scale].
  void update(bool overflow);

  LossScalerState state() const;
  void load_state(const LossScalerState& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
  int64_t hysteresis_left_;
  int64_t skipped_ = 0;
};

}  // namespace scaletrain::precision

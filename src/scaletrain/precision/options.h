#pragma once
// The `precision:` section of a run's config, torch-free so that config/config.h
// can hold it without pulling libtorch in. policy.h turns it into dtypes and
// loss_scaler.h into a LossScaler.
#include <cstdint>
#include <string>

namespace scaletrain::precision {

struct PrecisionOptions {
  std::string mode = "fp32";         // fp32 | bf16 | fp16: compute dtype of matmuls under autocast
  std::string param_dtype = "fp32";  // fp32 | bf16 | fp16: dtype parameters are stored in
  std::string reduce_dtype;          // "" = same as param_dtype, else fp32 | bf16 | fp16: gradient reduction
  std::string buffer_dtype;          // "" = same as param_dtype, else fp32 | bf16 | fp16: module buffers
  double loss_scale = 0;             // static loss scale; 0 = dynamic scaling
  int64_t initial_scale_power = 16;  // dynamic scaling starts at 2^initial_scale_power
  int64_t loss_scale_window = 2000;  // consecutive good steps before the scale grows x2
  int64_t hysteresis = 2;            // overflows tolerated before the scale backs off x0.5
  double min_loss_scale = 1;         // the scale never goes below this; overflowing there is an error
  bool scale_bf16 = false;           // also scale the loss when bf16 is in use (normally only for fp16)
  // FP8 linears in the transformer blocks (Note [FP8 linears] in precision/fp8.h).
  bool fp8 = false;
  std::string fp8_format = "hybrid";   // hybrid (E4M3 forward, E5M2 gradients) | e4m3 (everywhere)
  std::string fp8_recipe = "delayed";  // delayed (amax history, reduced once a step) | current (this cast's amax)
  int64_t fp8_amax_history = 1024;     // steps of amax history the delayed recipe keeps (>= 1)
  int64_t fp8_margin = 0;              // scale = fp8_max / amax / 2^margin (>= 0)
  std::string fp8_opt_level;           // "" | O1 | O2 | O3: MS-AMP's levels (FP8 communication and optimizer state)
};

}  // namespace scaletrain::precision

#pragma once
// Autocast's C++ API across libtorch versions (a sibling of comm/compat.h,
// which holds the other version differences). From 2.4 the per-device
// functions (is_cpu_enabled, set_autocast_gpu_dtype, ...) are deprecated
// wrappers that warn on every call; their replacements take the device type.
#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace scaletrain::precision::compat {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(at::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void set_autocast_enabled(at::DeviceType d, bool on) { at::autocast::set_autocast_enabled(d, on); }
inline at::ScalarType autocast_dtype(at::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
inline void set_autocast_dtype(at::DeviceType d, at::ScalarType t) { at::autocast::set_autocast_dtype(d, t); }
#else
// Before 2.4: CUDA ("gpu") and CPU have functions of their own.
inline bool autocast_enabled(at::DeviceType d) {
  return d == at::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline void set_autocast_enabled(at::DeviceType d, bool on) {
  d == at::kCUDA ? at::autocast::set_enabled(on) : at::autocast::set_cpu_enabled(on);
}
inline at::ScalarType autocast_dtype(at::DeviceType d) {
  return d == at::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast_dtype(at::DeviceType d, at::ScalarType t) {
  d == at::kCUDA ? at::autocast::set_autocast_gpu_dtype(t) : at::autocast::set_autocast_cpu_dtype(t);
}
#endif

}  // namespace scaletrain::precision::compat

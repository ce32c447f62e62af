#include "scaletrain/precision/policy.h"

#include "scaletrain/precision/autocast_compat.h"

#include <ATen/autocast_mode.h>

#include "scaletrain/util/error.h"

namespace scaletrain::precision {

at::ScalarType parse_dtype(const std::string& key, const std::string& name) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  throw UsageError(key + " must be one of fp32 | bf16 | fp16, got '" + name + "'");
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "fp32";
    case at::kBFloat16:
      return "bf16";
    case at::kHalf:
      return "fp16";
    default:
      return c10::toString(dtype);
  }
}

PrecisionPolicy PrecisionPolicy::from_options(const PrecisionOptions& o, bool cuda) {
  PrecisionPolicy p;
  p.compute = parse_dtype("precision.mode", o.mode);
  p.param = parse_dtype("precision.param_dtype", o.param_dtype);
  p.reduce = o.reduce_dtype.empty() ? p.param : parse_dtype("precision.reduce_dtype", o.reduce_dtype);
  p.buffer = o.buffer_dtype.empty() ? p.param : parse_dtype("precision.buffer_dtype", o.buffer_dtype);
  if (!cuda && (p.compute == at::kHalf || p.param == at::kHalf))
    throw UsageError("fp16 needs CUDA: CPU has no fp16 matmul in libtorch 1.13; use bf16 (precision.mode=" + o.mode +
                     ", precision.param_dtype=" + o.param_dtype + ")");
  if (p.param != at::kFloat && p.compute != p.param)
    throw UsageError("precision.param_dtype=" + o.param_dtype + " needs precision.mode=" + o.param_dtype + " (ops on " +
                     o.param_dtype + " parameters run in " + o.param_dtype + "), got mode=" + o.mode);
  bool bf16 = false, fp16 = false;
  for (auto t : {p.compute, p.param, p.reduce, p.buffer}) bf16 |= t == at::kBFloat16, fp16 |= t == at::kHalf;
  if (bf16 && fp16) throw UsageError("precision mixes bf16 and fp16 (" + p.describe() + "): pick one 16-bit format");
  const bool uses_bf16 = p.compute == at::kBFloat16 || p.param == at::kBFloat16;
  p.loss_scaling = p.compute == at::kHalf || p.param == at::kHalf || (o.scale_bf16 && uses_bf16);
  return p;
}

std::string PrecisionPolicy::describe() const {
  return "compute " + dtype_name(compute) + (autocast() ? " (autocast)" : "") + ", params " + dtype_name(param) +
         ", reduce " + dtype_name(reduce) + ", buffers " + dtype_name(buffer) + ", loss scaling " +
         (loss_scaling ? "on" : "off");
}

AutocastGuard::AutocastGuard(const PrecisionPolicy& policy, at::DeviceType device_type) : device_type_(device_type) {
  const bool enable = policy.autocast();
  if (device_type == at::kCPU) {  // host: CPU autocast
    if (enable && policy.compute != at::kBFloat16)
      throw UsageError("CPU autocast supports bf16 only, got compute dtype " + dtype_name(policy.compute));
  } else if (device_type != at::kCUDA) {
    throw UsageError("autocast is supported on CPU and CUDA, not on " + c10::DeviceTypeName(device_type));
  }
  prev_enabled_ = compat::autocast_enabled(device_type);
  prev_dtype_ = compat::autocast_dtype(device_type);
  compat::set_autocast_enabled(device_type, enable);
  if (enable) compat::set_autocast_dtype(device_type, policy.compute);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  compat::set_autocast_enabled(device_type_, prev_enabled_);
  compat::set_autocast_dtype(device_type_, prev_dtype_);
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

}  // namespace scaletrain::precision

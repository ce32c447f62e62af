#pragma once
// Mixed precision policy: which dtype each kind of tensor lives and moves in,
// validated once at start-up, and an RAII guard that turns autocast on for a
// region (the forward pass) according to it.
//
// Note [Precision dtypes]:
// - compute: dtype of matmuls and other autocast-eligible ops. fp32 means
//   autocast stays off; bf16/fp16 turn it on for the guarded region.
// - param: dtype the (sharded or replicated) parameters are stored in. 16-bit
//   parameters need the same compute dtype: ops on bf16 parameters run in bf16.
// - reduce: dtype gradients are reduced in (defaults to param).
// - buffer: dtype of module buffers (defaults to param).
// - loss_scaling: whether the loss must be scaled (fp16 in compute or params,
//   or bf16 when PrecisionOptions::scale_bf16 asks for it).
// CPU has no fp16 matmul in libtorch 1.13, so fp16 compute or parameters are
// rejected on CPU-only runs (bf16 is the CPU mixed-precision mode).
#include <ATen/ATen.h>

#include <string>

#include "scaletrain/precision/options.h"

namespace scaletrain::precision {

struct PrecisionPolicy {
  at::ScalarType compute = at::kFloat;  // autocast dtype; kFloat = autocast off
  at::ScalarType param = at::kFloat;    // parameter storage
  at::ScalarType reduce = at::kFloat;   // gradient reduction
  at::ScalarType buffer = at::kFloat;   // module buffers
  bool loss_scaling = false;            // scale the loss (and unscale gradients) each step

  // Builds and validates the policy; `cuda` says whether the run computes on
  // CUDA devices. Throws UsageError, one line, on an unusable combination.
  static PrecisionPolicy from_options(const PrecisionOptions& options, bool cuda);

  bool autocast() const { return compute != at::kFloat; }
  // "compute bf16 (autocast), params fp32, reduce fp32, buffers fp32, loss scaling off"
  std::string describe() const;
};

// "fp32" | "bf16" | "fp16" -> kFloat | kBFloat16 | kHalf; `key` names the option in errors.
at::ScalarType parse_dtype(const std::string& key, const std::string& name);
// kFloat -> "fp32", kBFloat16 -> "bf16", kHalf -> "fp16", others: c10's name.
std::string dtype_name(at::ScalarType dtype);

// Enables autocast for `device_type` (CPU or CUDA) with the policy's compute
// dtype, or disables it when the policy computes in fp32, and restores the
// previous enabled flag and dtype on destruction. Nests: the autocast cache
// (casts of leaf weights) is cleared when the outermost guard exits, as
// torch.autocast does.
class AutocastGuard {
 public:
  AutocastGuard(const PrecisionPolicy& policy, at::DeviceType device_type);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  at::DeviceType device_type_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

}  // namespace scaletrain::precision

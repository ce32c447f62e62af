// Causal attention over grouped-query heads by the path model.attention
// names (Note [Attention paths] in models/attention.h).
#include "scaletrain/models/attention.h"

#include <torch/version.h>

#include <cmath>
#include <limits>

#include "scaletrain/kernels/attention.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/util/error.h"

namespace scaletrain::models {

AttentionPath attention_path(const std::string& name) {
  if (name == "flash") return AttentionPath::Flash;
  if (name == "naive") return AttentionPath::Naive;
  throw UsageError("model.attention must be flash or naive, got '" + name + "'");
}

bool flash_runs_on(const torch::Tensor& q) { return q.device().is_cpu() && q.is_floating_point(); }

namespace {

// The scores materialized: [B, H, T, T], masked to the past of the same
// document, softmax in fp32 (fp64 stays fp64), dropout, times v.
torch::Tensor naive(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, const SequenceLayout* layout,
                    double dropout, bool training) {
  const int64_t H = q.size(1), Hkv = k.size(1), T = q.size(2);
  if (Hkv != H) {  // kv head j serves query heads [j * rep, (j + 1) * rep)
    k = k.repeat_interleave(H / Hkv, 1);
    v = v.repeat_interleave(H / Hkv, 1);
  }
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(3))));
  auto hidden = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  if (layout != nullptr && layout->segments.defined()) {
    const auto& s = layout->segments;
    hidden = hidden.logical_or(s.unsqueeze(2).ne(s.unsqueeze(1))).unsqueeze(1);  // [B, 1, T, T]
  }
  att = att.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  const auto wide = att.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  att = torch::softmax(att, -1, wide).to(q.scalar_type());
  if (dropout > 0) att = torch::dropout(att, dropout, training);
  return torch::matmul(att, v);
}

// libtorch 2.x has a fused attention for device tensors (its flash and
// memory-efficient kernels behind at::scaled_dot_product_attention).
constexpr bool kFusedDeviceAttention = TORCH_VERSION_MAJOR >= 2;

// Device tensors on the flash path: the fused attention, causal, or with the
// pairs a packed batch allows as a boolean mask ([B, 1, T, T], true = attend).
torch::Tensor fused_device(const torch::Tensor& q, torch::Tensor k, torch::Tensor v, const SequenceLayout* layout) {
#if TORCH_VERSION_MAJOR >= 2
  const int64_t H = q.size(1), Hkv = k.size(1), T = q.size(2);
  if (Hkv != H) {
    k = k.repeat_interleave(H / Hkv, 1);
    v = v.repeat_interleave(H / Hkv, 1);
  }
  if (layout == nullptr || !layout->segments.defined())
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  const auto& s = layout->segments;
  auto allowed = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).tril();
  allowed = allowed.logical_and(s.unsqueeze(2).eq(s.unsqueeze(1))).unsqueeze(1);
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, /*is_causal=*/false);
#else
  return naive(q, std::move(k), std::move(v), layout, 0.0, false);
#endif
}

}  // namespace

torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, AttentionPath path,
                     const SequenceContext* context, double dropout, bool training) {
  const SequenceLayout* layout = context != nullptr ? context->layout.get() : nullptr;
  if (context != nullptr && context->split_attention) {
    // Its kernels and merge take the inputs' dtype (already autocast's) and accumulate in fp32.
    precision::AutocastGuard off(precision::PrecisionPolicy{}, q.device().type());
    return context->split_attention(q, k, v, layout);
  }
  const bool flash = path == AttentionPath::Flash && !(dropout > 0 && training);
  if (flash && kFusedDeviceAttention && !q.is_cpu()) return fused_device(q, k, v, layout);
  if (!flash || !flash_runs_on(q)) return naive(q, k, v, layout, dropout, training);
  kernels::AttentionMask mask;
  if (layout != nullptr && layout->segments.defined()) mask.q_segments = mask.k_segments = layout->segments;
  // Autocast off for the kernel's own GEMMs: its inputs are already in the
  // autocast dtype, and it accumulates in fp32 on purpose.
  precision::AutocastGuard off(precision::PrecisionPolicy{}, q.device().type());  // a CPU tensor (flash_runs_on)
  return std::get<0>(kernels::flash_attention(q, k, v, mask));
}

torch::Tensor batch_positions(const SequenceLayout* layout, int64_t B, int64_t T, const torch::Device& device) {
  if (layout != nullptr) return layout->positions;
  return torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(device)).expand({B, T});
}

}  // namespace scaletrain::models

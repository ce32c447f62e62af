#pragma once
// FP8 tensors and their scales (the codec itself is fp8_format.h).
//
// Note [FP8 tensors]: an FP8 tensor is a uint8 tensor of codes and a
// per-tensor scale: codes = encode(x * scale), x ~ decode(codes) / scale. The
// product x * scale is formed in fp32 (what FP8 GEMM libraries do before the
// cast), then encoded exactly as fp8_encode() would, element by element
// (round to nearest even, subnormals, saturation). libtorch 1.13 has no
// float8 dtype, so codes are plain bytes here on every version.
//
// Note [FP8 scaling]: scale = fp8_max / amax / 2^margin, so the largest
// magnitude lands 2^margin below the format's largest value. An amax that is
// 0 or not finite keeps the previous scale (1 at first). Current scaling
// takes the amax of the tensor being cast; delayed scaling takes the largest
// of the amaxes recorded over the last `history` uses (each cast records its
// amax after the fact), so a cast needs no pass over the data before it.
// Ranks that must agree on a scale (the pieces of one tensor under tensor
// parallelism, the replicas of a gradient) reduce the amax with MAX over
// their groups first (reduce_amax), so every rank casts with the same scale.
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/precision/fp8_format.h"

namespace scaletrain::precision {

// uint8 codes of x * scale (any floating dtype, any device), shaped like x.
at::Tensor fp8_quantize(const at::Tensor& x, Fp8Format format, double scale, bool saturate = true);
// codes decoded and divided by scale, in `dtype`.
at::Tensor fp8_dequantize(const at::Tensor& codes, Fp8Format format, double scale,
                          at::ScalarType dtype = at::kFloat);

// Note [FP8 scaling]: fp8_max / amax / 2^margin, or `previous` when amax is 0 or not finite.
double fp8_scale(double amax, Fp8Format format, int margin, double previous);

// Which format a tensor is cast to: E4M3 everywhere, or HYBRID (E4M3 for
// activations and weights in forward, E5M2 for gradients in backward, whose
// range matters more than their precision).
enum class Fp8Mix { E4M3, Hybrid };
Fp8Format fp8_format(Fp8Mix mix, bool gradient);

// Delayed scaling of one tensor (Note [FP8 scaling]).
class DelayedScaling {
 public:
  // Throws std::invalid_argument when history < 1.
  explicit DelayedScaling(Fp8Format format, int64_t history = 1024, int margin = 0);
  double scale() const { return scale_; }  // for the next cast
  // Records a cast's amax (already reduced across ranks when they must agree)
  // and sets the scale for the next cast from the history's largest.
  void record(double amax);
  const std::vector<double>& history() const { return history_; }

 private:
  Fp8Format format_;
  int64_t length_;
  int margin_;
  std::vector<double> history_;  // a ring of the last `length_` finite amaxes
  size_t next_ = 0;
  double scale_ = 1.0;
};

// The largest |x| over this rank's tensor and, with MAX, over `groups` (null
// or single-rank groups are skipped): the same value on every rank.
double reduce_amax(const at::Tensor& x, const std::vector<comm::Group*>& groups = {});

}  // namespace scaletrain::precision

#pragma once
// Internals of the tiled attention kernel (attention.h), shared by the
// forward (attention.cpp) and the backward (attention_backward.cpp): the
// resolved shapes of a call, the mask evaluated per tile and per row, the
// row-wise exponential, and a load-balancing task loop on top of at::parallel_for. Not a public API; the
// tests use flash_attention_tiled to force small tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "scaletrain/kernels/attention.h"
#include "scaletrain/kernels/vec_math.h"

namespace scaletrain::kernels::detail {

// Rows of queries and of keys per tile. 0 asks for the default for the head
// dimension (see choose_tiles in attention.cpp).
struct TileSizes {
  int64_t q = 0;
  int64_t k = 0;
};

// One call's shapes and mask parameters, validated, with its tile layout.
struct Geometry {
  int64_t B = 0, H = 0, Hkv = 0, Tq = 0, Tk = 0, D = 0;
  int64_t group = 1;  // query heads per kv head, H / Hkv
  double scale = 1;   // resolved, > 0
  bool causal = true;
  int64_t window = 0, q_offset = 0, k_offset = 0;
  TileSizes tile;
  int64_t q_tiles = 0, k_tiles = 0;
};

// Validates q, k, v and the mask (throws UsageError naming the values) and
// resolves the geometry with the given tile sizes. `host_only`: the tensors
// must be CPU tensors (the kernels'; naive_attention takes any device).
Geometry resolve_geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask,
                          TileSizes tiles, bool host_only = true);

// flash_attention with explicit tile sizes.
std::tuple<at::Tensor, at::Tensor> flash_attention_tiled(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const AttentionMask& mask,
                                                         TileSizes tiles);

// How much of a (query tile, key tile) pair the mask lets through.
enum class TileCover { kHidden, kVisible, kPartial };

// The mask of one call, asked per tile pair and applied per tile of scores.
class TileMask {
 public:
  // q_seg / k_seg: contiguous int64 [B, Tq] / [B, Tk], or both undefined.
  TileMask(const Geometry& g, const at::Tensor& q_seg, const at::Tensor& k_seg);

  TileCover cover(int64_t b, int64_t qt, int64_t kt) const;

  // Sets the hidden entries of an [m, n] row-major tile of scores (query rows
  // i0.., key rows j0.. of batch b) to -inf.
  template <typename T>
  void hide(int64_t b, int64_t i0, int64_t m, int64_t j0, int64_t n, T* s) const {
    const T ninf = -std::numeric_limits<T>::infinity();
    for (int64_t r = 0; r < m; ++r) {
      T* row = s + r * n;
      const int64_t qpos = g_.q_offset + i0 + r;
      int64_t lo = 0, hi = n;  // visible key columns of this row: [lo, hi)
      if (g_.causal) hi = std::min<int64_t>(n, qpos - g_.k_offset - j0 + 1);
      if (g_.window > 0) lo = std::max<int64_t>(0, qpos - g_.window + 1 - g_.k_offset - j0);
      hi = std::max(hi, int64_t{0});
      lo = std::min(lo, hi);
      for (int64_t c = 0; c < lo; ++c) row[c] = ninf;
      for (int64_t c = hi; c < n; ++c) row[c] = ninf;
      if (qseg_ == nullptr) continue;
      const int64_t doc = qseg_[b * g_.Tq + i0 + r];
      const int64_t* keys = kseg_ + b * g_.Tk + j0;
      for (int64_t c = lo; c < hi; ++c)
        if (keys[c] != doc) row[c] = ninf;
    }
  }

 private:
  const Geometry& g_;
  at::Tensor q_seg_, k_seg_;  // keeps the ids alive
  const int64_t* qseg_ = nullptr;
  const int64_t* kseg_ = nullptr;
  // Smallest and largest document id in each (batch, tile), for skipping.
  std::vector<int64_t> q_lo_, q_hi_, k_lo_, k_hi_;
};

// exp(x) in float for the softmax's arguments (at most a rounding error above
// 0), written so that a loop over it vectorizes: exp_neg(-x) of vec_math.h
// (the degree-7 Taylor polynomial, truncation below 6e-9 relative, times 2^k
// put into the exponent bits) with -x clamped into [-88, 88]. Inputs below
// about -87.7 (including -inf) give exactly 0; NaN is not expected and not
// handled.
inline float exp_fast(float x) { return exp_neg(std::min(std::max(-x, -88.0f), 88.0f)); }

// x[c] <- exp(a * x[c] - b) for c < n; returns the sum. Expects a * x - b
// <= 0 up to rounding (the caller subtracts the row maximum or the row's
// log-sum-exp).
inline float exp_affine_row(float* x, int64_t n, float a, float b) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < n; ++c) {
    const float e = exp_fast(a * x[c] - b);
    x[c] = e;
    sum += e;
  }
  return sum;
}

inline double exp_affine_row(double* x, int64_t n, double a, double b) {
  double sum = 0;
  for (int64_t c = 0; c < n; ++c) {
    const double e = std::exp(a * x[c] - b);
    x[c] = e;
    sum += e;
  }
  return sum;
}

template <typename T>
T row_max(const T* x, int64_t n) {
  T m = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t c = 0; c < n; ++c) m = x[c] > m ? x[c] : m;
  return m;
}

// Runs body(task, scratch) for task in [0, n) on the ATen threads, handing
// out tasks one at a time from a shared counter, so tiles of unequal cost
// (causal masks) balance. Each task writes only its own outputs, so the
// result does not depend on which thread ran what. Scratch is built once per
// worker.
template <typename Scratch, typename MakeScratch, typename Body>
void run_tasks(int64_t n, const MakeScratch& make_scratch, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    c10::InferenceMode no_autograd;  // plain kernels: skip the autograd dispatch on every tile product
    Scratch scratch = make_scratch();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) body(t, scratch);
  });
}

// Fills out [B, H, Tq, D] and lse [B, H, Tq] (both contiguous, T's dtype)
// from contiguous q, k, v of dtype T.
template <typename T>
void forward_kernel(const Geometry& g, const TileMask& mask, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, at::Tensor& out, at::Tensor& lse);

// Gradients of q, k, v (contiguous, dtype T) given the forward's out and lse
// and the incoming gradients dout (defined) and dlse (may be undefined).
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel(const Geometry& g, const TileMask& mask,
                                                               const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& out,
                                                               const at::Tensor& lse, const at::Tensor& dout,
                                                               const at::Tensor& dlse);

}  // namespace scaletrain::kernels::detail

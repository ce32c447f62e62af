// The fused AdamW step on the CPU, its unfused ATen reference, and the probe
// that tells the kernel how ATen rounds.
//
// Note [Fused AdamW arithmetic]
// The fused step gives the bits of the ATen ops in adamw_step_unfused, so
// that the optimizer's switch (optim::AdamWOptions::fused) never changes a run.
// Per element, with each step's scalars computed in double and converted to
// the tensor's dtype T once (ATen converts a Scalar with a plain cast), it
// computes what each op computes:
//   mul_:     p' = p * T(1 - lr wd)                         (decayed elements only)
//   lerp_:    m' = madd(w, g - m, m)          for |w| < 0.5, w = T(1 - beta1)
//             m' = madd(w - 1, g - m, g)      otherwise
//   mul_:     u  = v * T(beta2)
//   addcmul_: v' = madd(T(1 - beta2) * g, g, u)
//   sqrt, div, add_:  d = sqrt(v') / T(bc2_sqrt) + T(eps)
//   addcdiv_: p'' = p' + (T(-lr / bc1) * m') / d
// The two madd(a, b, c) = a b + c are where ATen's kernels differ by build.
// Measured on Debian's libtorch 1.13.1: its AVX2 and AVX512 kernels (built
// with -mfma, where GCC's default -ffp-contract=fast may fuse) round a b + c
// once in lerp_ and in addcmul_, in the vector loops and in the scalar tails
// alike; its DEFAULT kernels (CPUs without AVX2, ATEN_CPU_CAPABILITY=default)
// round the product and the sum separately. The other ops round the same
// way under every capability. Which capability ATen runs is not exported
// (at::native::get_cpu_capability is not in the shared library), so the
// first step asks: aten_rounds_once() runs lerp_ and addcmul_ on fixed values
// where the two roundings disagree and compares. The kernel then uses a fused
// multiply-add instruction (a function compiled for AVX2 + FMA, chosen at run
// time: this file is otherwise compiled for plain x86-64), libm's fma (a CPU
// without FMA whose ATen still rounds once: not expected), or a * b + c.
// The last relies on GCC not contracting a * b + c here, which holds for the
// project's flags (no -mfma, so no FMA instruction to contract into); a
// build with -march=native and ATEN_CPU_CAPABILITY=default would break it.
// Every other operation is one IEEE operation in both paths (sqrt included),
// so there is nothing else to match.
//
// Vectorising. std::sqrt sets errno for negative input, so under the
// project's default -fmath-errno GCC will not vectorise a loop that calls it,
// and a per-function optimize("no-math-errno") does not change that. Each
// thread's range is therefore walked in blocks of kBlock elements: one
// `omp simd` loop decays p and updates m and v, a vector sqrt (SSE2 or AVX
// intrinsics on x86-64, std::sqrt elsewhere) takes the block's sqrt(v') into
// a buffer on the stack, and a second `omp simd` loop adds the update to p.
// The block stays in L1, so memory sees one read of p, g, m, v and one write
// of p, m, v. (Storing the decayed p between the loops also keeps a compiler
// that targets FMA from contracting p * decay + update into one rounding,
// which ATen, doing them in two ops, does not.)
//
// Threads: at::parallel_for over elements. Each element's result depends on
// its own four values and the scalars only, so it is the same for any
// number of threads, chunking or block boundaries.
#include "scaletrain/kernels/adamw.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/util/irange.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SCALETRAIN_ADAMW_X86 1
#else
#define SCALETRAIN_ADAMW_X86 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace scaletrain::kernels {
namespace {

constexpr int64_t kGrainElements = 32768;  // elements per parallel_for chunk, at least
constexpr int64_t kBlock = 1024;           // elements per block within a chunk (Note above)

// ---- the scalars -----------------------------------------------------------

// A step's scalars in dtype T, converted as ATen converts the ops' Scalars.
template <typename T>
struct Constants {
  T decay;            // 1 - lr wd (mul_)
  T lerp_coeff;       // w or w - 1 (lerp_)
  bool small;         // |w| < 0.5: lerp_ starts from m, else from g
  T beta2;            // (mul_)
  T one_minus_beta2;  // (addcmul_)
  T bc2_sqrt;         // (div)
  T eps;              // (add_)
  T step_size;        // -lr / bc1 (addcdiv_)
};

template <typename T>
Constants<T> constants(const AdamWStep& s) {
  Constants<T> c{};
  c.decay = static_cast<T>(1.0 - s.lr * s.weight_decay);
  const T w = static_cast<T>(1.0 - s.beta1);
  c.small = std::abs(w) < T(0.5);
  c.lerp_coeff = c.small ? w : w - T(1);
  c.beta2 = static_cast<T>(s.beta2);
  c.one_minus_beta2 = static_cast<T>(1.0 - s.beta2);
  c.bc2_sqrt = static_cast<T>(s.bias_correction2_sqrt);
  c.eps = static_cast<T>(s.eps);
  c.step_size = static_cast<T>(-s.lr / s.bias_correction1);
  return c;
}

// ---- elements --------------------------------------------------------------

// a * b + c rounded once (kOnce: an fma builtin, one instruction where the
// function is compiled for FMA, else libm's fma) or twice.
template <bool kOnce>
C10_ALWAYS_INLINE float madd(float a, float b, float c) {
  if constexpr (kOnce) return __builtin_fmaf(a, b, c);
  return a * b + c;
}
template <bool kOnce>
C10_ALWAYS_INLINE double madd(double a, double b, double c) {
  if constexpr (kOnce) return __builtin_fma(a, b, c);
  return a * b + c;
}

// The four tensors' data.
template <typename T>
struct Span {
  T* p;
  const T* g;
  T* m;
  T* v;
};

// out[i] = sqrt(x[i]) for i < n.
template <typename T>
using SqrtFn = void (*)(const T*, T*, int64_t);

template <typename T>
void sqrt_scalar(const T* x, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(x[i]);
}

#if SCALETRAIN_ADAMW_X86
void sqrt_sse2(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(out + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
  sqrt_scalar(x + i, out + i, n - i);
}
void sqrt_sse2(const double* x, double* out, int64_t n) {
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) _mm_storeu_pd(out + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
  sqrt_scalar(x + i, out + i, n - i);
}
__attribute__((target("avx2,fma"))) void sqrt_avx(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
  sqrt_scalar(x + i, out + i, n - i);
}
__attribute__((target("avx2,fma"))) void sqrt_avx(const double* x, double* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) _mm256_storeu_pd(out + i, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
  sqrt_scalar(x + i, out + i, n - i);
}
#endif

// Elements [begin, end), all decayed (kDecay) or none, in blocks.
template <typename T, bool kOnce, bool kDecay>
C10_ALWAYS_INLINE void update_part(const Span<T>& s, int64_t begin, int64_t end, const Constants<T>& c,
                                   SqrtFn<T> sqrt_fn) {
  alignas(64) T root[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    T* p = s.p + b;
    const T* g = s.g + b;
    T* m = s.m + b;
    T* v = s.v + b;
    const bool small = c.small;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      // Stored here, added to in the second loop: never contracted (Note).
      if constexpr (kDecay) p[i] = p[i] * c.decay;
      const T gi = g[i], mi = m[i];
      m[i] = madd<kOnce>(c.lerp_coeff, gi - mi, small ? mi : gi);
      v[i] = madd<kOnce>(c.one_minus_beta2 * gi, gi, v[i] * c.beta2);
    }
    sqrt_fn(v, root, n);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] + c.step_size * m[i] / (root[i] / c.bc2_sqrt + c.eps);
  }
}

// Elements [begin, end) of a tensor whose first decay_numel elements are decayed.
template <typename T, bool kOnce>
C10_ALWAYS_INLINE void update_range(const Span<T>& s, int64_t begin, int64_t end, int64_t decay_numel,
                                    const Constants<T>& c, SqrtFn<T> sqrt_fn) {
  const int64_t split = std::clamp(decay_numel, begin, end);
  update_part<T, kOnce, true>(s, begin, split, c, sqrt_fn);
  update_part<T, kOnce, false>(s, split, end, c, sqrt_fn);
}

template <typename T>
using RangeFn = void (*)(const Span<T>&, int64_t, int64_t, int64_t, const Constants<T>&);

// The variants, each its own function so that it can be compiled for its target.
#if SCALETRAIN_ADAMW_X86
template <typename T>
__attribute__((target("avx2,fma"))) void range_avx2_fma(const Span<T>& s, int64_t begin, int64_t end, int64_t nd,
                                                        const Constants<T>& c) {
  update_range<T, true>(s, begin, end, nd, c, sqrt_avx);
}
#endif

template <typename T>
void range_libm_fma(const Span<T>& s, int64_t begin, int64_t end, int64_t nd, const Constants<T>& c) {
  update_range<T, true>(s, begin, end, nd, c, sqrt_scalar<T>);
}

template <typename T>
void range_two_roundings(const Span<T>& s, int64_t begin, int64_t end, int64_t nd, const Constants<T>& c) {
#if SCALETRAIN_ADAMW_X86
  update_range<T, false>(s, begin, end, nd, c, sqrt_sse2);
#else
  update_range<T, false>(s, begin, end, nd, c, sqrt_scalar<T>);
#endif
}

// ---- which rounding ATen uses ----------------------------------------------

// n values in [-1, 1) from a fixed linear congruential sequence.
template <typename T>
std::vector<T> probe_values(uint32_t seed, int64_t n) {
  std::vector<T> out(n);
  for (auto& x : out) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<T>(static_cast<double>(seed >> 8) / double(1u << 23) - 1.0);
  }
  return out;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Counts, over elements where rounding once and twice disagree, which of the
// two ATen's result matched: [0] once, [1] twice, [2] neither.
template <typename T>
void tally(const at::Tensor& aten, const std::vector<T>& once, const std::vector<T>& twice, int64_t counts[3]) {
  const T* r = aten.data_ptr<T>();
  for (size_t i = 0; i < once.size(); ++i) {
    if (same_bits(once[i], twice[i])) continue;
    ++counts[same_bits(r[i], once[i]) ? 0 : same_bits(r[i], twice[i]) ? 1 : 2];
  }
}

// True unless ATen's lerp_ and addcmul_ in dtype T round a * b + c twice.
// 512 elements are well past every vector width, so the vector loops run.
template <typename T>
bool aten_rounds_once_in() {
  constexpr int64_t n = 512;
  const at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
  std::vector<T> a = probe_values<T>(1, n), b = probe_values<T>(2, n);
  const at::Tensor ta = at::from_blob(a.data(), {n}, dtype).clone();
  const at::Tensor tb = at::from_blob(b.data(), {n}, dtype).clone();
  const double w = 0.1, k = 0.05;
  const at::Tensor lerped = ta.clone().lerp_(tb, w), added = ta.clone().addcmul_(tb, tb, k);
  const T tw = static_cast<T>(w), tk = static_cast<T>(k);
  std::vector<T> l1(n), l2(n), a1(n), a2(n);
  for (const auto i : c10::irange(n)) {
    l1[i] = madd<true>(tw, b[i] - a[i], a[i]);
    l2[i] = madd<false>(tw, b[i] - a[i], a[i]);
    a1[i] = madd<true>(tk * b[i], b[i], a[i]);
    a2[i] = madd<false>(tk * b[i], b[i], a[i]);
  }
  int64_t counts[3] = {0, 0, 0};
  tally(lerped, l1, l2, counts);
  tally(added, a1, a2, counts);
  return !(counts[1] > 0 && counts[0] == 0 && counts[2] == 0);
}

bool aten_rounds_once() {
  static const bool once = aten_rounds_once_in<float>() || aten_rounds_once_in<double>();
  return once;
}

template <typename T>
RangeFn<T> pick_range() {
  if (!aten_rounds_once()) return range_two_roundings<T>;
#if SCALETRAIN_ADAMW_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return range_avx2_fma<T>;
#endif
  return range_libm_fma<T>;
}

template <typename T>
void run(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t decay_numel, const AdamWStep& s) {
  static const RangeFn<T> range = pick_range<T>();
  const Span<T> span{p.data_ptr<T>(), g.data_ptr<T>(), m.data_ptr<T>(), v.data_ptr<T>()};
  const Constants<T> c = constants<T>(s);
  at::parallel_for(0, p.numel(), kGrainElements,
                   [&](int64_t begin, int64_t end) { range(span, begin, end, decay_numel, c); });
}

void check_decay(const at::Tensor& p, int64_t decay_numel) {
  if (decay_numel < 0 || decay_numel > p.numel())
    throw std::invalid_argument("adamw: decay_numel " + std::to_string(decay_numel) + " is outside [0, " +
                                std::to_string(p.numel()) + "]");
  if (decay_numel != 0 && decay_numel != p.numel() && p.dim() != 1)
    throw std::invalid_argument("adamw: a partial decay_numel needs a flat (1-D) tensor");
}

bool apart(const at::Tensor& a, const at::Tensor& b) {
  return at::get_overlap_status(a, b) == at::MemOverlapStatus::No;
}

}  // namespace

bool fused_adamw_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v})
    if (!t->defined() || !t->device().is_cpu() || t->layout() != at::kStrided || !t->is_contiguous() ||
        t->scalar_type() != p.scalar_type() || t->numel() != p.numel())
      return false;
  if (p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble) return false;
  return apart(p, g) && apart(p, m) && apart(p, v) && apart(g, m) && apart(g, v) && apart(m, v);
}

void fused_adamw_step(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t decay_numel,
                      const AdamWStep& s) {
  if (!fused_adamw_applies(p, g, m, v)) return adamw_step_unfused(p, g, m, v, decay_numel, s);
  check_decay(p, decay_numel);
  const int64_t nd = s.weight_decay != 0 ? decay_numel : 0;  // as the reference: no decay, no multiply
  if (p.scalar_type() == at::kDouble)
    run<double>(p, g, m, v, nd, s);
  else
    run<float>(p, g, m, v, nd, s);
  // As the in-place ops would: autograd then sees that these tensors changed.
  for (at::Tensor* t : {&p, &m, &v}) t->unsafeGetTensorImpl()->bump_version();
}

void adamw_step_unfused(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t decay_numel,
                        const AdamWStep& s) {
  check_decay(p, decay_numel);
  c10::NoGradGuard no_grad;
  if (decay_numel > 0 && s.weight_decay != 0) {
    const double decay = 1.0 - s.lr * s.weight_decay;
    if (decay_numel == p.numel())
      p.mul_(decay);
    else
      p.narrow(0, 0, decay_numel).mul_(decay);
  }
  m.lerp_(g, 1.0 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1.0 - s.beta2);
  const at::Tensor denom = (v.sqrt() / s.bias_correction2_sqrt).add_(s.eps);
  p.addcdiv_(m, denom, -s.lr / s.bias_correction1);
}

}  // namespace scaletrain::kernels

// Tiled ("flash") attention, forward pass and autograd glue, and the naive
// reference. The backward kernel lives in attention_backward.cpp.
//
// Note [Online softmax]
// For one query row and its scores s_j, the forward keeps m = max_j s_j, l =
// sum_j exp(s_j - m) and o = sum_j exp(s_j - m) v_j over the key tiles seen so
// far. A new tile with maximum m' > m rescales l and o by exp(m - m') before
// adding its own terms, so after the last tile out = o / l and lse = m + log l
// exactly as if the whole row had been normalized at once. Rows whose keys
// are all hidden keep m = -inf and l = 0 and end with out = 0, lse = -inf.
// Backward needs only lse: p_ij = exp(s_ij - lse_i) (Note [Backward passes]
// in attention_backward.cpp).
//
// Note [Tile sizes]
// Each tile product is handed to the BLAS directly (Note [Direct BLAS calls]
// in blas.h). An OpenBLAS built with pthreads splits a product over its own
// threads once m*n*k exceeds 4 * 65536; called from several ATen threads at
// once that oversubscribes the cores and measured 2x slower. Tiles are 64
// query rows by as many keys as keep m*n*k = 64 * keys * head_dim at that
// bound (64 keys for head dim 64), between 16 and 256 keys.
#include "scaletrain/kernels/attention.h"

#include <sstream>
#include <string>

#include "scaletrain/kernels/attention_detail.h"
#include "scaletrain/kernels/blas.h"
#include "scaletrain/util/error.h"

namespace scaletrain::kernels {
namespace detail {
namespace {

constexpr int64_t kBlasSerialBound = 4 * 65536;  // Note [Tile sizes]

void expect(bool ok, const std::string& what) {
  if (!ok) throw UsageError("attention: " + what);
}

std::string shape(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

TileSizes choose_tiles(int64_t head_dim, TileSizes asked) {
  TileSizes t;
  t.q = asked.q > 0 ? asked.q : 64;
  const int64_t keys = kBlasSerialBound / (t.q * std::max<int64_t>(head_dim, 1)) / 16 * 16;
  t.k = asked.k > 0 ? asked.k : std::min<int64_t>(256, std::max<int64_t>(16, keys));
  return t;
}

void check_segments(const AttentionMask& m, int64_t B, int64_t Tq, int64_t Tk) {
  const bool qd = m.q_segments.defined(), kd = m.k_segments.defined();
  expect(qd == kd, std::string("q_segments and k_segments must be given together (q_segments ") +
                       (qd ? "given" : "missing") + ", k_segments " + (kd ? "given" : "missing") + ")");
  if (!qd) return;
  for (const auto* t : {&m.q_segments, &m.k_segments}) {
    expect(!at::isFloatingType(t->scalar_type()) && !t->is_complex(),
           std::string("segment ids must be integers, got ") + std::string(c10::toString(t->scalar_type())));
  }
  expect(m.q_segments.dim() == 2 && m.q_segments.size(0) == B && m.q_segments.size(1) == Tq,
         "q_segments must be [B, Tq] = [" + std::to_string(B) + ", " + std::to_string(Tq) + "], got " +
             shape(m.q_segments));
  expect(m.k_segments.dim() == 2 && m.k_segments.size(0) == B && m.k_segments.size(1) == Tk,
         "k_segments must be [B, Tk] = [" + std::to_string(B) + ", " + std::to_string(Tk) + "], got " +
             shape(m.k_segments));
}

}  // namespace

Geometry resolve_geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask,
                          TileSizes tiles, bool host_only) {
  expect(q.defined() && k.defined() && v.defined(), "q, k and v must be defined tensors");
  expect(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D [B, heads, T, head_dim], got q " +
                                                           shape(q) + ", k " + shape(k) + ", v " + shape(v));
  expect(k.sizes() == v.sizes(), "k and v must have the same shape, got k " + shape(k) + ", v " + shape(v));
  expect(q.size(0) == k.size(0), "batch sizes differ: q " + shape(q) + ", k " + shape(k));
  expect(q.size(3) == k.size(3), "head dims differ: q has " + std::to_string(q.size(3)) + ", k and v have " +
                                     std::to_string(k.size(3)) + " (q " + shape(q) + ", k " + shape(k) + ")");
  expect(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
         "query heads H=" + std::to_string(q.size(1)) + " must be a multiple of kv heads Hkv=" +
             std::to_string(k.size(1)));
  const auto dt = q.scalar_type();
  expect(k.scalar_type() == dt && v.scalar_type() == dt,
         std::string("q, k, v dtypes differ: ") + c10::toString(dt) + ", " + c10::toString(k.scalar_type()) + ", " +
             c10::toString(v.scalar_type()));
  expect(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
         std::string("dtype must be float, double, bfloat16 or half, got ") + c10::toString(dt));
  expect(!host_only || (q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu()),
         "q, k, v must be CPU tensors");
  expect(k.device() == q.device() && v.device() == q.device(), "q, k, v must be on one device");
  expect(mask.window >= 0, "window must be >= 0, got " + std::to_string(mask.window));
  expect(mask.scale >= 0 && std::isfinite(mask.scale), "scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got " +
                                                           std::to_string(mask.scale));
  check_segments(mask, q.size(0), q.size(2), k.size(2));

  Geometry g;
  g.B = q.size(0), g.H = q.size(1), g.Hkv = k.size(1), g.Tq = q.size(2), g.Tk = k.size(2), g.D = q.size(3);
  g.group = g.H / g.Hkv;
  g.scale = mask.scale > 0 ? mask.scale : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(g.D, 1)));
  g.causal = mask.causal, g.window = mask.window, g.q_offset = mask.q_offset, g.k_offset = mask.k_offset;
  g.tile = choose_tiles(g.D, tiles);
  g.q_tiles = (g.Tq + g.tile.q - 1) / g.tile.q;
  g.k_tiles = (g.Tk + g.tile.k - 1) / g.tile.k;
  return g;
}

TileMask::TileMask(const Geometry& g, const at::Tensor& q_seg, const at::Tensor& k_seg) : g_(g) {
  if (!q_seg.defined()) return;
  q_seg_ = q_seg.to(at::kLong).contiguous();
  k_seg_ = k_seg.to(at::kLong).contiguous();
  qseg_ = q_seg_.data_ptr<int64_t>();
  kseg_ = k_seg_.data_ptr<int64_t>();
  // Id range per (batch, tile): a tile pair whose ranges are disjoint has no
  // query and key of the same document.
  auto ranges = [&](const int64_t* ids, int64_t T, int64_t tile, int64_t tiles, std::vector<int64_t>& lo,
                    std::vector<int64_t>& hi) {
    lo.assign(g.B * tiles, 0);
    hi.assign(g.B * tiles, 0);
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t* first = ids + b * T + t * tile;
        const auto mm = std::minmax_element(first, first + std::min(tile, T - t * tile));
        lo[b * tiles + t] = *mm.first;
        hi[b * tiles + t] = *mm.second;
      }
  };
  ranges(qseg_, g.Tq, g.tile.q, g.q_tiles, q_lo_, q_hi_);
  ranges(kseg_, g.Tk, g.tile.k, g.k_tiles, k_lo_, k_hi_);
}

TileCover TileMask::cover(int64_t b, int64_t qt, int64_t kt) const {
  const int64_t q_first = g_.q_offset + qt * g_.tile.q;
  const int64_t q_last = g_.q_offset + std::min(g_.Tq, (qt + 1) * g_.tile.q) - 1;
  const int64_t k_first = g_.k_offset + kt * g_.tile.k;
  const int64_t k_last = g_.k_offset + std::min(g_.Tk, (kt + 1) * g_.tile.k) - 1;
  bool whole = true;
  if (g_.causal) {
    if (k_first > q_last) return TileCover::kHidden;
    whole = whole && k_last <= q_first;
  }
  if (g_.window > 0) {
    if (q_first - k_last >= g_.window) return TileCover::kHidden;
    whole = whole && q_last - k_first < g_.window;
  }
  if (qseg_ != nullptr) {
    const int64_t qlo = q_lo_[b * g_.q_tiles + qt], qhi = q_hi_[b * g_.q_tiles + qt];
    const int64_t klo = k_lo_[b * g_.k_tiles + kt], khi = k_hi_[b * g_.k_tiles + kt];
    if (qhi < klo || khi < qlo) return TileCover::kHidden;
    whole = whole && qlo == qhi && klo == khi && qlo == klo;
  }
  return whole ? TileCover::kVisible : TileCover::kPartial;
}

namespace {

// One query tile of one head against all its key tiles (Note [Online softmax]).
// The running output accumulates in place in `out`, whose rows this task owns.
template <typename T>
void forward_query_tile(const Geometry& g, const TileMask& mask, int64_t task, const T* q, const T* k, const T* v,
                        T* out, T* lse, std::vector<T>& scores, std::vector<T>& run_max, std::vector<T>& run_sum) {
  const int64_t bh = task % (g.B * g.H), qt = g.q_tiles - 1 - task / (g.B * g.H);  // longest rows first
  const int64_t b = bh / g.H, kvh = b * g.Hkv + (bh % g.H) / g.group;
  const int64_t i0 = qt * g.tile.q, m = std::min(g.tile.q, g.Tq - i0), D = g.D;
  const T scale = static_cast<T>(g.scale), ninf = -std::numeric_limits<T>::infinity();
  T* o = out + (bh * g.Tq + i0) * D;
  std::fill(o, o + m * D, T(0));
  std::fill(run_max.begin(), run_max.begin() + m, ninf);
  std::fill(run_sum.begin(), run_sum.begin() + m, T(0));
  const T* q_tile = q + (bh * g.Tq + i0) * D;
  const T* k_head = k + kvh * g.Tk * D;
  const T* v_head = v + kvh * g.Tk * D;

  for (int64_t kt = 0; kt < g.k_tiles; ++kt) {
    const TileCover cover = mask.cover(b, qt, kt);
    if (cover == TileCover::kHidden) continue;
    const int64_t j0 = kt * g.tile.k, n = std::min(g.tile.k, g.Tk - j0);
    gemm<T>(false, true, m, n, D, T(1), q_tile, D, k_head + j0 * D, D, T(0), scores.data(), n);
    if (cover == TileCover::kPartial) mask.hide(b, i0, m, j0, n, scores.data());
    for (int64_t r = 0; r < m; ++r) {
      T* s = scores.data() + r * n;
      const T new_max = std::max(run_max[r], scale * row_max(s, n));
      if (new_max == ninf) {  // nothing visible in this row yet
        std::fill(s, s + n, T(0));
        continue;
      }
      const T keep = run_max[r] == ninf ? T(0) : std::exp(run_max[r] - new_max);
      run_sum[r] = run_sum[r] * keep + exp_affine_row(s, n, scale, new_max);
      run_max[r] = new_max;
      if (keep != T(1)) {
        T* orow = o + r * D;
        for (int64_t d = 0; d < D; ++d) orow[d] *= keep;
      }
    }
    gemm<T>(false, false, m, D, n, T(1), scores.data(), n, v_head + j0 * D, D, T(1), o, D);
  }
  for (int64_t r = 0; r < m; ++r) {
    T* orow = o + r * D;
    if (run_sum[r] == T(0)) {  // the row saw no key: out stays 0
      lse[bh * g.Tq + i0 + r] = ninf;
      continue;
    }
    const T inv = T(1) / run_sum[r];
    for (int64_t d = 0; d < D; ++d) orow[d] *= inv;
    lse[bh * g.Tq + i0 + r] = run_max[r] + std::log(run_sum[r]);
  }
}

}  // namespace

template <typename T>
void forward_kernel(const Geometry& g, const TileMask& mask, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, at::Tensor& out, at::Tensor& lse) {
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T *op = out.data_ptr<T>(), *lp = lse.data_ptr<T>();
  struct Scratch {
    std::vector<T> scores, run_max, run_sum;
  };
  auto make = [&] {
    return Scratch{std::vector<T>(g.tile.q * g.tile.k), std::vector<T>(g.tile.q), std::vector<T>(g.tile.q)};
  };
  run_tasks<Scratch>(g.B * g.H * g.q_tiles, make, [&](int64_t task, Scratch& s) {
    forward_query_tile<T>(g, mask, task, qp, kp, vp, op, lp, s.scores, s.run_max, s.run_sum);
  });
}

template void forward_kernel<float>(const Geometry&, const TileMask&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, at::Tensor&, at::Tensor&);
template void forward_kernel<double>(const Geometry&, const TileMask&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, at::Tensor&, at::Tensor&);

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor as_compute(const at::Tensor& t, at::ScalarType ct) { return t.to(ct).contiguous(); }

// Note [Attention function]: out and lse are both differentiable outputs.
// Saved for backward: q, k, v as given (no upcast copies kept alive), out,
// lse and the mask fields; the probabilities are recomputed.
struct FlashAttentionFunction : public torch::autograd::Function<FlashAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionMask& mask, TileSizes tiles) {
    const Geometry g = resolve_geometry(q, k, v, mask, tiles);
    const TileMask tmask(g, mask.q_segments, mask.k_segments);
    const auto ct = compute_type(q);
    const at::Tensor qc = as_compute(q, ct), kc = as_compute(k, ct), vc = as_compute(v, ct);
    at::Tensor out = at::empty({g.B, g.H, g.Tq, g.D}, qc.options());
    at::Tensor lse = at::empty({g.B, g.H, g.Tq}, qc.options());
    if (ct == at::kDouble)
      forward_kernel<double>(g, tmask, qc, kc, vc, out, lse);
    else
      forward_kernel<float>(g, tmask, qc, kc, vc, out, lse);
    out = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    auto& d = ctx->saved_data;
    d["causal"] = mask.causal, d["window"] = mask.window, d["q_offset"] = mask.q_offset;
    d["k_offset"] = mask.k_offset, d["scale"] = mask.scale, d["q_segments"] = mask.q_segments;
    d["k_segments"] = mask.k_segments, d["tile_q"] = tiles.q, d["tile_k"] = tiles.k;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    auto& d = ctx->saved_data;
    AttentionMask mask;
    mask.causal = d["causal"].toBool(), mask.window = d["window"].toInt(), mask.q_offset = d["q_offset"].toInt();
    mask.k_offset = d["k_offset"].toInt(), mask.scale = d["scale"].toDouble();
    mask.q_segments = d["q_segments"].toTensor(), mask.k_segments = d["k_segments"].toTensor();
    const TileSizes tiles{d["tile_q"].toInt(), d["tile_k"].toInt()};
    const Geometry g = resolve_geometry(q, k, v, mask, tiles);
    const TileMask tmask(g, mask.q_segments, mask.k_segments);

    const auto ct = compute_type(q);
    const at::Tensor qc = as_compute(q, ct), kc = as_compute(k, ct), vc = as_compute(v, ct);
    const at::Tensor out = as_compute(saved[3], ct), lse = saved[4].contiguous();
    const at::Tensor dout = grads[0].defined() ? as_compute(grads[0], ct) : at::zeros_like(out);
    const at::Tensor dlse = grads[1].defined() ? as_compute(grads[1], ct) : at::Tensor();
    at::Tensor dq, dk, dv;
    if (ct == at::kDouble)
      std::tie(dq, dk, dv) = backward_kernel<double>(g, tmask, qc, kc, vc, out, lse, dout, dlse);
    else
      std::tie(dq, dk, dv) = backward_kernel<float>(g, tmask, qc, kc, vc, out, lse, dout, dlse);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attention_tiled(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, const AttentionMask& mask,
                                                         TileSizes tiles) {
  const variable_list r = FlashAttentionFunction::apply(q, k, v, mask, tiles);
  return {r[0], r[1]};
}

}  // namespace detail

std::tuple<torch::Tensor, torch::Tensor> flash_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, const AttentionMask& mask) {
  return detail::flash_attention_tiled(q, k, v, mask, detail::TileSizes{});
}

std::tuple<torch::Tensor, torch::Tensor> flash_attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v, const AttentionMask& mask) {
  torch::NoGradGuard no_grad;
  const detail::Geometry g = detail::resolve_geometry(q, k, v, mask, detail::TileSizes{});
  const detail::TileMask tmask(g, mask.q_segments, mask.k_segments);
  const auto ct = detail::compute_type(q);
  const at::Tensor qc = detail::as_compute(q, ct), kc = detail::as_compute(k, ct), vc = detail::as_compute(v, ct);
  at::Tensor out = at::empty({g.B, g.H, g.Tq, g.D}, qc.options());
  at::Tensor lse = at::empty({g.B, g.H, g.Tq}, qc.options());
  if (ct == at::kDouble)
    detail::forward_kernel<double>(g, tmask, qc, kc, vc, out, lse);
  else
    detail::forward_kernel<float>(g, tmask, qc, kc, vc, out, lse);
  return {out, lse};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> flash_attention_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
    const torch::Tensor& lse, const torch::Tensor& dout, const AttentionMask& mask) {
  torch::NoGradGuard no_grad;
  const detail::Geometry g = detail::resolve_geometry(q, k, v, mask, detail::TileSizes{});
  const detail::TileMask tmask(g, mask.q_segments, mask.k_segments);
  const auto ct = detail::compute_type(q);
  const at::Tensor qc = detail::as_compute(q, ct), kc = detail::as_compute(k, ct), vc = detail::as_compute(v, ct);
  const at::Tensor oc = detail::as_compute(out, ct), lc = detail::as_compute(lse, ct), dc = detail::as_compute(dout, ct);
  if (ct == at::kDouble) return detail::backward_kernel<double>(g, tmask, qc, kc, vc, oc, lc, dc, at::Tensor());
  return detail::backward_kernel<float>(g, tmask, qc, kc, vc, oc, lc, dc, at::Tensor());
}

std::tuple<torch::Tensor, torch::Tensor> naive_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, const AttentionMask& mask) {
  const detail::Geometry g = detail::resolve_geometry(q, k, v, mask, detail::TileSizes{}, /*host_only=*/false);
  const auto ct = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (g.Tk == 0) {  // no keys at all: every row is empty
    return {at::zeros_like(q), at::full({g.B, g.H, g.Tq}, -std::numeric_limits<double>::infinity(), q.options().dtype(ct))};
  }
  at::Tensor kc = k.to(ct), vc = v.to(ct);
  if (g.group > 1) kc = kc.repeat_interleave(g.group, 1), vc = vc.repeat_interleave(g.group, 1);

  // Visible (query, key) pairs: [1 or B, 1, Tq, Tk].
  const auto longs = q.options().dtype(at::kLong);
  const at::Tensor qpos = at::arange(g.Tq, longs).add(g.q_offset).unsqueeze(1);
  const at::Tensor kpos = at::arange(g.Tk, longs).add(g.k_offset).unsqueeze(0);
  at::Tensor visible = at::ones({g.Tq, g.Tk}, q.options().dtype(at::kBool));
  if (g.causal) visible = visible.logical_and(kpos.le(qpos));
  if (g.window > 0) visible = visible.logical_and((qpos - kpos).lt(g.window));
  visible = visible.view({1, 1, g.Tq, g.Tk});
  if (mask.q_segments.defined()) {
    const at::Tensor same = mask.q_segments.to(at::kLong).unsqueeze(2).eq(mask.k_segments.to(at::kLong).unsqueeze(1));
    visible = visible.logical_and(same.unsqueeze(1));
  }

  at::Tensor s = at::matmul(q.to(ct) * g.scale, kc.transpose(-2, -1));
  s.masked_fill_(visible.logical_not(), -std::numeric_limits<double>::infinity());
  const bool some_row_empty = !visible.any(-1).all().item<bool>();
  if (!some_row_empty) {  // the common case: plain softmax
    return {at::matmul(at::softmax(s, -1), vc).to(q.scalar_type()), at::logsumexp(s, -1)};
  }
  // Rows without a visible key: shift by a finite maximum, divide by a sum
  // that is never 0, and mask lse afterwards, so no NaN reaches the values or
  // the gradients. The shift is detached: lse and p do not depend on it.
  at::Tensor row_max = std::get<0>(s.detach().max(-1, true));
  row_max = row_max.masked_fill(row_max.isinf(), 0);
  const at::Tensor e = at::exp(s - row_max);
  const at::Tensor sum = e.sum(-1, true);
  const at::Tensor empty = sum.eq(0);
  const at::Tensor safe_sum = sum.masked_fill(empty, 1);
  const at::Tensor out = at::matmul(e / safe_sum, vc);
  const at::Tensor lse = (at::log(safe_sum) + row_max).masked_fill(empty, -std::numeric_limits<double>::infinity());
  return {out.to(q.scalar_type()), lse.squeeze(-1)};
}

}  // namespace scaletrain::kernels

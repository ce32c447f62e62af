// Backward pass of the tiled attention (attention.h): the gradients of q, k
// and v from those of out and lse, recomputing the probabilities tile by tile.
//
// Note [Backward passes]
// With s_ij = scale q_i.k_j (hidden pairs -inf) and p_ij = exp(s_ij - lse_i):
//   dv_j = sum_i p_ij do_i
//   dp_ij = do_i.v_j
//   ds_ij = p_ij (dp_ij - delta_i),  delta_i = do_i.out_i - dlse_i
//   dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i
// (d lse_i / d s_ij = p_ij gives the dlse term; d out_i / d s_ij gives
// p_ij (v_j - out_i)). delta is computed once per row up front.
//
// Note [Write races]
// A task owns key tiles of one kv head: it accumulates their dk and dv over
// every query head of the group and every query tile, so dk and dv need no
// synchronisation. dq_i collects from every key tile; a task adds its part to
// dq directly when it owns all key tiles of its kv head, which it does when
// there are at least kMinTasks kv heads in the batch (the common case). With
// fewer heads the key tiles are dealt round-robin into `classes` groups (tile
// kt to group kt % classes, which also balances causal masks), each group
// adds into its own copy of dq, and the copies are summed in a fixed order
// afterwards: (classes - 1) extra dq-sized buffers, linear in Tq. The number of
// groups depends on the shapes only, never on the thread count, so results
// are bitwise the same on any number of threads. Each product runs once:
// five tile products and one exponential per visible tile pair.
#include <algorithm>

#include "scaletrain/kernels/attention_detail.h"
#include "scaletrain/kernels/blas.h"

namespace scaletrain::kernels::detail {
namespace {

constexpr int64_t kMinTasks = 8;  // Note [Write races]

int64_t key_classes(const Geometry& g) {
  const int64_t heads = std::max<int64_t>(1, g.B * g.Hkv);
  return std::max<int64_t>(1, std::min<int64_t>(g.k_tiles, (kMinTasks + heads - 1) / heads));
}

// Raw pointers of one backward call.
template <typename T>
struct BackwardData {
  const T *q, *k, *v, *dout, *lse, *delta;
  T *dk, *dv, *dq;  // dq: the first of `classes` dq-sized buffers
  int64_t classes;
};

template <typename T>
struct BackwardScratch {
  std::vector<T> probs, dprobs;  // one [tile.q, tile.k] tile each
};

// One query tile of head bh against key tile j0..j0+n: recomputes the
// probabilities, adds this pair's share to dv, dk (tiles owned by the task)
// and to the task's dq buffer.
template <typename T>
void backward_pair(const Geometry& g, const TileMask& mask, const BackwardData<T>& in, int64_t b, int64_t bh,
                   int64_t qt, int64_t j0, int64_t n, TileCover cover, T* dq, BackwardScratch<T>& s,
                   const T* k_tile, const T* v_tile, T* dk_tile, T* dv_tile) {
  const int64_t i0 = qt * g.tile.q, m = std::min(g.tile.q, g.Tq - i0), row0 = bh * g.Tq + i0, D = g.D;
  const T scale = static_cast<T>(g.scale);
  const T *q_tile = in.q + row0 * D, *do_tile = in.dout + row0 * D;
  T *p_tile = s.probs.data(), *dp_tile = s.dprobs.data();

  gemm<T>(false, true, m, n, D, T(1), q_tile, D, k_tile, D, T(0), p_tile, n);
  if (cover == TileCover::kPartial) mask.hide(b, i0, m, j0, n, s.probs.data());
  for (int64_t r = 0; r < m; ++r) {
    T* p = s.probs.data() + r * n;
    const T lse = in.lse[row0 + r];
    if (lse == -std::numeric_limits<T>::infinity())
      std::fill(p, p + n, T(0));  // a row that sees no key has no gradient
    else
      exp_affine_row(p, n, scale, lse);
  }
  gemm<T>(true, false, n, D, m, T(1), p_tile, n, do_tile, D, T(1), dv_tile, D);
  gemm<T>(false, true, m, n, D, T(1), do_tile, D, v_tile, D, T(0), dp_tile, n);
  for (int64_t r = 0; r < m; ++r) {
    const T* p = s.probs.data() + r * n;
    T* ds = s.dprobs.data() + r * n;
    const T delta = in.delta[row0 + r];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) ds[c] = p[c] * (ds[c] - delta);
  }
  gemm<T>(true, false, n, D, m, scale, dp_tile, n, q_tile, D, T(1), dk_tile, D);
  gemm<T>(false, false, m, D, n, scale, dp_tile, n, k_tile, D, T(1), dq + row0 * D, D);
}

// Task = (batch, kv head, class of key tiles); Note [Write races].
template <typename T>
void backward_task(const Geometry& g, const TileMask& mask, const BackwardData<T>& in, int64_t task,
                   BackwardScratch<T>& s) {
  const int64_t cls = task % in.classes, bkv = task / in.classes;
  const int64_t b = bkv / g.Hkv, hk = bkv % g.Hkv, D = g.D;
  T* dq = in.dq + cls * g.B * g.H * g.Tq * D;
  for (int64_t kt = cls; kt < g.k_tiles; kt += in.classes) {
    const int64_t j0 = kt * g.tile.k, n = std::min(g.tile.k, g.Tk - j0), row0 = bkv * g.Tk + j0;
    std::fill(in.dk + row0 * D, in.dk + (row0 + n) * D, T(0));
    std::fill(in.dv + row0 * D, in.dv + (row0 + n) * D, T(0));
    const T *k_tile = in.k + row0 * D, *v_tile = in.v + row0 * D;
    T *dk_tile = in.dk + row0 * D, *dv_tile = in.dv + row0 * D;
    for (int64_t h = hk * g.group; h < (hk + 1) * g.group; ++h) {
      for (int64_t qt = 0; qt < g.q_tiles; ++qt) {
        const TileCover cover = mask.cover(b, qt, kt);
        if (cover == TileCover::kHidden) continue;
        backward_pair(g, mask, in, b, b * g.H + h, qt, j0, n, cover, dq, s, k_tile, v_tile, dk_tile, dv_tile);
      }
    }
  }
}

// delta_i = do_i.out_i - dlse_i for every row (Note [Backward passes]).
template <typename T>
at::Tensor row_deltas(const Geometry& g, const at::Tensor& out, const at::Tensor& dout, const at::Tensor& dlse) {
  at::Tensor delta = at::empty({g.B, g.H, g.Tq}, out.options());
  const T *o = out.data_ptr<T>(), *d = dout.data_ptr<T>();
  const T* dl = dlse.defined() ? dlse.data_ptr<T>() : nullptr;
  T* out_delta = delta.data_ptr<T>();
  const int64_t D = g.D;
  at::parallel_for(0, g.B * g.H * g.Tq, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       T acc = 0;
                       for (int64_t c = 0; c < D; ++c) acc += o[i * D + c] * d[i * D + c];
                       out_delta[i] = acc - (dl != nullptr ? dl[i] : T(0));
                     }
                   });
  return delta;
}

// dq = sum over the classes' buffers, in class order.
template <typename T>
void sum_classes(const T* parts, int64_t classes, int64_t size, T* dq) {
  at::parallel_for(0, size, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T acc = parts[i];
      for (int64_t c = 1; c < classes; ++c) acc += parts[c * size + i];
      dq[i] = acc;
    }
  });
}

}  // namespace

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel(const Geometry& g, const TileMask& mask,
                                                               const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& out,
                                                               const at::Tensor& lse, const at::Tensor& dout,
                                                               const at::Tensor& dlse) {
  const at::Tensor delta = row_deltas<T>(g, out, dout, dlse);
  const int64_t classes = key_classes(g);
  at::Tensor dq = classes > 1 ? at::empty_like(q) : at::zeros_like(q);
  at::Tensor dk = at::empty_like(k), dv = at::empty_like(v);  // every key row is zeroed by its task
  at::Tensor parts = classes > 1 ? at::zeros({classes, g.B, g.H, g.Tq, g.D}, q.options()) : dq;
  const BackwardData<T> in{q.data_ptr<T>(),    k.data_ptr<T>(),     v.data_ptr<T>(),  dout.data_ptr<T>(),
                           lse.data_ptr<T>(),  delta.data_ptr<T>(), dk.data_ptr<T>(), dv.data_ptr<T>(),
                           parts.data_ptr<T>(), classes};
  auto make = [&] {
    return BackwardScratch<T>{std::vector<T>(g.tile.q * g.tile.k), std::vector<T>(g.tile.q * g.tile.k)};
  };
  run_tasks<BackwardScratch<T>>(g.B * g.Hkv * classes, make, [&](int64_t task, BackwardScratch<T>& s) {
    backward_task<T>(g, mask, in, task, s);
  });
  if (classes > 1) sum_classes<T>(parts.data_ptr<T>(), classes, dq.numel(), dq.data_ptr<T>());
  return {dq, dk, dv};
}

template std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel<float>(
    const Geometry&, const TileMask&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&);
template std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel<double>(
    const Geometry&, const TileMask&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&);

}  // namespace scaletrain::kernels::detail

#pragma once
// Scaled dot-product attention on the CPU without the [Tq, Tk] score matrix.
//
// flash_attention walks the keys in tiles and keeps, per query row, a running
// maximum, a running sum of exponentials and a running output (the "online
// softmax"), so a thread never holds more than one tile of scores. Backward
// recomputes the probabilities tile by tile from the saved log-sum-exp
// instead of storing them. Memory beyond the inputs and outputs is linear in
// the sequence length; the arithmetic skips key tiles that the mask hides
// completely (above the causal diagonal, outside a sliding window, or in
// other documents of a packed sequence).
//
// naive_attention computes the same thing with plain ATen ops on the whole
// score matrix. It is the reference the kernel is tested against and the
// baseline it is benchmarked against.
//
// Both also return the log-sum-exp of every query row, differentiably, so a
// caller that splits the keys into chunks (ring attention) can merge the
// partial results through autograd:
//   lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.
#include <torch/torch.h>

#include <cstdint>
#include <tuple>

namespace scaletrain::kernels {

// Which keys each query row sees. Positions are global: query row i sits at
// q_offset + i and key row j at k_offset + j, which lets a chunk of a longer
// sequence be attended with the right mask. A key is visible iff all of the
// enabled conditions hold.
struct AttentionMask {
  // Key visible only if k_pos <= q_pos.
  bool causal = true;
  // > 0: key visible only if q_pos - k_pos < window (with causal: the last
  // `window` positions up to and including the query's own; without causal
  // it bounds only how far back a query sees). 0: no window.
  int64_t window = 0;
  // Global position of query row 0.
  int64_t q_offset = 0;
  // Global position of key row 0.
  int64_t k_offset = 0;
  // Optional int64 [B, Tq]: the document id of every query of a packed
  // sequence. Given together with k_segments or not at all.
  torch::Tensor q_segments;
  // Optional int64 [B, Tk]: the document id of every key; a query sees a key
  // only if their ids are equal. Tiles are skipped when the id ranges of a
  // query tile and a key tile do not overlap (always correct; most effective
  // when ids are sorted along the sequence, as packing produces them).
  torch::Tensor k_segments;
  // Factor applied to q.k; 0 means 1 / sqrt(head_dim).
  double scale = 0;
};

// Attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D], H % Hkv == 0
// (grouped-query: query head h reads kv head h / (H / Hkv)).
//
// Returns {out [B, H, Tq, D] in q's dtype, lse [B, H, Tq]}: lse is the
// log-sum-exp of the scaled, masked scores of each query row, in float (double
// for double inputs). A row that sees no key gets out = 0 and lse = -inf, and
// gradients 0; nothing is NaN.
//
// Differentiable with respect to q, k and v, through out and through lse (an
// undefined gradient for either counts as zero). Inputs may be strided views;
// they are made contiguous inside. float and double are computed natively,
// bfloat16 and half with float accumulation (the result is rounded back to
// the input dtype). Runs on at::parallel_for threads.
//
// Throws scaletrain::UsageError, naming the values, for inconsistent shapes,
// dtypes or mask tensors.
//
// Threads: the tiles' matrix products go to the BLAS one at a time from each
// ATen thread and are sized to stay below OpenBLAS's own threading threshold,
// so an OpenBLAS built with pthreads does not oversubscribe the cores.
std::tuple<torch::Tensor, torch::Tensor> flash_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const AttentionMask& mask = {});

// The kernel without autograd, for callers that split the keys into chunks
// and merge the partial results themselves (ring attention, parallel/context),
// so that autograd keeps nothing per chunk. Tensors come back in the compute
// dtype: double for double inputs, float otherwise.
//
// flash_attention_forward: {out, lse} of q over these keys alone.
std::tuple<torch::Tensor, torch::Tensor> flash_attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                                 const torch::Tensor& v, const AttentionMask& mask = {});
// flash_attention_backward: {dq, dk, dv}, the part of the gradients that
// flows through these keys, given `out` and `lse` of the same queries over
// ALL their keys (every chunk merged) and the gradient `dout` of that out.
// Summing dq over the chunks, and taking each chunk's dk and dv, gives the
// gradients of the attention over the whole: with the merged lse each
// chunk's probabilities are its share of the whole softmax.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> flash_attention_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
    const torch::Tensor& lse, const torch::Tensor& dout, const AttentionMask& mask = {});

// The same semantics and return values, by materializing the [B, H, Tq, Tk]
// scores with ATen ops (differentiable by ATen's autograd). Memory is
// quadratic in the sequence length.
std::tuple<torch::Tensor, torch::Tensor> naive_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const AttentionMask& mask = {});

}  // namespace scaletrain::kernels

#pragma once
// Context parallelism: the sequence of every sample split over the cp ranks,
// so that no rank holds the activations of a whole long sequence.
//
// Note [Load-balanced chunks]
// A T-token sequence is cut into 2 cp equal chunks and rank i holds chunks i
// and 2 cp - 1 - i, in that order (the split of Megatron-LM and torchtitan).
// Under a causal mask a query of chunk c attends to c + 1 chunks of keys, so
// the pairs (i, 2 cp - 1 - i) give every rank the same 2 cp + 1 chunk pairs
// of work. Everything per token is split this way: the input ids, the
// targets, the positions (a token keeps its place in the whole sequence, so
// rotary and learned positions are those of one process) and the document
// ids of packed samples. Only attention mixes tokens; it runs over the cp
// group in one of two modes:
//
//   ring        each rank's keys and values travel once around the ring
//               (cp - 1 sends per layer), the next chunk in flight while the
//               one in hand is attended; each (query chunk, key chunk) pair
//               gives a partial output and its log-sum-exp, merged exactly by
//                 lse = log sum_j exp(lse_j),  out = sum_j exp(lse_j - lse) out_j.
//               Pairs that the causal mask hides whole are never computed.
//               Backward is autograd's: every hop's adjoint sends the
//               gradient of the keys and values it carried back one rank.
//   all_to_all  DeepSpeed-Ulysses: an all-to-all turns "my tokens, all
//               heads" into "all tokens, my heads / cp" for q, k and v,
//               attention runs on whole sequences, and the reverse
//               all-to-all returns the output; heads and key/value heads
//               must divide by cp.
//
// Both equal attention over the whole sequence on one process: the partial
// results are the kernel's own tiles regrouped, and the merge is the online
// softmax's. Gradients of the parameters come out per rank as the sum over
// its tokens; the engines sum them over dp x cp (Note [Context-parallel
// groups] in comm/mesh.h).
#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "scaletrain/comm/group.h"

namespace scaletrain::parallel::context {

enum class Mode { Ring, AllToAll };

// "ring" or "all_to_all"; UsageError naming anything else.
Mode parse_mode(const std::string& name);
const char* mode_name(Mode mode);

// The positions in a T-token sequence of rank `rank`'s tokens, in the order
// it holds them (Note [Load-balanced chunks]): int64 [T / cp]. UsageError
// when T is not a multiple of 2 cp.
torch::Tensor local_positions(int64_t T, int rank, int cp);

// x [B, T, ...] -> this rank's tokens [B, T / cp, ...] along dim 1 (a copy).
torch::Tensor shard_sequence(const torch::Tensor& x, int rank, int cp);

struct AttentionOptions {
  Mode mode = Mode::Ring;
  // The flash kernel (kernels/attention.h) for CPU tensors; false, or a
  // tensor elsewhere: the materialized reference path. Both give the partial
  // log-sum-exp the ring merges.
  bool flash = true;
};

// Causal attention of this rank's queries over the keys of the whole
// sequence. q [B, H, Tl, D], k and v [B, Hkv, Tl, D] hold this rank's tokens
// (shard_sequence of the whole, Tl = T / cp), H % Hkv == 0; `segments`
// [B, Tl] int64 are their document ids (a query sees keys of its own
// document only), or undefined for one document per row. Returns [B, H, Tl,
// D], differentiable in q, k and v.
//
// Collective over `cp`: every member calls it for the same layer, in the
// same order, with the same shapes. UsageError for shapes that cannot be
// split (all_to_all: heads or key/value heads not divisible by cp).
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& segments, comm::Group& cp, const AttentionOptions& options);

// What the mode cannot split for a model of these heads, one line; empty: it
// can. `heads` and `kv_heads` are per tensor-parallel rank.
std::string split_problem(Mode mode, int cp, int64_t heads, int64_t kv_heads, int64_t block_size);

}  // namespace scaletrain::parallel::context

#pragma once
// Fused output projection + cross-entropy that never holds the full
// [tokens, vocab] logits.
//
// A language model's last step is `logits = hidden @ weight^T (+ bias)`
// followed by a cross-entropy over the vocabulary. With a 128k vocabulary the
// logits of 4096 tokens are 2 GiB in fp32, and autograd keeps them (or the
// softmax) alive for backward, plus an equally large gradient. The fused path
// walks the tokens in chunks: for each chunk it computes that chunk's logits,
// the loss, and, while the logits are still in hand, their gradient
// (softmax - onehot), which it folds straight into the gradients of hidden,
// weight and bias. Backward then only scales those saved gradients by the
// incoming scalar. Peak extra memory is one chunk of logits plus the
// gradients autograd needs anyway. See Note [Chunked linear cross-entropy] in
// the .cpp file.
//
// `linear_cross_entropy_unfused` is the same contract built from plain ATen
// ops; it is the reference for the tests and the path taken for tensors that
// are not on the CPU (see `fused_linear_cross_entropy_applies`).
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>

namespace scaletrain::kernels {

// A vocabulary split across ranks (tensor parallelism, Note [A vocabulary
// split across ranks] in the .cpp file): `weight` holds rows [offset,
// offset + V) of a vocabulary of `total` entries, and targets index the whole
// vocabulary. The two reductions combine a [tokens, k] tensor over the ranks
// that hold the other rows, in place: elementwise maximum and sum. Every rank
// returns the loss over the whole vocabulary and forms the gradient of its
// own rows and its part of hidden's gradient (the caller sums that over the
// ranks, as the backward of a column-parallel linear's input does). Every
// rank must call with the same tokens and chunk size: the reductions are
// collectives, one pair per chunk.
struct VocabShard {
  int64_t offset = 0;
  int64_t total = 0;
  std::function<void(torch::Tensor&)> max_across;
  std::function<void(torch::Tensor&)> sum_across;
};

struct LinearCrossEntropyOptions {
  // Targets equal to this value contribute neither loss nor gradient, and are
  // not counted.
  int64_t ignore_index = -100;
  // Tokens per chunk. 0 picks a size whose logits take about 4-8 MiB, but at
  // least 128 tokens: each chunk reads and writes the whole weight gradient,
  // so a large vocabulary needs enough tokens per chunk to pay for that pass
  // (bench/RESULTS.md, fused linear + cross-entropy). Larger chunks run the matrix products at higher efficiency at
  // the cost of memory; negative values are rejected.
  int64_t chunk_tokens = 0;
  // For bf16/half inputs: true computes the logits, softmax and gradient
  // products in fp32 (the weight is converted once per call); false runs the
  // matrix products in the input dtype and only the softmax in fp32.
  bool upcast = true;
  // Set: the weight is this rank's part of a split vocabulary. Only the
  // fused CPU path of `linear_cross_entropy` takes it; the per-token variant
  // and the unfused path throw a UsageError.
  std::optional<VocabShard> vocab_shard;
};

// True when `linear_cross_entropy` takes the fused CPU kernel for this hidden
// tensor; false (CUDA or any other device, sparse layouts) means it calls the
// unfused path.
bool fused_linear_cross_entropy_applies(const torch::Tensor& hidden);

// Tokens per chunk that the fused kernel uses for a vocabulary of `vocab`
// entries whose logits have `element_size` bytes each, given the option value
// `requested` (0 = automatic).
int64_t linear_cross_entropy_chunk_tokens(int64_t vocab, int64_t element_size, int64_t requested);

// hidden [N, C] or [..., C] (flattened to N tokens), weight [V, C], bias [V]
// or an undefined tensor, targets [N] or [...] int64 with values in [0, V) or
// ignore_index. Returns {sum of the per-token losses over the kept targets,
// number of kept targets}: the sum is a 0-dim tensor in the compute dtype
// (double for double inputs, float otherwise), the count a 0-dim int64.
// Differentiable (first order) w.r.t. hidden, weight and bias; the count is
// not differentiable. The gradients are formed during forward and handed over
// by the first backward, so backward through one result runs once (a second
// one, via retain_graph, throws). The model's mean loss is `sum / count.clamp_min(1)`.
// Throws scaletrain::UsageError on malformed input.
std::tuple<torch::Tensor, torch::Tensor> linear_cross_entropy(const torch::Tensor& hidden,
                                                              const torch::Tensor& weight,
                                                              const torch::Tensor& bias,
                                                              const torch::Tensor& targets,
                                                              const LinearCrossEntropyOptions& options = {});

// Per-token losses [N] (0 at ignored targets) in the compute dtype, for
// callers that weight tokens. Forward keeps no logits; backward recomputes
// them chunk by chunk, since the per-token weights are known only then.
torch::Tensor linear_cross_entropy_per_token(const torch::Tensor& hidden, const torch::Tensor& weight,
                                             const torch::Tensor& bias, const torch::Tensor& targets,
                                             const LinearCrossEntropyOptions& options = {});

// The same two contracts through matmul + cross_entropy: the full logits are
// materialised. chunk_tokens is ignored.
std::tuple<torch::Tensor, torch::Tensor> linear_cross_entropy_unfused(
    const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& bias,
    const torch::Tensor& targets, const LinearCrossEntropyOptions& options = {});
torch::Tensor linear_cross_entropy_per_token_unfused(const torch::Tensor& hidden, const torch::Tensor& weight,
                                                     const torch::Tensor& bias, const torch::Tensor& targets,
                                                     const LinearCrossEntropyOptions& options = {});

}  // namespace scaletrain::kernels

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

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/precision/fp8_format.h"
#include "scaletrain/precision/options.h"

namespace scaletrain::precision {

// uint8 codes of x * scale (any floating dtype, any device), shaped like x.
at::Tensor fp8_quantize(const at::Tensor& x, Fp8Format format, double scale, bool saturate = true);
// The same cast as tensor operations: what fp8_quantize runs on a device (on
// the host it runs one fused loop); both must give fp8_encode()'s codes.
at::Tensor fp8_quantize_by_tensor_ops(const at::Tensor& x, Fp8Format format, double scale, bool saturate = true);
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
  // The amax recorded `age` casts ago (0: the last); age < history().size().
  double at_age(size_t age) const;
  // Note [FP8 scaling state]: sets the history to `count` entries, all 0
  // except the given (age, amax) pairs, and the scale. Entries older than
  // this history's length are dropped.
  void restore(size_t count, double scale, const std::vector<std::pair<size_t, double>>& entries);

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

// Note [FP8 linears]: an FP8 linear computes x W^T as an FP8 GEMM does. Its
// input and weight are cast to E4M3 codes with their own scales, the codes'
// values are multiplied and summed in fp32, and the sum is multiplied by
// 1 / (scale_x * scale_w) and returned in the compute dtype (autocast's, or
// the input's). The backward casts the output gradient to E5M2 (HYBRID; E4M3
// otherwise) and computes dX = G W and dW = G^T X from the codes the forward
// saved (a quarter of the bytes of fp32 activations). The product of two
// FP8 values is exact in fp32, so this emulation equals an FP8 GEMM with fp32
// accumulation; it is what runs on every device (libtorch 1.13 has no FP8
// dtype or scaled matmul). The bias is added outside, in the compute dtype.
//
// Scales: with the delayed recipe every cast uses the scale its history
// gives and notes its amax; at the end of a step (fp8_end_step) the step's
// amaxes of every layer are reduced with MAX over the groups that must agree
// (data- and tensor-parallel: ranks that see parts of one batch or pieces of
// one tensor) in one all-reduce and recorded, so the scales change only
// between steps, are the same on every rank, and do not depend on how a
// global batch is split into ranks and micro-batches. The current recipe
// takes each cast's own amax on this rank (no communication, so ranks may
// differ).
//
// A gradient is cast relative to the loss's multiplier m (loss scale /
// micro-batches, set each step): its amax is noted as amax / m and its cast
// scale is the recipe's scale / m. So the history holds the same numbers
// however a global batch is split (m halves when the micro-batches of a
// rank double), a dynamic loss scale's changes do not disturb it, and, as m
// is a power of two in those cases, the codes are exactly the same.
struct Fp8LinearOptions {
  Fp8Mix mix = Fp8Mix::Hybrid;
  bool delayed = true;     // false: current scaling
  int64_t history = 1024;  // delayed: amax history length (>= 1)
  int margin = 0;
};

class Fp8Linear {
 public:
  enum Operand { Input = 0, Weight = 1, Grad = 2 };
  explicit Fp8Linear(const Fp8LinearOptions& o);
  // x [..., in] times w [out, in] transposed -> [..., out] (no bias), differentiable in x and w.
  at::Tensor matmul(const at::Tensor& x, const at::Tensor& w);
  const Fp8LinearOptions& options() const { return o_; }
  Fp8Format format(Operand which) const { return fp8_format(o_.mix, which == Grad); }
  // The scale a cast of `which` uses now (delayed), or the one the last cast used (current).
  double scale(Operand which) const { return o_.delayed ? scaling_[which].scale() : last_scale_[which]; }
  // The largest |value| cast of each operand since the last end_step(), on this rank.
  const std::array<double, 3>& step_amax() const { return step_amax_; }
  // Records a step's (reduced) amaxes in the histories and starts the next step.
  void end_step(const std::array<double, 3>& amax);
  // The scale for a cast of `which` whose own amax is `amax` (the current recipe
  // uses it, the delayed one its history), noting amax for the step.
  double cast_scale(Operand which, double amax);
  const DelayedScaling& history(Operand which) const { return scaling_[which]; }
  DelayedScaling& history(Operand which) { return scaling_[which]; }
  // What the loss was multiplied by before backward (loss scale / micro-batches
  // of the step): gradient amaxes and scales are taken relative to it.
  void set_loss_multiplier(double m) { loss_multiplier_ = m; }
  double loss_multiplier() const { return loss_multiplier_; }

 private:
  Fp8LinearOptions o_;
  std::array<DelayedScaling, 3> scaling_;
  std::array<double, 3> step_amax_{0, 0, 0};
  std::array<double, 3> last_scale_{1, 1, 1};
  double loss_multiplier_ = 1.0;
};
using Fp8LinearPtr = std::shared_ptr<Fp8Linear>;

// From the config's precision section (fp8_format, fp8_recipe, fp8_amax_history, fp8_margin).
Fp8LinearOptions fp8_linear_options(const PrecisionOptions& p);

// Ends a step of every layer: their step amaxes reduced with MAX over
// `groups` (null and single-rank groups skipped) in one all-reduce, then
// recorded. Collective over the groups; every rank passes its layers in the
// same order. Nothing to do (and no communication) for the current recipe.
void fp8_end_step(const std::vector<Fp8LinearPtr>& layers, const std::vector<comm::Group*>& groups);

// Note [FP8 scaling state]: what a checkpoint keeps of delayed scaling, so a
// resumed run casts with the scales an uninterrupted one would. A future
// scale is the largest amax of a sliding window, so an entry matters only
// while no younger entry is at least as large: per layer and operand (input,
// weight, gradient) the state is [scale, count, k, then k (age, amax)
// pairs], the entries larger than every younger one. Under pipeline
// parallelism a rank records only its stage's layers (the others see amax 0
// every step), so the state is agreed with one MAX all-reduce over the whole
// job first; a scale counts only from ranks whose history of that layer is
// not all zero.
//
// The state of `layers` (delayed recipe), agreed over `groups` (collective;
// every rank passes the same layers); empty for the current recipe.
std::vector<double> fp8_scaling_state(const std::vector<Fp8LinearPtr>& layers, const std::vector<comm::Group*>& groups);
// Restores fp8_scaling_state()'s output into `layers`; throws
// std::invalid_argument saying what does not fit (another model, a corrupt value).
void fp8_restore_scaling(const std::vector<Fp8LinearPtr>& layers, const std::vector<double>& state);

// Note [FP8 on the wire]: gradients averaged over a group move as FP8 codes,
// a quarter of fp32's bytes. A flat fp32 tensor of N elements is cut into
// the group's W chunks of c = ceil(N / W) (zero-padded); each rank casts its
// whole tensor with one scale of its own (fp8_max / its amax) and sends
// chunk j, with that scale's 8 bytes appended, to rank j (all_to_all). Rank
// j sums the W chunks it received, each decoded and divided by its sender's
// scale, in fp32 and divides by W: that is the reduce-scatter. For the
// all-reduce, rank j then casts its averaged chunk with a fresh scale and
// every chunk is all-gathered the same way, so every rank decodes the same
// bytes and holds the same average. On the wire: (W - 1)(c + 8) bytes out
// per rank for the reduce-scatter and as much again for the all-gather,
// against fp32's 4(W - 1)c each (a ring, or our Gloo reduce-scatter). Each
// cast rounds every element once (E5M2 keeps 2 significand bits, E4M3 3);
// an amax of 0 or one that is not finite (an overflowed step) uses scale 1,
// and the NaN or infinity travels on (a saturated cast would hide it, so
// these casts do not saturate). Stages after the all_to_all run when the
// returned Work is waited on.
//
// The average of `flat` (fp32, contiguous) over `group`, in place once waited.
comm::Work fp8_all_reduce_avg(comm::Group& group, at::Tensor flat, Fp8Format format);
// This rank's chunk of the average of `full` (fp32, contiguous, N elements)
// over `group`, into `shard` (group.shard_numel(N) elements, fp32) once waited.
comm::Work fp8_reduce_scatter_avg(comm::Group& group, at::Tensor full, at::Tensor shard, Fp8Format format);
// Bytes one rank hands to the collectives of fp8_all_reduce_avg for N elements.
int64_t fp8_all_reduce_bytes(int64_t numel, int world);

}  // namespace scaletrain::precision

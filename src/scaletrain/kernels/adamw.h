#pragma once
// One AdamW step over a tensor, fused for the CPU.
//
// Built from ATen ops the step is eight passes over whole tensors (mul_,
// lerp_, mul_, addcmul_, sqrt, div, add_, addcdiv_), two of them into new
// temporaries. The fused kernel makes one trip through
// p, g, m and v, element by element, threaded with at::parallel_for and
// vectorised, and gives the same bits as the ATen ops (Note [Fused AdamW
// arithmetic] in the .cpp file says how).
//
// adamw_step_unfused is the same contract as plain ATen ops: the reference
// for the tests, the path for tensors the fused kernel does not take (see
// fused_adamw_applies), and the optimizer's path with fused off.
#include <ATen/ATen.h>

#include <cstdint>

namespace scaletrain::kernels {

// The scalars of one step, as optim::AdamW computes them (step t counts from 1).
struct AdamWStep {
  double lr = 0;                     // this step's learning rate
  double beta1 = 0.9;                // decay of the first-moment average
  double beta2 = 0.95;               // decay of the second-moment average
  double eps = 1e-8;                 // added to the denominator
  double weight_decay = 0;           // decoupled decay (0: none, whatever decay_numel says)
  double bias_correction1 = 1;       // 1 - beta1^t
  double bias_correction2_sqrt = 1;  // sqrt(1 - beta2^t)
};

// True when fused_adamw_step runs the fused kernel on these tensors: all
// defined, on the CPU, strided and contiguous, of one dtype (float or
// double; the gradient too), with the same number of elements, and no two
// of them overlapping in memory. Anything else takes adamw_step_unfused.
bool fused_adamw_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v);

// One AdamW step in place on parameter p with gradient g and moments m, v:
//   p <- p (1 - lr wd)                 for the first decay_numel elements
//   m <- lerp(m, g, 1 - beta1)
//   v <- beta2 v + (1 - beta2) g^2
//   p <- p - lr / bc1 * m / (sqrt(v) / bc2_sqrt + eps)
// decay_numel counts the leading elements (in memory order) that get weight
// decay: p.numel() for the whole tensor, 0 for none, anything in between for
// a flat (1-D) shard. Tensors fused_adamw_applies rejects go to
// adamw_step_unfused. Results do not depend on the number of threads.
void fused_adamw_step(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t decay_numel,
                      const AdamWStep& s);

// The same step as ATen ops (mul_, lerp_, mul_ + addcmul_, sqrt, div, add_,
// addcdiv_), for any tensors those ops take; a partial decay_numel needs a
// 1-D p.
void adamw_step_unfused(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, int64_t decay_numel,
                        const AdamWStep& s);

}  // namespace scaletrain::kernels

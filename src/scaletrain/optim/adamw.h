#pragma once
// AdamW (decoupled weight decay, Loshchilov & Hutter) over a list of tensors.
//
// It works on whatever tensors it is given: full parameters (DDP) or flat
// shards of them (ZeRO/FSDP), as long as each tensor's .grad is set. State is
// plain tensors so checkpoints can save and reshard it.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"

namespace scaletrain::kernels {
struct AdamWStep;  // kernels/adamw.h
}  // namespace scaletrain::kernels

namespace scaletrain::optim {

struct AdamWOptions {
  double lr = 3e-4;           // peak learning rate (a schedule may scale it per step)
  double beta1 = 0.9;         // decay of the first-moment average
  double beta2 = 0.95;        // decay of the second-moment average (0.95: the usual choice for LLM pretraining)
  double eps = 1e-8;          // added to the denominator
  double weight_decay = 0.1;  // decoupled decay, applied to tensors marked decay=true
  // "" keeps the moment estimates in memory; a directory puts them in
  // file-backed mappings there (optim/file_backed.h: optimizer-state offload).
  std::string state_dir;
  // Note [FP8 moments]: keep the first moment as FP8 E4M3 codes and the
  // second as fp16, each tensor with a scale of its own (MS-AMP's O2).
  bool fp8_moments = false;
  // One pass per element on CPU tensors (kernels/adamw.h: the same bits as
  // the ATen ops, faster); false: the ATen ops. FP8 moments always take the ATen ops.
  bool fused = true;
};

// Note [FP8 moments]: each step decodes a tensor's moments to fp32, updates
// them and the parameter exactly as the fp32 optimizer does, and stores them
// again: m as E4M3 codes at scale 448 / amax(m), v as fp16 at scale
// 65504 / amax(v) (an amax of 0 keeps the previous scale). That is 3 bytes of
// state per parameter instead of 8. E4M3 keeps 3 significand bits and about
// 2^17 of range below a tensor's largest |m|; fp16's range below the largest
// v reaches 2^-40 with subnormals. Checkpoints hold the moments' fp32 values
// (exp_avg_value), so they reload under any layout and either format.
// With FP8 moments the parameters may be fp16 (MS-AMP's O3: sharded fp16
// master weights): the decay and the update are applied to an fp32 copy and
// the result is rounded to fp16 once, so an update smaller than half an fp16
// step of its weight is lost (the price of 2 bytes per master weight). Their
// gradients may be fp32.

class AdamW {
 public:
  // decay[i] says whether params[i] gets weight decay (matrices yes,
  // biases/norms/1-D no, the usual convention for transformers).
  AdamW(std::vector<at::Tensor> params, std::vector<bool> decay, AdamWOptions options = {});
  // Flat shards mix matrices and vectors: decay_numel[i] says how many leading
  // elements of params[i] get weight decay (sharded strategies lay out each
  // flat buffer decayed tensors first).
  AdamW(std::vector<at::Tensor> params, std::vector<int64_t> decay_numel, AdamWOptions options = {});

  // One update with learning rate `lr`. Tensors without a gradient are skipped.
  void step(double lr);
  // Zeroes gradients in place (keeps .grad storage, which DDP's buckets own).
  void zero_grad();

  int64_t steps() const { return step_; }
  // Restores the bias-correction step count (checkpoint loading; the states
  // are written in place through exp_avg() / exp_avg_sq(), which share storage).
  void set_steps(int64_t steps) { step_ = steps; }
  const std::vector<at::Tensor>& params() const { return params_; }
  // The stored moments: fp32, or with fp8_moments uint8 codes and fp16 (their bytes are the state's size).
  const std::vector<at::Tensor>& exp_avg() const { return m_; }
  const std::vector<at::Tensor>& exp_avg_sq() const { return v_; }
  // Moment values of tensor i in fp32, shaped like params()[i]: the stored
  // tensor itself without fp8_moments (writes reach the state), else a decoded copy.
  at::Tensor exp_avg_value(size_t i) const;
  at::Tensor exp_avg_sq_value(size_t i) const;
  // Sets tensor i's moments from fp32 values (a checkpoint's); nothing to do
  // when they are the stored tensors themselves.
  void set_moments(size_t i, const at::Tensor& m, const at::Tensor& v);
  const AdamWOptions& options() const { return options_; }

 private:
  std::vector<at::Tensor> params_;
  std::vector<int64_t> decay_numel_;
  std::vector<at::Tensor> m_, v_;
  std::vector<double> m_scale_, v_scale_;  // fp8_moments: each tensor's scales
  AdamWOptions options_;
  void store_moments(size_t i, const at::Tensor& m, const at::Tensor& v);
  void step_fp8(size_t i, const kernels::AdamWStep& s);  // Note [FP8 moments]
  int64_t step_ = 0;
};

// Marks 2-D and larger tensors for weight decay.
std::vector<bool> decay_matrices(const std::vector<at::Tensor>& params);

// The sum of the squares of the gradients of `params`, as a [1] fp64 tensor
// on their device (a host zero when none has a gradient).
at::Tensor grad_square_sum(const std::vector<at::Tensor>& params);

// Scales gradients so their global L2 norm is at most max_norm and returns the
// norm before clipping. Each tensor's squared norm is summed locally, then
// all-reduced over `groups` (the groups across which the tensors are sharded;
// none for replicated DDP gradients, which are already identical everywhere).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                      const std::vector<comm::Group*>& groups = {});

enum class Decay { Cosine, Linear, Constant };
enum class Warmup { Linear, Log };

struct ScheduleOptions {
  int64_t warmup_steps = 0;        // ramp from warmup_start_ratio x peak (or ~0) to the peak
  int64_t total_steps = 1;         // the decay ends here
  double min_lr_ratio = 0.1;       // the decay floor, as a fraction of the peak
  Decay decay = Decay::Cosine;     // shape after warmup (Constant: stays at the peak)
  Warmup warmup = Warmup::Linear;  // Log: DeepSpeed's log-shaped ramp, fast at first
  double warmup_start_ratio = 0;   // lr at the ramp's origin, as a fraction of the peak
};

// Warmup then decay to min_lr_ratio * peak. The ramp reaches the peak at step
// warmup_steps - 1: progress p = (step + 1) / W (linear) or
// log(step + 2) / log(W + 1) (log), lr = peak * (s + (1 - s) * p).
double lr_at(int64_t step, double peak_lr, const ScheduleOptions& s);

}  // namespace scaletrain::optim

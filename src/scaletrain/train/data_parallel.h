#pragma once
// The data-parallel strategy of a run behind one small interface, so the
// training loop reads the same for DDP, ZeRO-1/2/3, every FSDP strategy and
// pipelines; parallelize() (train/recipe.h) builds one, engines.cpp and
// pipeline_strategy.cpp implement them.
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/group.h"

namespace scaletrain::train {

// One step's micro-batches, as the trainer prepared them (Note [Training
// step] in loop.cpp).
struct StepWork {
  std::vector<at::Tensor> inputs, targets;  // micro-batch k: inputs[k], targets[k]
  // Micro-batch k's loss is multiplied by loss_scale * weights[k] before its
  // backward (Note [Masked loss]).
  std::vector<double> weights;
  double loss_scale = 1;
  // Micro-batch k's forward through the whole model: its loss, multiplied
  // as above. Strategies that hold the whole model call it; a pipeline runs
  // its stages' pieces on inputs[k] and targets[k] instead.
  std::function<at::Tensor(int64_t k)> forward;
  // Called just before micro-batch k's forward_backward where `forward` is
  // used, and by a pipeline before each forward and backward piece of
  // micro-batch k (the sequence layout, FP8's loss multiplier, the memory
  // mark); so it must be safe to call more than once per micro-batch.
  std::function<void(int64_t k)> prepare;
  // Runs fn under the run's autocast (what `forward` does for itself).
  std::function<at::Tensor(const std::function<at::Tensor()>&)> autocast;
};

// Every strategy runs a step the same way: the trainer hands over all of its
// micro-batches, the strategy runs their forwards and backwards (in turn, or
// interleaved by a pipeline schedule) and reduces the gradients.
class DataParallel {
 public:
  virtual ~DataParallel() = default;
  // Runs the step's micro-batches; returns the sum over k of weights[k] x
  // micro-batch k's loss (without loss_scale).
  virtual double step(const StepWork& work) = 0;
  // What the optimizer updates, and how many leading elements of each decay.
  virtual std::vector<at::Tensor> optimizer_params() = 0;
  virtual std::vector<int64_t> decay_numel() = 0;
  // Global gradient norm (clipped to max_norm when > 0).
  virtual double clip_grad_norm(double max_norm) = 0;
  // The groups over which optimizer_params() are sharded (for agreeing on overflow).
  virtual std::vector<comm::Group*> grad_groups() = 0;
  virtual void after_step() = 0;
  virtual void zero_grad() = 0;
  virtual double comm_wait_ms() const = 0;
  virtual void reset_stats() = 0;
  // Bytes of parameters and gradients this rank holds now.
  virtual int64_t model_state_bytes() const = 0;
  // Runs fn with every parameter whole on every rank (collective): the model
  // runs without the data-parallel engine. A tensor-parallel model stays
  // split over tp: its tp peers must run it together.
  virtual void with_full_parameters(const std::function<void()>& fn) = 0;
  virtual std::string describe() const = 0;
  // What this rank holds, for saving and loading checkpoints (Note
  // [Checkpoint pieces]); optimizer state i belongs to optimizer_params()[i].
  virtual checkpoint::Layout checkpoint_layout() const = 0;
  // After a checkpoint was loaded into checkpoint_layout()'s tensors.
  virtual void after_load() = 0;

  // A pipeline's last step: the fraction of it this stage did not compute
  // (receives, idle), and the schedule's textbook bubble. Empty otherwise.
  struct Bubble {
    double measured = 0, expected = 0;
  };
  virtual std::optional<Bubble> pipeline_bubble() const { return std::nullopt; }
};

// A strategy that holds the whole model runs a step's micro-batches one
// after another: each forward, then its backward.
class MicroBatchStrategy : public DataParallel {
 public:
  double step(const StepWork& work) final;

 protected:
  // Runs one forward (fn calls the model) and its backward, of micro-batch
  // `micro` out of `accum` in this step; returns the loss value.
  virtual double forward_backward(const std::function<at::Tensor()>& fn, int64_t micro, int64_t accum) = 0;
};

}  // namespace scaletrain::train

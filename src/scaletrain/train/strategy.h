#pragma once
// The data-parallel strategy of a run behind one small interface, so the
// training loop reads the same for DDP, ZeRO-1/2/3 and every FSDP strategy,
// and parallelize(), the recipe that builds it from a plan.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/plan.h"
#include "scaletrain/train/starting_model.h"

namespace scaletrain::train {

class DataParallel {
 public:
  virtual ~DataParallel() = default;
  // Runs one forward (fn calls the model) and its backward, of micro-batch
  // `micro` out of `accum` in this step; returns the loss value.
  virtual double forward_backward(const std::function<at::Tensor()>& fn, int64_t micro, int64_t accum) = 0;
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

  // Pipeline strategies run all micro-batches of a step together (the
  // schedule interleaves their forwards and backwards): the trainer then
  // calls step() instead of forward_backward() per micro-batch.
  virtual bool runs_whole_steps() const { return false; }
  // A pipeline's last step: the fraction of it this stage did not compute
  // (receives, idle), and the schedule's textbook bubble. Empty otherwise.
  struct Bubble {
    double measured = 0, expected = 0;
  };
  virtual std::optional<Bubble> pipeline_bubble() const { return std::nullopt; }
  // inputs/targets: the step's micro-batches; loss k is multiplied by
  // loss_scale * weights[k] before backward (Note [Masked loss]). Returns
  // the weighted sum of the losses (unscaled).
  virtual double step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                      const std::vector<double>& weights, double loss_scale, const precision::PrecisionPolicy& policy) {
    throw std::logic_error(describe() + " runs one micro-batch at a time");
  }
};

// Builds the model (deferred when the strategy initializes it shard by
// shard; whole and loaded first with model.init_from) and the strategy the
// plan resolved (its EnginePlan: train/engine_plan.h). Throws UsageError,
// one line, for combinations this build cannot run.
struct Parallelized {
  models::ModelPtr model;
  std::unique_ptr<DataParallel> dp;
};
Parallelized parallelize(const Plan& plan, comm::World& world, comm::Mesh& mesh);

}  // namespace scaletrain::train

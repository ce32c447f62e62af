#pragma once
// Pipeline parallelism over stages the user gives: any torch::nn::Module per
// stage (a torch::nn::Sequential cut by a balance, or modules of your own),
// any activation shapes and floating dtypes between them, on the schedules of
// schedule.h (GPipe, 1F1B, interleaved with several chunks per rank).
// Layer-wise model parallelism is the case of one micro-batch.
//
// The model is p*v chunks in order; rank s of the pp group holds chunks s,
// s+p, ... (schedule.h). Each rank builds only its own chunks and hands
// them over with their forward. A step, on every rank: the first chunk reads
// its micro-batch of the input, each chunk sends its output to the next
// chunk's rank, the last chunk computes loss(output, target) / m and starts
// backward, and each chunk's backward sends the gradient of its input back.
// Gradients accumulate over the micro-batches in the chunks' parameters, as
// gradient accumulation does on one process; the user steps an optimizer over
// parameters() and calls zero_grad().
//
// Note [Activations of any shape]: the shape and dtype of an activation are
// not known in advance (a CNN's 4-d maps become a 2-d batch of features), so
// every activation travels after a small header (rank, dims, dtype) with its
// own tag; the gradient that comes back has the activation's shape, which
// both sides know. Tags name (micro-batch, chunk, direction, header or data),
// so messages between two ranks cannot be confused, and receives block while
// sends do not (Note [Pipeline deadlock check] in schedule.h).
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/pipeline/schedule.h"

namespace scaletrain::parallel::pipeline {

// How data parallelism takes part in a chunk's backward passes: `last` is
// the chunk's last backward of the step, the one whose gradients may be
// reduced (the others accumulate).
class StageRunner {
 public:
  virtual ~StageRunner() = default;
  virtual void backward(const std::function<void()>& fn, bool last) { fn(); }
};

// DDP over one chunk's module (its data-parallel group): the micro-batches
// before the last run under no_sync, the last one reduces the sum.
class DdpStageRunner : public StageRunner {
 public:
  explicit DdpStageRunner(std::shared_ptr<DistributedDataParallel> ddp) : ddp_(std::move(ddp)) {}
  void backward(const std::function<void()>& fn, bool last) override;

 private:
  std::shared_ptr<DistributedDataParallel> ddp_;
};

// fully_shard over one chunk's module (its data-parallel group): the
// micro-batches before the last run under the engine's no_sync (whole
// gradients accumulate locally), the last one reduce-scatters the sum. The
// optimizer holds engine->shards(); the engine's zero_grad() and
// after_step() go around each step, as without a pipeline.
class ShardedStageRunner : public StageRunner {
 public:
  explicit ShardedStageRunner(std::shared_ptr<fsdp::ShardedDataParallel> engine) : engine_(std::move(engine)) {}
  void backward(const std::function<void()>& fn, bool last) override;

 private:
  std::shared_ptr<fsdp::ShardedDataParallel> engine_;
};

// One chunk of the model: its module (for parameters and zero_grad), how to
// run it on one input, and (optionally) how data parallelism wraps its
// backward.
struct StageModule {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::shared_ptr<StageRunner> runner;  // null: plain autograd
};
// A torch::nn::Sequential as a chunk.
StageModule stage(const torch::nn::Sequential& seq);

// Cuts `seq` into consecutive pieces of balance[i] children each (the
// pieces share the children's modules with `seq`). Throws
// std::invalid_argument when the balance does not add up to seq->size() or
// holds an empty piece, naming the numbers.
std::vector<torch::nn::Sequential> split(const torch::nn::Sequential& seq, const std::vector<int64_t>& balance);

struct ModulePipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int microbatches = 1;    // m: the batch is cut into m equal micro-batches along dim 0
  int virtual_stages = 1;  // v: chunks per rank (interleaved only)
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

class ModulePipeline {
 public:
  // `chunks`: this rank's chunks, v of them, in order (chunk s, s+p, ...).
  // Throws for a schedule the shape cannot run (check_schedule) or a chunk
  // count other than v.
  ModulePipeline(std::vector<StageModule> chunks, comm::Group& pp, ModulePipelineOptions options = {});

  // One training step over `input` and `target` (the whole batch, on every
  // rank: the first chunk's rank reads `input`, the last chunk's `target`).
  // Returns the mean of the micro-batches' losses on every rank.
  double step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss);
  // The outputs of the last chunk for `input` without gradients (evaluation),
  // on the last chunk's rank; an undefined tensor elsewhere.
  at::Tensor forward(const at::Tensor& input);

  // This rank's parameters (every chunk), for the optimizer.
  std::vector<at::Tensor> parameters() const;
  // Drops every chunk's gradients.
  void zero_grad();
  int stage() const { return pp_.rank(); }
  int stages() const { return pp_.size(); }

 private:
  struct Run;  // one step's state (module_pipeline.cpp)
  at::Tensor run_forward(Run& run, const Action& a);
  void run_backward(Run& run, const Action& a);
  std::vector<StageModule> chunks_;
  comm::Group& pp_;
  ModulePipelineOptions options_;
  ScheduleShape shape_;
  std::vector<Action> actions_;
};

}  // namespace scaletrain::parallel::pipeline

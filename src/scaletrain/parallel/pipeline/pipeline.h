#pragma once
// Pipeline parallelism: the model cut into p*v chunks over the p ranks of the
// pp group (stage s holds chunks s, s+p, ...), fed with m micro-batches per
// step in the order a schedule (schedule.h) gives.
//
// A step, on every stage: run the stage's actions in order. A forward
// receives its input from the previous chunk's stage (the first chunk reads
// token ids), runs the chunk and sends the output on; the last chunk computes
// the loss. A backward receives the gradient of its output (the last chunk
// starts from its loss), runs autograd through the chunk and sends the
// gradient of its input back. Receives block, sends do not (Note [Pipeline
// deadlock check]); tags name (micro-batch, chunk, direction), so messages
// between two stages can never be confused. Gradients accumulate in the
// parameters over the micro-batches, exactly as gradient accumulation does
// on one process: the loss of each micro-batch is divided by m.
//
// Data parallelism (DDP, ZeRO, FSDP) takes part through a ChunkRunner per
// chunk: it wraps each forward and backward, and learns which backward is
// the chunk's last of the step (the one that may reduce gradients).
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "scaletrain/comm/group.h"
#include "scaletrain/parallel/pipeline/schedule.h"
#include "scaletrain/parallel/pipeline/stage.h"

namespace scaletrain::parallel::pipeline {

enum class Balance { Parameters, Time };
Balance parse_balance(const std::string& s);  // params | time

struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int microbatches = 1;    // m: micro-batches per step
  int virtual_stages = 1;  // v: chunks per stage (interleaved only)
  // How blocks are cut into chunks: equal parameter counts, or equal
  // measured forward+backward time (measured on pp rank 0 and broadcast).
  Balance balance = Balance::Parameters;
  // Shape of one micro-batch [batch, seq]: the activations between chunks are
  // [batch, seq, n_embd] (seq / tp under sequence parallelism).
  int64_t micro_batch = 1;
  int64_t seq_len = 0;  // 0: the model's block_size
  bool sequence_parallel_tp = false;  // activations are sharded over `tp_size` along seq
  int tp_size = 1;
};

// How a data-parallel strategy takes part in one chunk's passes.
class ChunkRunner {
 public:
  virtual ~ChunkRunner() = default;
  virtual at::Tensor forward(const std::function<at::Tensor()>& fn) { return fn(); }
  // `last`: this chunk's last backward of the step.
  virtual void backward(const std::function<void()>& fn, bool last) { fn(); }
  // After every action of the step (and before the tied head's gradient is added).
  virtual void end_step() {}
  // Adds the averaged gradient of the tied head to the embedding's (first chunk).
  virtual void add_to_grad(const std::string& name, const at::Tensor& grad);
  torch::nn::Module* module = nullptr;  // the chunk (set by the pipeline)
};

struct StepStats {
  double step_ms = 0;
  double compute_ms = 0;      // inside forward/backward actions, receives excluded
  double wait_ms = 0;         // blocked in receives
  int64_t peak_activation_bytes = 0;  // heap in use above the step's start, at its highest
  double bubble() const { return step_ms > 0 ? 1.0 - compute_ms / step_ms : 0; }
};

class Pipeline {
 public:
  // Cuts `model` (whole, initialized, and identical on every rank of `pp`:
  // build it from the same seed) into chunks and keeps this stage's; the
  // other blocks' parameter bytes are released. `dp`: the group the tied
  // head's gradient is averaged over (data parallelism), or null. Throws
  // UsageError for shapes the schedule cannot run (check_schedule).
  // `everyone`: the group that must agree on measured cuts (Balance::Time;
  // the world when several pipelines run side by side), or null for pp.
  Pipeline(std::shared_ptr<interfaces::Staged> model, comm::Group& pp, comm::Group* dp, PipelineOptions options,
           comm::Group* everyone = nullptr);

  const std::vector<Chunk>& chunks() const { return chunks_; }
  const std::vector<ChunkSpec>& all_chunks() const { return specs_; }
  // One runner per local chunk, in chunks() order (default: plain autograd).
  void set_runners(std::vector<std::shared_ptr<ChunkRunner>> runners);
  const std::vector<std::shared_ptr<ChunkRunner>>& runners() const { return runners_; }

  // Wraps every chunk forward (autocast, for instance).
  using ForwardWrapper = std::function<at::Tensor(const std::function<at::Tensor()>&)>;
  // One training step over m micro-batches ([batch, seq] each; the first
  // stage reads `inputs`, the last `targets`). The loss of micro-batch k is
  // multiplied by loss_scale * weights[k] before its backward (weights empty:
  // 1 / m each, the mean). `before`, when set, is called with k before each
  // forward and each backward of micro-batch k on this stage, the schedule's
  // order: what the model reads per micro-batch besides its activations (the
  // trainer's sequence layout, Note [Packed documents]) is set there.
  // Returns the weighted sum of the micro-batches' losses (unscaled), on
  // every stage.
  using BeforeMicroBatch = std::function<void(int64_t)>;
  double step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, double loss_scale = 1.0,
              const ForwardWrapper& wrap = nullptr, const std::vector<double>& weights = {},
              const BeforeMicroBatch& before = nullptr);
  const StepStats& last_stats() const { return stats_; }

  // Whether this stage holds the tied head's copy (Note [Tied head across stages]).
  bool holds_head_copy() const { return head_copy_; }
  // Zeroes every gradient of this stage's chunks (in place) and drops the
  // tied head copy's.
  void zero_grad();
  const PipelineOptions& options() const { return options_; }
  int stage() const { return pp_.rank(); }
  int stages() const { return pp_.size(); }
  const ScheduleShape& shape() const { return shape_; }

 private:
  struct StepRun;  // pipeline.cpp
  at::Tensor recv_activation(int mb, int chunk, bool grad, const at::Tensor& like);
  void send(StepRun& run, at::Tensor t, int to, int tag);
  void run_forward(StepRun& run, const Action& a);
  void run_backward(StepRun& run, const Action& a);
  void exchange_head_grad();
  void check_shapes();

  std::shared_ptr<interfaces::Staged> model_;
  at::TensorOptions act_options_;  // dtype of the activations between chunks
  std::string head_name_;          // a tied head (Note [Tied head across stages]), or ""
  at::Tensor head_;
  comm::Group& pp_;
  comm::Group* dp_;
  PipelineOptions options_;
  ScheduleShape shape_;
  std::vector<ChunkSpec> specs_;  // every chunk of the model
  std::vector<Chunk> chunks_;     // this stage's, by local index
  std::vector<std::shared_ptr<ChunkRunner>> runners_;
  std::vector<Action> actions_;
  bool head_copy_ = false;   // last chunk here, first chunk elsewhere
  bool head_moves_ = false;  // a tied head that trains: weights out, gradient back
  bool shapes_checked_ = false;
  StepStats stats_;
};

// The global gradient norm of a model spread over stages (clipped to
// max_norm when > 0; returns the norm before). Every rank adds the squares of
// its `counted` gradients (parts of the model no other rank of `groups`
// holds: stage parameters, tensor-parallel splits, ZeRO shards) and of its
// `shared` gradients divided by `shared_copies` (held identically by that
// many ranks of `groups`, e.g. replicated over tp), then sums over `groups`.
double clip_grad_norm(const std::vector<at::Tensor>& counted, const std::vector<at::Tensor>& shared,
                      int shared_copies, const std::vector<comm::Group*>& groups, double max_norm);

}  // namespace scaletrain::parallel::pipeline

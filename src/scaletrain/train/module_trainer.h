#pragma once
// A training loop for any torch::nn::Module (what Accelerate's `prepare` or
// Lightning's `Trainer` give): the module, an optimizer factory, a loss
// function and a dataset in; DDP, ZeRO-1/2/3 or an FSDP strategy chosen by
// typed options (or by the CLI's YAML keys, module_trainer_options); the
// global batch drawn through data::DistributedSampler, split into this rank's
// micro-batches, clipped, scheduled; sharded checkpoints that resume under
// any strategy and world size; metrics lines, progress and traces.
// docs/own-model.md, "A training loop for your module".
//
// Note [Module trainer step]: one optimizer step of ModuleTrainer::fit.
//   1. The sampler gives the G indices of the step (G = global_batch, the
//      order a function of (seed, G) only); data-parallel rank r of D takes
//      its G/D and cuts them into accum = G / (micro_batch x D) micro-batches.
//   2. Each micro-batch's loss (the loss function's mean over it) is divided
//      by accum and backpropagated; all but the last under the engine's
//      no_sync, so gradients are reduced once per step and equal those of the
//      whole global batch's mean loss on one process.
//   3. The rest is the step every run takes (Note [Training step] in
//      train/loop.cpp): with loss scaling the gradients are unscaled and an
//      inf or NaN on any rank skips the update on every rank; the reported
//      loss is the mean over the global batch (one all-reduce), and one that
//      is not finite stops the run; the global gradient norm (clipped when
//      clip_grad_norm > 0), the step's learning rate written into every
//      param group, the optimizer step; sharded strategies then
//      after_step(); the gradients are zeroed.
// Every piece is public and composes by hand: DistributedDataParallel and
// fully_shard, DistributedSampler, optim::lr_at, checkpoint::Checkpointer
// with replicated_layout / sharded_layout and torch_optimizer_state
// (torch_optimizer_state.h).
#include <ATen/ATen.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/lora_linear.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/fsdp/module_units.h"
#include "scaletrain/parallel/pipeline/module_pipeline.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/train/loop.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/recipe.h"
#include "scaletrain/train/torch_optimizer_state.h"

namespace scaletrain::comm {
class Mesh;
}  // namespace scaletrain::comm

namespace scaletrain::train {

class ModuleEngine;  // module_engine.h

// torch::optim::AdamW's settings, for runs whose optimizer the trainer builds
// (the YAML route: the CLI trains with AdamW).
struct AdamWSettings {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled, on every element (flat shards hold matrices and vectors alike)
};

// The recipe's fields (train/recipe.h: strategy, units, the engines'
// options, HybridShard's groups, tp and its plan, activation checkpointing,
// the storage dtypes) and the loop's. With param_dtype set the trainer also
// casts floating inputs to it before each forward, as FSDP's mixed
// precision casts forward inputs.
struct ModuleTrainerOptions : ModuleRecipe {
  int64_t steps = 100;        // optimizer steps of the run (the schedule spans them)
  int64_t stop_at = 0;        // stop after this step, as if preempted; 0 = steps
  int64_t global_batch = 32;  // samples per step over all data-parallel ranks
  int64_t micro_batch = 8;    // samples per forward; accumulation = global_batch / (micro_batch x dp)
  uint64_t seed = 1337;       // the sampler's shuffle (part of the run's identity: keep it on resume)
  bool shuffle = true;        // false: each epoch in index order
  double clip_grad_norm = 0;  // max global gradient norm; 0: none (the norm is still measured)

  // The learning rate of each step, peak_lr x the schedule (optim::lr_at),
  // written into every param group before the step; unset: the optimizer's
  // own lr stays.
  std::optional<optim::ScheduleOptions> lr_schedule;
  double peak_lr = 0;
  // Set: the trainer builds torch::optim::AdamW with these settings (then no
  // optimizer factory may be given).
  std::optional<AdamWSettings> adamw;

  // Checkpoints (checkpoint/sharded.h): "" = none. Saved every
  // `checkpoint_every` steps (0: only at the end) and at the last step.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int64_t checkpoint_keep = 0;  // complete checkpoints kept, newest first (0 = all)
  bool checkpoint_async = false;
  bool full_state_dict = false;  // rank 0 writes whole tensors (FSDP's FULL_STATE_DICT)
  // auto: the newest intact checkpoint in checkpoint_dir, if any | never |
  // a step directory or a root of them. A restarted attempt (`scaletrain
  // launch --max-restarts`) goes on from the newest intact checkpoint in
  // checkpoint_dir whatever this says (train::find_resume).
  std::string resume = "auto";

  // Autocast (precision/policy.h) over each micro-batch's forward and loss:
  // kBFloat16 (or kHalf) runs the autocast-eligible operators (matmuls,
  // convolutions) in that dtype on the module's device, its parameters and
  // gradients staying in their dtype; kFloat: off. kHalf needs loss_scaling
  // and a CUDA module (libtorch 1.13 has no fp16 matmul on the CPU).
  at::ScalarType autocast = at::kFloat;
  // Loss scaling (precision/loss_scaler.h: DeepSpeed's dynamic scaler, or a
  // static scale), Note [Module trainer step] 2-3: each micro-batch's loss
  // is multiplied by the scale before backward; the gradients are unscaled
  // and checked for inf/NaN on every rank; a step that overflowed anywhere
  // is skipped everywhere (parameters and optimizer state untouched, the
  // schedule still advances) and the scale adapts. Checkpoints keep its
  // state. Required by fp16 autocast; allowed with any other.
  std::optional<precision::LossScalerOptions> loss_scaling;
  // FP8 (Note [FP8 linears] in precision/fp8.h): every LoraLinear of the
  // module computes x W^T in emulated FP8 with these scales; the delayed
  // recipe's amaxes are agreed over the data-parallel ranks once a step and
  // its histories saved in checkpoints (under pp, agreed over the job first:
  // a rank keeps no history of the layers it does not run). Not with tp > 1
  // (the plan finds its layers by their torch::linear calls, which an FP8
  // layer does not make).
  std::optional<precision::Fp8LinearOptions> fp8;
  // Pipeline parallelism (the recipe's pp, virtual_stages and pp_balance):
  // the schedule of each step (parallel/pipeline/schedule.h) over its
  // global_batch / (micro_batch x dp) micro-batches. Under pp the loss
  // function is called with the last chunk (a torch::nn::Sequential of the
  // module's last children) and that chunk's input, so a loss written for
  // the Sequential (dynamic_cast<torch::nn::SequentialImpl&>(m).forward(x))
  // serves both.
  parallel::pipeline::Schedule pp_schedule = parallel::pipeline::Schedule::OneFOneB;

  // LoRA (models/lora_linear.h): before the engine wraps the module, an
  // adapter on each of its LoraLinear layers that lora->target_modules
  // names, every other parameter frozen; with adapter_from (a PEFT adapter
  // directory) the adapters start from its tensors. save_adapter() writes them.
  std::optional<models::LoraOptions> lora;
  std::string adapter_from;

  // Rank 0 writes one JSON line per step ("" = none), as the CLI's runs
  // do (observe::MetricsSink; samples_per_s where ours have tokens_per_s);
  // a resumed run or a restarted attempt adds to the file.
  std::string metrics_path;
  int64_t log_every = 1;             // steps between progress lines
  bool progress = true;              // progress lines on rank 0's stdout
  std::vector<int64_t> trace_steps;  // {first, last} (1-based) traced by observe::StepTracer; empty: none
  std::string trace_dir = "trace";
};

// Throws std::invalid_argument naming the field for a value no run can use
// (what needs the world, the accumulation's divisibility, is checked when
// the trainer is built).
void validate(const ModuleTrainerOptions& options);

// The options a config of the CLI's YAML keys (load_config) gives: the
// strategy (parallel.strategy, parallel.fsdp.sharding_strategy), units
// (parallel.fsdp auto_wrap_policy: transformer_layer_cls or min_num_params),
// the engines' keys that apply to any module, train.steps / stop_at /
// global_batch / micro_batch / seed / grad_clip, the schedule (train.lr,
// warmup_*, lr_schedule, min_lr_ratio), AdamW (train.lr, beta1, beta2, eps,
// weight_decay: options.adamw), checkpoint.* and metrics.*. Any other key set
// away from its default (model.*, data.*, finetune.*, precision.*, tp / pp /
// cp / ep > 1, ...) would be ignored, so it is refused: one UsageError names
// every such key.
ModuleTrainerOptions module_trainer_options(const config::Config& config);

// The learning-rate schedule the train section describes (warmup_*,
// lr_schedule, min_lr_ratio over train.steps), for the CLI and the above.
optim::ScheduleOptions schedule_options(const config::TrainOptions& train);

// Samples for the trainer: input and target tensors indexed along dim 0, or
// any source of `size` samples that stacks the ones asked for.
struct ModuleBatch {
  at::Tensor input, target;
};
class ModuleData {
 public:
  ModuleData(at::Tensor inputs, at::Tensor targets);
  ModuleData(int64_t size, std::function<ModuleBatch(const std::vector<int64_t>& indices)> get)
      : size_(size), get_(std::move(get)) {
    if (size_ < 1) throw std::invalid_argument("ModuleData: the source must hold at least one sample");
    if (!get_) throw std::invalid_argument("ModuleData: no function to get samples");
  }
  // A torch::data dataset (get(i) gives an Example, size() its length),
  // e.g. torch::data::datasets::TensorDataset or MNIST.
  template <class Dataset>
  static ModuleData from_dataset(Dataset dataset);

  int64_t size() const { return size_; }
  ModuleBatch get(const std::vector<int64_t>& indices) const { return get_(indices); }

 private:
  int64_t size_;
  std::function<ModuleBatch(const std::vector<int64_t>&)> get_;
};

// Builds the optimizer over what the engine hands out: the module's
// trainable parameters (DDP) or the engine's flat shards (sharded).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
// The mean loss of one micro-batch.
using ModuleLoss = std::function<at::Tensor(torch::nn::Module&, const at::Tensor& input, const at::Tensor& target)>;

// The checkpoint a run resumes from (ModuleTrainerOptions::resume), "" for
// a fresh start: under auto the newest complete checkpoint of `dir` whose
// files pass their checksums. Throws UsageError when none is intact or a
// path holds none.
std::string resume_checkpoint(const std::string& dir, const std::string& resume);

struct ModuleTrainResult {
  int64_t start_step = 0;      // the step this call began from (a resumed run's)
  std::vector<double> losses;  // global mean loss of each step this call ran
};

class ModuleTrainer {
 public:
  // Wraps `module` with the strategy (collective: every rank of `world`
  // builds it), builds the optimizer (the factory, or options.adamw), and
  // resumes from a checkpoint when options.resume finds one.
  ModuleTrainer(std::shared_ptr<torch::nn::Module> module, comm::World& world, OptimizerFactory optimizer,
                ModuleLoss loss, ModuleTrainerOptions options);
  ~ModuleTrainer();
  ModuleTrainer(const ModuleTrainer&) = delete;
  ModuleTrainer& operator=(const ModuleTrainer&) = delete;

  // Runs the steps from completed_steps() to stop_at (or steps) on `data`
  // (the same on every rank): Note [Module trainer step]; saves checkpoints
  // when due. Collective.
  ModuleTrainResult fit(const ModuleData& data);
  // One step (the next one); returns its global mean loss. Collective.
  double step(const ModuleData& data);
  // Saves a checkpoint of the steps done (collective; needs checkpoint_dir).
  void save();
  // Writes the adapters (options.lora) as a PEFT adapter directory `dir`:
  // adapter_config.json and adapter_model.safetensors, tensors named
  // "base_model.model.<path>.lora_A.weight" (collective; rank 0 writes).
  void save_adapter(const std::string& dir);

  int64_t completed_steps() const;
  int64_t stop_step() const { return options_.stop_at > 0 ? options_.stop_at : options_.steps; }
  int data_parallel_size() const { return par_.dp_size; }
  int64_t accumulation() const { return accum_; }
  // The loss scaler (options.loss_scaling), null without one.
  const precision::LossScaler* loss_scaler() const { return scaler_.get(); }
  // The FP8 state of the module's LoraLinear layers (options.fp8), in module order.
  const std::vector<precision::Fp8LinearPtr>& fp8_layers() const { return fp8_; }
  // Optimizer steps taken (completed_steps() less the steps loss scaling skipped).
  int64_t optimizer_steps() const;
  torch::optim::Optimizer& optimizer() { return *opt_; }
  // The engine (one of the two is set; neither under pp: stages() then).
  parallel::DistributedDataParallel* ddp() { return par_.ddp.get(); }
  parallel::fsdp::ShardedDataParallel* sharded() { return par_.sharded.get(); }
  // pp > 1: this rank's chunks and their engines.
  const std::vector<ModuleStage>& stages() const { return par_.stages; }
  // Every parameter, whole, in named_parameters() order (collective).
  std::vector<at::Tensor> full_parameters();

 private:
  void add_adapters();
  void build_engine();
  void build_optimizer(OptimizerFactory factory);
  StepParts step_parts();
  LoopOptions loop_options() const;
  RunCheckpoint run_checkpoint();
  StepHooks step_hooks(const ModuleData& data);
  StepWork step_work(const ModuleData& data, const std::vector<int64_t>& mine, double scale);

  std::shared_ptr<torch::nn::Module> module_;
  comm::World& world_;
  ModuleLoss loss_;
  ModuleTrainerOptions options_;
  ParallelModule par_;  // the recipe's engine over the module, its mesh and groups
  std::unique_ptr<ModuleEngine> engine_;  // par_ behind DataParallel (module_engine.h)
  int64_t accum_ = 1;
  at::Device device_{at::kCPU};  // host: a module without parameters; else its parameters' device
  std::vector<at::Tensor> opt_params_;  // what the optimizer was built over, in optimizer-state order
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::unique_ptr<precision::LossScaler> scaler_;  // options.loss_scaling
  std::vector<precision::Fp8LinearPtr> fp8_;       // options.fp8: the module's LoraLinear layers, in module order
  struct LoopState;  // the training loop and the sampler (module_trainer.cpp)
  std::unique_ptr<LoopState> loop_;
};

// The trainer in one call: builds it and runs fit(data).
ModuleTrainResult fit(std::shared_ptr<torch::nn::Module> module, comm::World& world, OptimizerFactory optimizer,
                      ModuleLoss loss, const ModuleData& data, ModuleTrainerOptions options);

inline ModuleData::ModuleData(at::Tensor inputs, at::Tensor targets) {
  if (!inputs.defined() || !targets.defined() || inputs.dim() == 0 || targets.dim() == 0)
    throw std::invalid_argument("ModuleData: inputs and targets must be tensors with samples along dim 0");
  if (inputs.size(0) != targets.size(0))
    throw std::invalid_argument("ModuleData: " + std::to_string(inputs.size(0)) + " inputs but " +
                                std::to_string(targets.size(0)) + " targets");
  size_ = inputs.size(0);
  get_ = [inputs, targets](const std::vector<int64_t>& indices) {
    const at::Tensor idx = torch::tensor(indices, torch::kLong);
    return ModuleBatch{inputs.index_select(0, idx.to(inputs.device())),
                       targets.index_select(0, idx.to(targets.device()))};
  };
}

template <class Dataset>
ModuleData ModuleData::from_dataset(Dataset dataset) {
  const auto n = dataset.size();
  if (!n.has_value()) throw std::invalid_argument("ModuleData::from_dataset: the dataset has no size");
  auto d = std::make_shared<Dataset>(std::move(dataset));
  return ModuleData(static_cast<int64_t>(*n), [d](const std::vector<int64_t>& indices) {
    std::vector<at::Tensor> xs, ys;
    for (int64_t i : indices) {
      auto example = d->get(static_cast<size_t>(i));
      xs.push_back(example.data);
      ys.push_back(example.target);
    }
    return ModuleBatch{at::stack(xs), at::stack(ys)};
  });
}

}  // namespace scaletrain::train

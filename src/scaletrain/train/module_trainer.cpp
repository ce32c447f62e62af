// The training loop for user modules (module_trainer.h): a checkpoint's view of libtorch's optimizers,
// the engines and the loop (Note [Module trainer step]); the options' checks and their reading from
// the CLI's YAML keys are module_trainer_options.cpp.
#include "scaletrain/train/module_trainer.h"

#include <c10/util/Type.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/observe/tracing.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/checkpoint_layout.h"
#include "scaletrain/train/loop.h"
#include "scaletrain/train/module_engine.h"
#include "scaletrain/train/module_trainer_internal.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace fsdp = parallel::fsdp;

using detail::bad;

std::string resume_checkpoint(const std::string& dir, const std::string& resume) {
  return find_resume(dir, resume, "resume", /*print=*/false);
}

// What the trainer keeps besides the engine: the training loop every run
// takes (Note [Training loop]) and the sampler (rebuilt for a dataset of
// another size).
struct ModuleTrainer::LoopState {
  CollectiveHeartbeat collective_heartbeat;  // Note [Heartbeats] (loop.cpp)
  std::unique_ptr<TrainingLoop> loop;
  std::unique_ptr<data::DistributedSampler> sampler;
};

ModuleTrainer::ModuleTrainer(std::shared_ptr<torch::nn::Module> module, comm::World& world, OptimizerFactory optimizer,
                             ModuleLoss loss, ModuleTrainerOptions options)
    : module_(std::move(module)),
      world_(world),
      loss_(std::move(loss)),
      options_(std::move(options)),
      loop_(std::make_unique<LoopState>()) {
  validate(options_);
  if (!module_) throw std::invalid_argument("ModuleTrainer: no module");
  if (!loss_) throw std::invalid_argument("ModuleTrainer: no loss function");
  if (optimizer && options_.adamw)
    throw std::invalid_argument(
        "ModuleTrainer: an optimizer factory and ModuleTrainerOptions.adamw are both given; "
        "pass one (options from YAML set adamw: reset it to use your factory)");
  if (options_.tp > 1 && options_.tensor_plan.empty())
    bad("tensor_plan", "is empty: tp=" + std::to_string(options_.tp) +
                           " splits the submodules a plan of the module's names chooses");
  if (!optimizer && !options_.adamw)
    throw std::invalid_argument("ModuleTrainer: give an optimizer factory or ModuleTrainerOptions.adamw");
  launch::follow_launcher();
  if (options_.lora) add_adapters();
  if (options_.fp8) {
    fp8_ = models::use_fp8(*module_, *options_.fp8);
    if (fp8_.empty())
      bad("fp8", "is set, but the module has no LoraLinear layer to compute in FP8 (a torch::nn::Linear cannot "
                 "be reached from outside: declare the layers as scaletrain::models::LoraLinear)");
  }
  world_.check_same_everywhere("module trainer's options and module", detail::settings_text(options_, *module_));
  build_engine();
  build_optimizer(std::move(optimizer));
  if (options_.loss_scaling) scaler_ = std::make_unique<precision::LossScaler>(*options_.loss_scaling);
  launch::heartbeat();  // the launcher's watchdog (--heartbeat-timeout) is armed from here
  loop_->loop = std::make_unique<TrainingLoop>(world_, step_parts(), loop_options());
  loop_->loop->start([this] { return run_checkpoint(); });  // Note [Training loop]: resumes
}

ModuleTrainer::~ModuleTrainer() = default;

// Adapters on the targeted LoraLinear layers, from their initialization or
// from a PEFT directory whose tensors must be exactly the module's adapters.
void ModuleTrainer::add_adapters() {
  models::add_lora_adapters(*module_, *options_.lora);
  if (options_.adapter_from.empty()) return;
  const hub::Adapter a = hub::read_adapter(options_.adapter_from, "module");
  auto named = module_->named_parameters();
  size_t adapters = 0;
  torch::NoGradGuard no_grad;
  for (auto& p : named) {
    if (!models::is_adapter_parameter(p.key())) continue;
    ++adapters;
    auto it = a.tensors.find(p.key());
    if (it == a.tensors.end())
      throw UsageError("adapter_from " + options_.adapter_from + " has no tensor for " + p.key());
    if (it->second.sizes() != p.value().sizes())
      throw UsageError("adapter_from " + options_.adapter_from + ": " + p.key() + " has shape " +
                       c10::str(it->second.sizes()) + ", the module's " + c10::str(p.value().sizes()));
    p.value().copy_(it->second);
  }
  if (adapters != a.tensors.size())
    throw UsageError("adapter_from " + options_.adapter_from + " holds " + std::to_string(a.tensors.size()) +
                     " tensors, the module's adapters are " + std::to_string(adapters));
}

void ModuleTrainer::save_adapter(const std::string& dir) {
  if (!options_.lora) throw UsageError("save_adapter: the trainer added no adapters (ModuleTrainerOptions.lora)");
  const std::vector<at::Tensor> whole = full_parameters();  // collective, in named_parameters() order
  std::map<std::string, at::Tensor> tensors;
  std::set<std::string> layers;
  const auto named = module_->named_parameters();
  for (size_t i = 0; i < named.size(); ++i)
    if (models::is_adapter_parameter(named[i].key())) {
      tensors[named[i].key()] = whole[i];
      const std::string layer = named[i].key().substr(0, named[i].key().rfind(".lora_"));
      layers.insert(layer.substr(layer.rfind('.') + 1));
    }
  if (world_.rank() == 0) {
    hub::AdapterSettings s;
    s.r = options_.lora->r;
    s.alpha = options_.lora->alpha;
    s.dropout = options_.lora->dropout;
    s.rslora = options_.lora->rslora;
    s.target_modules.assign(layers.begin(), layers.end());
    std::filesystem::create_directories(dir);
    hub::write_adapter_files(dir, "module", s, tensors);
  }
  world_.group()->barrier().wait();
}

// The engine over the data-parallel group(s), and this rank's place in them.
// The recipe (train/recipe.h) over the module, then the accumulation the
// data-parallel size gives.
void ModuleTrainer::build_engine() {
  if (!module_->parameters().empty()) device_ = module_->parameters().front().device();
  const ModuleTrainerOptions& o = options_;
  if (o.autocast == at::kHalf && device_.type() != at::kCUDA)
    bad("autocast", "kHalf needs the module on a CUDA device: libtorch has no fp16 matmul on the " +
                        c10::DeviceTypeName(device_.type(), true) + " (use kBFloat16)");
  par_ = parallelize(module_, world_, static_cast<const ModuleRecipe&>(o));
  const int dp = par_.dp_size;
  if (o.global_batch % (o.micro_batch * dp) != 0)
    bad("global_batch", "=" + std::to_string(o.global_batch) + " is not divisible by micro_batch=" +
                            std::to_string(o.micro_batch) + " x data-parallel size " + std::to_string(dp));
  accum_ = o.global_batch / (o.micro_batch * dp);
  const ModuleEngineSetup setup{module_, &par_, &world_, &options_, loss_, accum_, device_};
  engine_ = par_.stages.empty() ? module_engine(setup) : module_pipeline_engine(setup);
}

// What the step every run takes (Note [Training step]) needs of this trainer.
StepParts ModuleTrainer::step_parts() {
  StepParts p;
  p.engine = engine_.get();
  p.params = opt_params_;
  p.global_batch = options_.global_batch;
  p.batch_groups = {par_.shard, par_.replicate};
  p.scaler = scaler_.get();
  p.fp8 = fp8_;
  p.fp8_groups = {par_.shard, par_.replicate};
  p.lr = [this](int64_t step) {
    return options_.lr_schedule ? optim::lr_at(step, options_.peak_lr, *options_.lr_schedule)
                                : opt_->param_groups().front().options().get_lr();
  };
  p.optimizer_step = [this](double lr) {
    if (options_.lr_schedule)
      for (auto& g : opt_->param_groups()) g.options().set_lr(lr);
    opt_->step();
  };
  p.grad_clip = options_.clip_grad_norm;
  p.rank = world_.rank();
  return p;
}

// The loop's checkpoints, metrics and traces from the options.
LoopOptions ModuleTrainer::loop_options() const {
  const ModuleTrainerOptions& o = options_;
  LoopOptions l;
  l.who = "module_trainer";
  l.steps = o.steps;
  l.stop_at = o.stop_at;
  l.checkpoint = {o.checkpoint_dir, static_cast<int>(o.checkpoint_keep), o.checkpoint_async, o.full_state_dict, {}};
  l.checkpoint_every = o.checkpoint_every;
  l.resume = o.resume;
  l.metrics_path = o.metrics_path;
  l.log_every = o.log_every;
  l.lines = l.bar = o.progress;
  l.trace_steps = o.trace_steps;
  l.trace_dir = o.trace_dir;
  return l;
}

void ModuleTrainer::build_optimizer(OptimizerFactory factory) {
  opt_params_ = engine_->optimizer_params();
  if (factory) {
    opt_ = factory(opt_params_);
    if (!opt_) throw std::invalid_argument("ModuleTrainer: the optimizer factory returned no optimizer");
  } else {
    const AdamWSettings& a = *options_.adamw;
    opt_ = std::make_unique<torch::optim::AdamW>(
        opt_params_,
        torch::optim::AdamWOptions(a.lr).betas({a.beta1, a.beta2}).eps(a.eps).weight_decay(a.weight_decay));
  }
  // Checkpoints map optimizer state i to opt_params_[i]; the sharded engine
  // needs its shards stepped (Note [Step protocol]).
  std::set<const void*> given, held;
  for (const auto& t : opt_params_) given.insert(t.unsafeGetTensorImpl());
  for (const auto& g : opt_->param_groups())
    for (const auto& t : g.params()) held.insert(t.unsafeGetTensorImpl());
  if (given != held)
    throw std::invalid_argument("ModuleTrainer: the optimizer factory must build the optimizer over exactly the " +
                                std::to_string(given.size()) + " tensors it is given (" +
                                (par_.sharded ? "the engine's shards" : "the module's trainable parameters") +
                                "); the optimizer holds " + std::to_string(held.size()) + " others or more");
}

// What checkpoints hold of the run: the engine's layout and the optimizer's
// state, refused before any step for an optimizer whose state no layout can
// split.
RunCheckpoint ModuleTrainer::run_checkpoint() {
  RunCheckpoint c;
  c.layout = engine_->checkpoint_layout();
  try {
    c.optimizer = torch_optimizer_state(*opt_, opt_params_);
  } catch (const std::invalid_argument& e) {
    bad(options_.checkpoint_dir.empty() ? "resume" : "checkpoint_dir", "is set, but the " + std::string(e.what()));
  }
  return c;
}

void ModuleTrainer::save() {
  if (!loop_->loop->checkpoints()) bad("checkpoint_dir", "is not set: there is nowhere to save");
  loop_->loop->save();
}

int64_t ModuleTrainer::completed_steps() const { return loop_->loop->completed_steps(); }
int64_t ModuleTrainer::optimizer_steps() const { return loop_->loop->optimizer_steps(); }

std::vector<at::Tensor> ModuleTrainer::full_parameters() { return engine_->full_parameters(); }

// Step 1-2 of Note [Module trainer step]: this rank's micro-batches (the k-th
// micro_batch samples of `mine`), each loss divided by their count and
// multiplied by the loss scale.
StepWork ModuleTrainer::step_work(const ModuleData& data, const std::vector<int64_t>& mine, double scale) {
  StepWork work;
  work.loss_scale = scale;
  const int64_t m = options_.micro_batch;
  for (int64_t k = 0; k < accum_; ++k) {
    ModuleBatch b = data.get(std::vector<int64_t>(mine.begin() + k * m, mine.begin() + (k + 1) * m));
    at::Tensor x = b.input.to(device_);
    if (options_.param_dtype != at::ScalarType::Undefined && x.is_floating_point()) x = x.to(options_.param_dtype);
    work.inputs.push_back(x);
    work.targets.push_back(b.target.to(device_));
    work.weights.push_back(1.0 / static_cast<double>(accum_));
  }
  const at::ScalarType autocast = options_.autocast;
  const at::DeviceType device = device_.type();
  const int64_t accum = accum_;
  work.forward = [this, inputs = work.inputs, targets = work.targets, autocast, device, accum, scale](int64_t k) {
    const auto i = static_cast<size_t>(k);
    at::Tensor loss = detail::in_precision(autocast, device, [&] { return loss_(*module_, inputs[i], targets[i]); });
    if (!loss.defined() || loss.numel() != 1)
      throw std::invalid_argument("ModuleTrainer: the loss function must return one value (the micro-batch's mean)");
    return loss.reshape({}) / static_cast<double>(accum) * scale;
  };
  work.autocast = [autocast, device](const std::function<at::Tensor()>& fn) {
    return detail::in_precision(autocast, device, fn);
  };
  return work;
}

// Step 1 of Note [Module trainer step] and the step's metrics, for the loop.
StepHooks ModuleTrainer::step_hooks(const ModuleData& data) {
  auto& sampler = loop_->sampler;
  if (!sampler || sampler->num_samples() != data.size()) {
    data::SamplerOptions so;
    so.seed = options_.seed;
    so.global_batch = options_.global_batch;
    so.shuffle = options_.shuffle;
    sampler = std::make_unique<data::DistributedSampler>(data.size(), so);
  }
  StepHooks h;
  h.build = [this, &data](int64_t step, double scale) {
    engine_->zero_grad();  // what the caller's own passes left
    // This rank's G/D samples of the step, in order; micro-batch k is the k-th m of them.
    const int64_t share = options_.global_batch / par_.dp_size;
    const std::vector<int64_t> global = loop_->sampler->global_batch(step);
    const std::vector<int64_t> mine(global.begin() + par_.dp_rank * share,
                                    global.begin() + (par_.dp_rank + 1) * share);
    return step_work(data, mine, scale);
  };
  h.finish = [](observe::StepMetrics& m) {
    m.tokens_per_s = -1;  // the same lines as our families' runs, in samples instead of tokens
    m.peak_rss_mb = observe::peak_rss_mb();
  };
  return h;
}

double ModuleTrainer::step(const ModuleData& data) { return loop_->loop->step(step_hooks(data)).loss; }

ModuleTrainResult ModuleTrainer::fit(const ModuleData& data) {
  ModuleTrainResult result;
  result.start_step = completed_steps();
  module_->train();
  for (const auto& m : loop_->loop->run(step_hooks(data))) result.losses.push_back(m.loss);
  return result;
}

ModuleTrainResult fit(std::shared_ptr<torch::nn::Module> module, comm::World& world, OptimizerFactory optimizer,
                      ModuleLoss loss, const ModuleData& data, ModuleTrainerOptions options) {
  ModuleTrainer trainer(std::move(module), world, std::move(optimizer), std::move(loss), std::move(options));
  return trainer.fit(data);
}

}  // namespace scaletrain::train

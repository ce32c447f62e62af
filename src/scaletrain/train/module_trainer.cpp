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
  if (resume == "never") return "";
  if (resume == "auto") {
    if (dir.empty()) return "";
    const std::vector<std::string> all = checkpoint::complete_checkpoints(dir);
    std::string newest_bad;
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      std::vector<std::string> problems;
      try {
        problems = checkpoint::verify_files(*it, checkpoint::read_index(*it));
      } catch (const UsageError& e) {
        problems = {e.what()};
      }
      if (problems.empty()) return *it;
      if (newest_bad.empty()) newest_bad = *it + ": " + problems.front();
    }
    if (!all.empty())
      throw UsageError("resume=auto: none of the " + std::to_string(all.size()) + " checkpoints in " + dir +
                       " is intact (the newest: " + newest_bad + "); remove them, or set resume=never");
    return "";
  }
  if (std::filesystem::exists(std::filesystem::path(resume) / "index.json")) return resume;
  if (auto newest = checkpoint::newest_checkpoint(resume)) return *newest;
  throw UsageError("resume=" + resume + " is not a complete checkpoint nor a directory holding one");
}

// What the loop keeps besides the engine: the step's parts (Note [Training
// step]), the sampler (rebuilt for a dataset of another size), the metrics
// file and the tracer.
struct ModuleTrainer::LoopState {
  CollectiveHeartbeat collective_heartbeat;  // Note [Heartbeats] (loop.cpp)
  StepParts parts;
  std::unique_ptr<data::DistributedSampler> sampler;
  std::unique_ptr<observe::MetricsSink> metrics;  // rank 0's
  std::unique_ptr<observe::StepTracer> tracer;
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
  connect_loop();
  start_checkpoints();
  if (world_.rank() == 0) try {
      // A resumed run adds to the lines of the run it goes on from.
      loop_->metrics = std::make_unique<observe::MetricsSink>(options_.metrics_path, options_.steps, options_.progress,
                                                              /*append=*/step_ > 0);
    } catch (const UsageError&) {
      bad("metrics_path", options_.metrics_path + " cannot be written");
    }
  loop_->tracer = std::make_unique<observe::StepTracer>(options_.trace_steps, options_.trace_dir, world_,
                                                        engine_->describe());
  launch::heartbeat();  // the launcher's watchdog (--heartbeat-timeout) is armed from here
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
void ModuleTrainer::connect_loop() {
  StepParts& p = loop_->parts;
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
    ++opt_steps_;
  };
  p.grad_clip = options_.clip_grad_norm;
  p.rank = world_.rank();
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

// Refuses an optimizer checkpoints cannot save before any step, then resumes
// (Note [Module trainer step]: the step positions the sampler and schedule).
void ModuleTrainer::start_checkpoints() {
  const ModuleTrainerOptions& o = options_;
  const std::string from = resume_checkpoint(o.checkpoint_dir, o.resume);
  if (o.checkpoint_dir.empty() && from.empty()) return;
  try {
    opt_state_ = torch_optimizer_state(*opt_, opt_params_);
  } catch (const std::invalid_argument& e) {
    bad(o.checkpoint_dir.empty() ? "resume" : "checkpoint_dir", "is set, but the " + std::string(e.what()));
  }
  if (!o.checkpoint_dir.empty()) checkpoint::check_shared_directory(*world_.group(), o.checkpoint_dir);
  if (!o.checkpoint_dir.empty())
    ckpt_ = std::make_unique<checkpoint::Checkpointer>(
        *world_.group(),
        checkpoint::CheckpointOptions{
            o.checkpoint_dir, static_cast<int>(o.checkpoint_keep), o.checkpoint_async, o.full_state_dict, {}});
  if (from.empty()) return;
  const checkpoint::Index index = checkpoint::load_checkpoint(from, engine_->checkpoint_layout(), opt_state_.get());
  engine_->after_load();
  checkpoint::set_cpu_rng_state(index.state.rng_cpu);
  step_ = last_saved_ = index.state.step;
  opt_steps_ = index.state.optimizer_steps;
  if (!fp8_.empty() && options_.fp8->delayed && !index.state.fp8_scaling.empty()) try {
      precision::fp8_restore_scaling(fp8_, index.state.fp8_scaling);
    } catch (const std::invalid_argument& e) {
      throw UsageError("resume: the FP8 scaling state of " + from + " does not fit this module: " + e.what());
    }
  // A run that starts or stops scaling here keeps its own: a fresh scaler, or none.
  if (scaler_ && !index.state.loss_scaler.empty())
    scaler_->load_state(precision::LossScalerState::from_map(index.state.loss_scaler));
  if (world_.rank() == 0)
    std::printf("module_trainer: resumed from %s (step %lld, saved by %s on %d ranks)\n", from.c_str(),
                static_cast<long long>(step_), index.strategy.c_str(), index.world_size);
}

void ModuleTrainer::save() {
  if (!ckpt_) bad("checkpoint_dir", "is not set: there is nowhere to save");
  if (last_saved_ == step_) return;
  checkpoint::SaveState state;
  state.run.step = step_;
  state.run.optimizer_steps = opt_steps_;
  if (scaler_) state.run.loss_scaler = scaler_->state().to_map();
  if (!fp8_.empty()) state.run.fp8_scaling = precision::fp8_scaling_state(fp8_, {world_.group().get()});
  state.run.rng_cpu = checkpoint::cpu_rng_state();
  ckpt_->save(engine_->checkpoint_layout(), opt_state_.get(), state);
  launch::heartbeat();
  last_saved_ = step_;
  if (world_.rank() == 0 && options_.progress)
    std::printf("module_trainer: checkpoint %s %s\n", options_.checkpoint_async ? "started" : "saved",
                checkpoint::step_dir(options_.checkpoint_dir, step_).c_str());
}

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

double ModuleTrainer::step(const ModuleData& data) {
  auto& sampler = loop_->sampler;
  if (!sampler || sampler->num_samples() != data.size()) {
    data::SamplerOptions so;
    so.seed = options_.seed;
    so.global_batch = options_.global_batch;
    so.shuffle = options_.shuffle;
    sampler = std::make_unique<data::DistributedSampler>(data.size(), so);
  }
  loop_->tracer->begin_step(step_ + 1);
  engine_->zero_grad();  // what the caller's own passes left
  // This rank's G/D samples of the step, in order; micro-batch k is the k-th m of them.
  const int64_t share = options_.global_batch / par_.dp_size;
  std::vector<int64_t> global = sampler->global_batch(step_);
  const std::vector<int64_t> mine(global.begin() + par_.dp_rank * share, global.begin() + (par_.dp_rank + 1) * share);
  const StepOutcome out =
      run_step(loop_->parts, step_, [&](double scale) { return step_work(data, mine, scale); });
  ++step_;
  observe::StepMetrics m = out.metrics;
  if (loop_->metrics) {  // rank 0: the same lines as our families' runs, in samples instead of tokens
    m.tokens_per_s = -1;
    m.peak_rss_mb = observe::peak_rss_mb();
    loop_->metrics->write(m, options_.progress && (step_ % options_.log_every == 0 || step_ == stop_step()));
  }
  loop_->tracer->end_step(step_);
  if (ckpt_ && checkpoint_due(step_, options_.checkpoint_every, stop_step())) save();
  return m.loss;
}

ModuleTrainResult ModuleTrainer::fit(const ModuleData& data) {
  ModuleTrainResult result;
  result.start_step = step_;
  module_->train();
  while (step_ < stop_step()) result.losses.push_back(step(data));
  if (ckpt_) ckpt_->finish();  // commits an asynchronous save (collective)
  loop_->tracer->finish();
  return result;
}

ModuleTrainResult fit(std::shared_ptr<torch::nn::Module> module, comm::World& world, OptimizerFactory optimizer,
                      ModuleLoss loss, const ModuleData& data, ModuleTrainerOptions options) {
  ModuleTrainer trainer(std::move(module), world, std::move(optimizer), std::move(loss), std::move(options));
  return trainer.fit(data);
}

}  // namespace scaletrain::train

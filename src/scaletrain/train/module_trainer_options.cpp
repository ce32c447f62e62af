// ModuleTrainerOptions (module_trainer.h): their checks, and their reading
// from the CLI's YAML keys (Note [Keys a module trainer reads]); the loop
// that runs them is module_trainer.cpp.
#include "scaletrain/train/module_trainer.h"

#include <c10/util/Type.h>

#include <unistd.h>

#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "scaletrain/config/config_values.h"
#include "scaletrain/optim/file_backed.h"
#include "scaletrain/train/plan/device.h"
#include "scaletrain/train/module_trainer_internal.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace fsdp = parallel::fsdp;

namespace detail {

namespace {

// Each strategy, the config's name for it and the sharded engine's (DDP's is unused).
struct StrategyRow {
  ModuleStrategy strategy;
  config::DataParallelism config;
  fsdp::Sharding sharding;
};
constexpr StrategyRow kStrategies[] = {
    {ModuleStrategy::DDP, config::DataParallelism::kDdp, fsdp::Sharding::FullShard},
    {ModuleStrategy::Zero1, config::DataParallelism::kZero1, fsdp::Sharding::Zero1},
    {ModuleStrategy::Zero2, config::DataParallelism::kZero2, fsdp::Sharding::Zero2},
    {ModuleStrategy::Zero3, config::DataParallelism::kZero3, fsdp::Sharding::Zero3},
    {ModuleStrategy::FullShard, config::DataParallelism::kFullShard, fsdp::Sharding::FullShard},
    {ModuleStrategy::ShardGradOp, config::DataParallelism::kShardGradOp, fsdp::Sharding::ShardGradOp},
    {ModuleStrategy::HybridShard, config::DataParallelism::kHybridShard, fsdp::Sharding::HybridShard}};

}  // namespace

ModuleStrategy strategy_of(config::DataParallelism d) {
  for (const auto& row : kStrategies)
    if (row.config == d) return row.strategy;
  return ModuleStrategy::DDP;  // fsdp NO_SHARD runs DDP
}

void bad(const std::string& field, const std::string& problem) {
  throw std::invalid_argument("ModuleTrainerOptions." + field + " " + problem);
}

namespace {
template <class T>
std::string list(const std::vector<T>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}
std::string tensor_text(const at::Tensor& t) {
  return "[" + list(t.sizes().vec()) + "] " + std::string(c10::toString(t.scalar_type())) +
         (t.requires_grad() ? " trainable" : "");
}
}  // namespace

std::string settings_text(const ModuleTrainerOptions& o, const torch::nn::Module& module) {
  std::ostringstream s;
  s << "strategy=" << to_string(o.strategy) << "\nunits.types=" << list(o.units.types)
    << "\nunits.names=" << list(o.units.names) << "\nunits.min_num_params=" << o.units.min_num_params
    << "\ndp_replicate=" << o.dp_replicate << "\nsteps=" << o.steps << "\nstop_at=" << o.stop_at
    << "\nglobal_batch=" << o.global_batch << "\nmicro_batch=" << o.micro_batch << "\nseed=" << o.seed
    << "\nshuffle=" << o.shuffle << "\nclip_grad_norm=" << o.clip_grad_norm << "\npeak_lr=" << o.peak_lr
    << "\nlr_schedule=" << (o.lr_schedule ? "set" : "none") << "\nadamw=" << (o.adamw ? "set" : "none")
    << "\ncheckpoint_dir=" << o.checkpoint_dir << "\ncheckpoint_every=" << o.checkpoint_every
    << "\ncheckpoint_keep=" << o.checkpoint_keep << "\ncheckpoint_async=" << o.checkpoint_async
    << "\nfull_state_dict=" << o.full_state_dict << "\nresume=" << o.resume
    << "\ntrace_steps=" << list(o.trace_steps);
  if (o.lora)
    s << "\nlora.r=" << o.lora->r << "\nlora.alpha=" << o.lora->alpha << "\nlora.rslora=" << o.lora->rslora
      << "\nlora.dropout=" << o.lora->dropout << "\nlora.targets=" << list(o.lora->target_modules)
      << "\nlora.gaussian_init=" << o.lora->gaussian_init << "\nlora.seed=" << o.lora->seed;
  s << "\nadapter_from=" << o.adapter_from << "\nautocast=" << c10::toString(o.autocast) << "\ntp=" << o.tp
    << "\nparam_dtype=" << c10::toString(o.param_dtype) << "\nbuffer_dtype=" << c10::toString(o.buffer_dtype);
  if (const auto& ac = o.activation_checkpointing)
    s << "\ncheckpointing.types=" << list(ac->blocks.types) << "\ncheckpointing.names=" << list(ac->blocks.names)
      << "\ncheckpointing.min_num_params=" << ac->blocks.min_num_params << "\ncheckpointing.every=" << ac->every
      << "\ncheckpointing.preserve_rng=" << ac->options.preserve_rng;
  if (const auto& ls = o.loss_scaling)
    s << "\nloss_scaling.static=" << ls->static_scale << "\nloss_scaling.initial=" << ls->initial_scale
      << "\nloss_scaling.growth_interval=" << ls->growth_interval << "\nloss_scaling.hysteresis=" << ls->hysteresis
      << "\nloss_scaling.min=" << ls->min_scale << "\nloss_scaling.factors=" << ls->growth_factor << ","
      << ls->backoff_factor;
  s << "\npp=" << o.pp << "\nvirtual_stages=" << o.virtual_stages << "\npp_balance=" << list(o.pp_balance)
    << "\npp_schedule=" << parallel::pipeline::to_string(o.pp_schedule);
  if (const auto& f = o.fp8)
    s << "\nfp8.mix=" << static_cast<int>(f->mix) << "\nfp8.delayed=" << f->delayed << "\nfp8.history=" << f->history
      << "\nfp8.margin=" << f->margin;
  for (const auto& [pattern, style] : o.tensor_plan)
    s << "\ntensor_plan " << pattern << "=" << parallel::tensor::style_name(style);
  s << "\n";
  for (const auto& p : module.named_parameters()) s << "parameter " << p.key() << "=" << tensor_text(p.value()) << "\n";
  for (const auto& b : module.named_buffers()) s << "buffer " << b.key() << "=" << tensor_text(b.value()) << "\n";
  return s.str();
}

}  // namespace detail

using detail::bad;
using detail::strategy_of;

namespace {

bool units_given(const fsdp::ModuleUnits& u) { return !u.types.empty() || !u.names.empty() || u.min_num_params != 0; }

void validate_groups(const ModuleTrainerOptions& o) {
  const bool groups = o.shard_group != nullptr || o.replicate_group != nullptr;
  if (o.strategy != ModuleStrategy::HybridShard) {
    if (groups) bad(o.shard_group ? "shard_group" : "replicate_group", "is read by HybridShard only");
    if (o.dp_replicate != 1) bad("dp_replicate", "is read by HybridShard only, got " + std::to_string(o.dp_replicate));
    return;
  }
  if ((o.shard_group == nullptr) != (o.replicate_group == nullptr))
    bad(o.shard_group ? "replicate_group" : "shard_group", "is missing: HybridShard takes both groups, or neither");
  if (groups && o.dp_replicate != 1) bad("dp_replicate", "must stay 1 when shard_group and replicate_group are given");
  if (!groups && o.dp_replicate < 2)
    bad("replicate_group",
        "is not set: HybridShard needs a replicate group (replicate_group and shard_group, or "
        "dp_replicate >= 2 for a mesh the trainer builds)");
}

void validate_schedule(const ModuleTrainerOptions& o) {
  if (!o.lr_schedule) {
    if (o.peak_lr != 0) bad("peak_lr", "is read with lr_schedule, which is not set");
    return;
  }
  const optim::ScheduleOptions& s = *o.lr_schedule;
  if (!(o.peak_lr > 0)) bad("peak_lr", "must be positive with lr_schedule, got " + c10::str(o.peak_lr));
  if (s.total_steps < 1) bad("lr_schedule.total_steps", "must be at least 1");
  if (s.warmup_steps < 0) bad("lr_schedule.warmup_steps", "must be >= 0");
  if (!(s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1)) bad("lr_schedule.min_lr_ratio", "must be in [0, 1]");
  if (!(s.warmup_start_ratio >= 0 && s.warmup_start_ratio <= 1))
    bad("lr_schedule.warmup_start_ratio", "must be in [0, 1]");
}

void validate_outputs(const ModuleTrainerOptions& o) {
  if (o.checkpoint_every < 0) bad("checkpoint_every", "must be >= 0");
  if (o.checkpoint_keep < 0) bad("checkpoint_keep", "must be >= 0");
  for (auto [field, set] : {std::pair{"checkpoint_every", o.checkpoint_every != 0},
                            {"checkpoint_keep", o.checkpoint_keep != 0},
                            {"checkpoint_async", o.checkpoint_async},
                            {"full_state_dict", o.full_state_dict}})
    if (set && o.checkpoint_dir.empty()) bad(field, "would have no effect: checkpoint_dir is not set");
  if (o.checkpoint_async && o.full_state_dict)
    bad("checkpoint_async", "cannot go with full_state_dict (the full state is gathered in the training thread)");
  if (o.resume.empty()) bad("resume", "must be auto, never or a checkpoint path");
  if (o.log_every < 1) bad("log_every", "must be at least 1, got " + std::to_string(o.log_every));
  const auto& t = o.trace_steps;
  if (!t.empty() && (t.size() != 2 || t[0] < 1 || t[1] < t[0] || t[1] > o.steps))
    bad("trace_steps", "must be {first, last} with 1 <= first <= last <= steps");
  if (!t.empty() && o.trace_dir.empty()) bad("trace_dir", "must be set with trace_steps");
}

// pp > 1 (the recipe's pipeline cut): what a pipeline of a user's module does not take.
void validate_pipeline(const ModuleTrainerOptions& o) {
  if (o.pp < 1) bad("pp", "must be at least 1, got " + std::to_string(o.pp));
  if (o.virtual_stages < 1) bad("virtual_stages", "must be at least 1, got " + std::to_string(o.virtual_stages));
  if (o.pp == 1) {
    if (o.virtual_stages != 1) bad("virtual_stages", "is for pp > 1");
    if (!o.pp_balance.empty()) bad("pp_balance", "is for pp > 1");
    if (o.pp_schedule != parallel::pipeline::Schedule::OneFOneB) bad("pp_schedule", "is for pp > 1");
    return;
  }
  if (o.shard_group || o.replicate_group)
    bad(o.shard_group ? "shard_group" : "replicate_group",
        "cannot be given with pp > 1: the pipeline builds a pp x dp mesh of its own (HybridShard's "
        "dp_replicate x dp_shard inside it)");
}

}  // namespace

bool is_sharded(ModuleStrategy s) { return s != ModuleStrategy::DDP; }

fsdp::Sharding sharding_of(ModuleStrategy s) {
  for (const auto& row : detail::kStrategies)
    if (row.strategy == s) return row.sharding;
  return fsdp::Sharding::FullShard;
}

std::string to_string(ModuleStrategy s) { return s == ModuleStrategy::DDP ? "ddp" : fsdp::to_string(sharding_of(s)); }

void validate(const ModuleTrainerOptions& o) {
  if (o.steps < 1) bad("steps", "must be at least 1, got " + std::to_string(o.steps));
  if (o.stop_at < 0 || o.stop_at > o.steps) bad("stop_at", "must be in [0, steps], got " + std::to_string(o.stop_at));
  if (o.global_batch < 1) bad("global_batch", "must be at least 1, got " + std::to_string(o.global_batch));
  if (o.micro_batch < 1) bad("micro_batch", "must be at least 1, got " + std::to_string(o.micro_batch));
  if (o.global_batch % o.micro_batch != 0)
    bad("global_batch",
        "=" + std::to_string(o.global_batch) + " is not divisible by micro_batch=" + std::to_string(o.micro_batch));
  if (o.tp < 1) bad("tp", "must be at least 1, got " + std::to_string(o.tp));
  if (o.tp == 1 && !o.tensor_plan.empty()) bad("tensor_plan", "is given but tp is 1");
  if (o.tp > 1 && (o.shard_group != nullptr || o.replicate_group != nullptr))
    bad("tp", "builds its own dp x tp mesh: give no shard_group or replicate_group");
  if (o.autocast != at::kFloat && o.autocast != at::kBFloat16 && o.autocast != at::kHalf)
    bad("autocast", c10::toString(o.autocast) + std::string(" is not kFloat (off), kBFloat16 or kHalf"));
  if (o.autocast == at::kHalf && !o.loss_scaling)
    bad("autocast", "kHalf needs loss_scaling: fp16 gradients underflow without it (set loss_scaling, or use kBFloat16)");
  validate_pipeline(o);
  if (o.fp8 && o.tp > 1)
    bad("fp8", "is not run with tp > 1: the tensor-parallel plan finds its layers by their torch::linear calls, "
               "which an FP8 layer does not make");
  if (o.fp8 && (o.fp8->history < 1 || o.fp8->margin < 0))
    bad("fp8", "needs history >= 1 and margin >= 0, got " + std::to_string(o.fp8->history) + " and " +
                   std::to_string(o.fp8->margin));
  if (o.loss_scaling) try {
      precision::LossScaler probe(*o.loss_scaling);
    } catch (const UsageError& e) {
      bad("loss_scaling", std::string("is unusable: ") + e.what());
    }
  for (const auto& [field, t] : {std::pair{"param_dtype", o.param_dtype}, std::pair{"buffer_dtype", o.buffer_dtype}})
    if (t != at::ScalarType::Undefined && t != at::kFloat && t != at::kBFloat16)
      bad(field, c10::toString(t) + std::string(" is not Undefined (the module's own), kFloat or kBFloat16") +
                     (t == at::kHalf ? " (fp16 storage is not run for user modules: fp16 autocast over fp32 parameters is)" : ""));
  if (o.param_dtype == at::kBFloat16 && !is_sharded(o.strategy))
    bad("param_dtype", "kBFloat16 needs fp32 master weights, which the sharded strategies keep (zero1-3, fsdp); "
                       "DDP would step the bf16 parameters themselves");
  if (!is_sharded(o.strategy) && units_given(o.units))
    bad("units", "are for the sharded strategies: DDP gathers nothing");
  validate_groups(o);
  if (!(o.clip_grad_norm >= 0) || !std::isfinite(o.clip_grad_norm))
    bad("clip_grad_norm", "must be >= 0 (0: no clipping), got " + c10::str(o.clip_grad_norm));
  validate_schedule(o);
  if (const auto& a = o.adamw) {
    if (!(a->lr > 0)) bad("adamw.lr", "must be positive");
    if (!(a->beta1 >= 0 && a->beta1 < 1)) bad("adamw.beta1", "must be in [0, 1)");
    if (!(a->beta2 >= 0 && a->beta2 < 1)) bad("adamw.beta2", "must be in [0, 1)");
    if (!(a->eps > 0)) bad("adamw.eps", "must be positive");
    if (!(a->weight_decay >= 0)) bad("adamw.weight_decay", "must be >= 0");
  }
  validate_outputs(o);
}

namespace {

// Note [Keys a module trainer reads]: the keys below are mapped; any other
// key set away from its default is refused with the reason (as the CLI's
// Note [Settings that apply] refuses keys a run would not read).
const std::set<std::string>& mapped_keys() {
  // Section, then its keys.
  static const std::set<std::string> keys = [] {
    const std::vector<std::pair<std::string, std::string>> sections = {
        {"train",
         "steps stop_at global_batch micro_batch seed grad_clip lr warmup_steps min_lr_ratio lr_schedule warmup_type "
         "warmup_start_ratio beta1 beta2 eps weight_decay"},
        {"parallel",
         "strategy dp_replicate bucket_cap_mb first_bucket_mb last_bucket_mb find_unused_parameters tp pp schedule "
         "virtual_stages pp_balance"},
        {"parallel.fsdp",
         "sharding_strategy auto_wrap_policy transformer_layer_cls min_num_params backward_prefetch forward_prefetch "
         "limit_all_gathers sync_module_states state_dict_type offload_params"},
        {"parallel.zero", "offload_optimizer offload_param offload_dir"},
        {"finetune", "method r alpha rslora dropout target_modules init adapter_from"},
        {"precision",
         "mode param_dtype buffer_dtype reduce_dtype loss_scale initial_scale_power loss_scale_window hysteresis "
         "min_loss_scale scale_bf16 fp8 fp8_format fp8_recipe fp8_amax_history fp8_margin"},
        {"model", "activation_checkpointing"},
        {"metrics", "path log_every progress trace_steps trace_dir"},
        {"checkpoint", "dir every keep resume async"}};
    std::set<std::string> out;
    for (const auto& [section, names] : sections) {
      std::stringstream ss(names);
      for (std::string name; ss >> name;) out.insert(section + "." + name);
    }
    return out;
  }();
  return keys;
}

bool starts(const std::string& key, const std::string& prefix) { return key.compare(0, prefix.size(), prefix) == 0; }

// Why a key that is not mapped would have no effect on a user module.
std::string unread_reason(const std::string& key) {
  if (key == "model.library" || key == "model.library_args")
    return "it is read by scaletrain train, which loads the library (train/module_library.h)";
  if (starts(key, "model.")) return "a user module is yours; model.* describes the CLI's transformer families";
  if (starts(key, "data.")) return "the trainer reads the ModuleData you give it";
  if (key == "finetune.double_quant") return "it is QLoRA's, which quantizes the CLI families' linear layers";
  if (key == "finetune.bias") return "only none (biases stay frozen) is supported";
  if (key == "precision.fp8_opt_level")
    return "MS-AMP's levels change the CLI families' AdamW and weight gathers; a user module's optimizer is its own";
  if (key == "parallel.cp" || key == "parallel.ep")
    return "context and expert parallelism need the module's attention and experts to be ours (the CLI families')";
  if (key == "parallel.microbatches")
    return "a pipeline of a user module runs global_batch / (micro_batch x dp) micro-batches a step";
  if (starts(key, "parallel.zero.")) return "the ZeRO engine's knobs are not read for user modules";
  if (key == "parallel.backend" || key == "parallel.timeout_s" || key == "parallel.debug_collectives")
    return "the world is the one you pass (comm::World::init reads its own options)";
  if (key == "train.device") return "the module computes where you put it";
  return "the module trainer does not read it";
}

// A mapped key set where it does not apply; "" when it applies.
std::string inapplicable(const config::Config& c, const std::string& key, config::DataParallelism d) {
  const bool fsdp_keys = uses_fsdp_keys(d);
  if (starts(key, "parallel.fsdp.") && !fsdp_keys) return "parallel.fsdp applies to parallel.strategy=fsdp";
  if (starts(key, "parallel.fsdp.") && key != "parallel.fsdp.sharding_strategy" && d == config::DataParallelism::kNoShard)
    return "sharding_strategy NO_SHARD runs DDP";
  if (key == "parallel.fsdp.transformer_layer_cls" && c.parallel.fsdp.auto_wrap_policy != "transformer")
    return "it is read by auto_wrap_policy transformer";
  if (key == "parallel.fsdp.min_num_params" && c.parallel.fsdp.auto_wrap_policy != "size")
    return "it is read by auto_wrap_policy size";
  if ((key == "parallel.bucket_cap_mb" || key == "parallel.find_unused_parameters" ||
       key == "parallel.first_bucket_mb" || key == "parallel.last_bucket_mb") &&
      !runs_ddp(d))
    return "DDP reads it; strategy " + to_string(d) + " does not";
  const bool zero = d == config::DataParallelism::kZero1 || d == config::DataParallelism::kZero2 || d == config::DataParallelism::kZero3;
  if (starts(key, "parallel.zero.") && !zero) return "parallel.zero applies to parallel.strategy=zero1, zero2, zero3";
  if (key == "parallel.zero.offload_param" && d != config::DataParallelism::kZero3)
    return "stages 1 and 2 keep whole parameters on every rank; parameter offload is stage 3's";
  if (key == "parallel.zero.offload_optimizer" && c.parallel.zero.offload_optimizer == "nvme")
    return "the module trainer's optimizer (torch::optim) keeps its states in memory: offload_optimizer cpu puts "
           "the shards and their gradients in host memory, nvme is the CLI families' AdamW";
  if (key == "parallel.zero.offload_dir" && c.parallel.zero.offload_param != "nvme")
    return "it is read only when offload_param is nvme";
  const precision::PrecisionOptions& p = c.precision;
  if (starts(key, "precision.") && key != "precision.mode" && config_value(c, key) == "fp16")
    return "fp16 storage is not run for user modules (precision.mode fp16 autocasts over fp32 parameters)";
  if ((key == "parallel.schedule" || key == "parallel.virtual_stages") && c.parallel.pp == 1)
    return "it is read with parallel.pp > 1";
  if (key == "parallel.pp_balance")
    return "a user module's chunks are cut by parameter count (ModuleRecipe::pp_balance takes children per chunk)";
  if (key == "precision.fp8" && c.parallel.tp > 1)
    return "the tensor-parallel plan finds its layers by their torch::linear calls, which an FP8 layer does not make";
  if (starts(key, "precision.fp8_") && !p.fp8) return "precision.fp8 is off";
  const bool bf16 = p.mode == "bf16" || p.param_dtype == "bf16";
  if (key == "precision.scale_bf16" && !bf16) return "it scales the loss under bf16, and nothing here is bf16";
  const bool scaling = p.mode == "fp16" || (p.scale_bf16 && bf16);
  if (!scaling && (key == "precision.loss_scale" || key == "precision.initial_scale_power" ||
                   key == "precision.loss_scale_window" || key == "precision.hysteresis" ||
                   key == "precision.min_loss_scale"))
    return "loss scaling is off (precision.mode fp16, or scale_bf16 with bf16, turns it on)";
  if (key == "precision.param_dtype" && runs_ddp(d))
    return "bf16 storage needs fp32 master weights, which the sharded strategies keep (zero1-3, fsdp)";
  if (key == "precision.reduce_dtype" && runs_ddp(d)) return "DDP reduces in the gradients' dtype";
  if (key == "precision.buffer_dtype" && c.precision.param_dtype == "fp32")
    return "buffers follow precision.param_dtype, which is fp32";
  if (starts(key, "finetune.") && key != "finetune.method" && c.finetune.method == "full")
    return "finetune.method is full (set lora)";
  if (key == "finetune.method" && c.finetune.method == "qlora")
    return "QLoRA quantizes the CLI families' linear layers; a user module's LoraLinear takes method lora";
  if (key == "parallel.dp_replicate" && d != config::DataParallelism::kHybridShard)
    return "it is read by fsdp HYBRID_SHARD only";
  if ((key == "checkpoint.every" || key == "checkpoint.keep" || key == "checkpoint.async") && c.checkpoint.dir.empty())
    return "checkpoint.dir is not set";
  return "";
}

void refuse_unread_keys(const config::Config& c, config::DataParallelism d) {
  static const config::Config defaults;
  std::vector<std::string> problems;
  for (const auto& key : config::config_keys()) {
    const std::string value = config_value(c, key);
    if (value == config_value(defaults, key)) continue;
    if (starts(key, "train.sample_") && c.train.sample_tokens == 0) continue;  // no sample: what the trainer does
    const std::string why = mapped_keys().count(key) ? inapplicable(c, key, d) : unread_reason(key);
    if (!why.empty()) problems.push_back(key + "=" + value + " would have no effect: " + why);
  }
  if (!problems.empty()) throw UsageError(config::join_problems(problems));
}

// parallel.*: the strategy, its units and the engines' knobs.
void map_parallel(const config::Config& c, ModuleTrainerOptions& o) {
  const config::ParallelOptions& p = c.parallel;
  o.strategy = strategy_of(data_parallelism(p));
  o.pp = p.pp;
  o.virtual_stages = p.virtual_stages;
  if (p.pp > 1) o.pp_schedule = parallel::pipeline::parse_schedule(p.schedule);
  if (o.strategy == ModuleStrategy::HybridShard) o.dp_replicate = p.dp_replicate;
  o.ddp.bucket_cap_bytes = static_cast<int64_t>(p.bucket_cap_mb * (1 << 20));
  o.ddp.first_bucket_cap_bytes = static_cast<int64_t>(p.first_bucket_mb * (1 << 20));
  o.ddp.last_bucket_cap_bytes = static_cast<int64_t>(p.last_bucket_mb * (1 << 20));
  o.ddp.find_unused_parameters = p.find_unused_parameters;
  if (!is_sharded(o.strategy)) return;
  const config::FsdpOptions& f = p.fsdp;
  if (f.auto_wrap_policy == "transformer") {
    std::stringstream names(f.transformer_layer_cls);
    for (std::string name; std::getline(names, name, ',');) {
      name.erase(0, name.find_first_not_of(" \t"));
      name.erase(name.find_last_not_of(" \t") + 1);
      if (!name.empty()) o.units.types.push_back(name);
    }
  } else if (f.auto_wrap_policy == "size") {
    o.units.min_num_params = f.min_num_params;
  }
  o.sharded.backward_prefetch = fsdp::parse_backward_prefetch(f.backward_prefetch);
  o.sharded.forward_prefetch = f.forward_prefetch;
  o.sharded.limit_all_gathers = f.limit_all_gathers;
  o.sharded.sync_module_states = f.sync_module_states;
  o.full_state_dict = f.state_dict_type == "FULL_STATE_DICT";
}

// Note [Offloaded shards] (parallel/fsdp/flat_param.h) for a user module:
// parallel.zero.offload_optimizer cpu keeps the trainable shards and their
// gradients in host memory, where the optimizer steps them; offload_param
// cpu or nvme (stage 3), and parallel.fsdp.offload_params, the parameter
// shards too (nvme: file-backed under offload_dir, read ahead per unit).
// finetune.*: LoRA on the module's LoraLinear layers (models/lora_linear.h).
void map_lora(const config::Config& c, ModuleTrainerOptions& o) {
  const config::FinetuneOptions& f = c.finetune;
  if (f.method != "lora") return;
  const models::LoraOptions l = finetune_lora(c);
  if (l.target_modules.empty())
    throw UsageError("finetune.target_modules: a user module has no default targets; name its LoraLinear layers "
                     "(q_proj,v_proj) or all-linear");
  o.lora = l;
  o.adapter_from = f.adapter_from;
}

void map_offload(const config::Config& c, ModuleTrainerOptions& o) {
  const config::ZeroOptions& z = c.parallel.zero;
  const bool zero = o.strategy == ModuleStrategy::Zero1 || o.strategy == ModuleStrategy::Zero2 ||
                    o.strategy == ModuleStrategy::Zero3;
  const std::string params = zero ? z.offload_param : (c.parallel.fsdp.offload_params ? "cpu" : "none");
  const bool optimizer = zero && z.offload_optimizer == "cpu";
  if (params == "none" && !optimizer) return;
  const bool files = params == "nvme";
  if (files && ::access(z.offload_dir.c_str(), W_OK) != 0)
    throw UsageError("parallel.zero.offload_dir '" + z.offload_dir + "' is not a writable directory");
  o.sharded.offload_params = params != "none";
  o.sharded.read_ahead = files;
  const std::string dir = z.offload_dir;
  o.sharded.offload_alloc = [files, dir](int64_t numel, at::ScalarType dtype, bool gradient) {
    if (files && !gradient) return optim::file_backed_zeros(dir, numel, dtype);
    return host_empty(numel, dtype, /*pin=*/false);
  };
}

// precision.*: bf16 autocast, and the storage and reduction dtypes.
void map_precision(const precision::PrecisionOptions& p, ModuleTrainerOptions& o) {
  if (p.mode == "bf16") o.autocast = at::kBFloat16;
  if (p.mode == "fp16") o.autocast = at::kHalf;
  if (p.fp8) o.fp8 = precision::fp8_linear_options(p);
  if (p.mode == "fp16" || (p.scale_bf16 && (p.mode == "bf16" || p.param_dtype == "bf16")))
    o.loss_scaling = precision::loss_scaler_options(p);
  auto dtype = [](const std::string& name) {
    return name == "bf16" ? at::kBFloat16 : name == "fp32" ? at::kFloat : at::ScalarType::Undefined;
  };
  if (p.param_dtype == "bf16") o.param_dtype = at::kBFloat16;
  if (!p.buffer_dtype.empty() && o.param_dtype != at::ScalarType::Undefined) o.buffer_dtype = dtype(p.buffer_dtype);
  if (!p.reduce_dtype.empty()) o.sharded.reduce_dtype = dtype(p.reduce_dtype);
}

}  // namespace

optim::ScheduleOptions schedule_options(const config::TrainOptions& t) {
  optim::ScheduleOptions s;
  s.warmup_steps = t.warmup_steps;
  s.total_steps = t.steps;
  s.min_lr_ratio = t.min_lr_ratio;
  s.decay = t.lr_schedule == "linear"     ? optim::Decay::Linear
            : t.lr_schedule == "constant" ? optim::Decay::Constant
                                          : optim::Decay::Cosine;
  s.warmup = t.warmup_type == "log" ? optim::Warmup::Log : optim::Warmup::Linear;
  s.warmup_start_ratio = t.warmup_start_ratio;
  return s;
}

ModuleTrainerOptions module_trainer_options(const config::Config& c) {
  validate_config(c);
  refuse_unread_keys(c, data_parallelism(c.parallel));
  ModuleTrainerOptions o;
  map_parallel(c, o);
  map_offload(c, o);
  map_lora(c, o);
  map_precision(c.precision, o);
  if (c.model.activation_checkpointing == "full") o.activation_checkpointing = CheckpointPolicy{};
  o.tp = c.parallel.tp;  // the plan of the module's names comes with the module (tensor_plan)
  const config::TrainOptions& t = c.train;
  o.steps = t.steps;
  o.stop_at = t.stop_at;
  o.global_batch = t.global_batch;
  o.micro_batch = t.micro_batch;
  o.seed = t.seed;
  o.clip_grad_norm = t.grad_clip;
  o.lr_schedule = schedule_options(t);
  o.peak_lr = t.lr;
  o.adamw = AdamWSettings{t.lr, t.beta1, t.beta2, t.eps, t.weight_decay};
  o.checkpoint_dir = c.checkpoint.dir;
  o.checkpoint_every = c.checkpoint.every;
  o.checkpoint_keep = c.checkpoint.keep;
  o.checkpoint_async = c.checkpoint.async;
  o.resume = c.checkpoint.resume;
  if (o.checkpoint_dir.empty()) o.full_state_dict = false;  // the CLI's state_dict_type is a layout, not a save
  o.metrics_path = c.metrics.path;
  o.log_every = c.metrics.log_every;
  o.progress = c.metrics.progress;
  o.trace_steps = c.metrics.trace_steps;
  o.trace_dir = c.metrics.trace_dir;
  validate(o);
  return o;
}

}  // namespace scaletrain::train

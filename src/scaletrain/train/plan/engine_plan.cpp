// The config's engine sections resolved into the engines' own options
// (train/plan/engine_plan.h), once per run, inside make_plan.
#include "scaletrain/train/plan/engine_plan.h"

#include <algorithm>
#include <sstream>

#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/attention.h"
#include "scaletrain/optim/file_backed.h"
#include "scaletrain/parallel/zero/zero.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace fsdp = parallel::fsdp;

models::LoraOptions finetune_lora(const config::Config& c) {
  const config::FinetuneOptions& f = c.finetune;
  models::LoraOptions o;
  o.r = f.r;
  o.alpha = f.alpha;
  o.rslora = f.rslora;
  o.dropout = f.dropout;
  o.gaussian_init = f.init == "gaussian";
  o.seed = c.train.seed;
  std::stringstream names(f.target_modules);
  for (std::string name; std::getline(names, name, ',');) {
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) o.target_modules.push_back(name);
  }
  return o;
}

namespace {

int64_t mib_to_numel(double mib, at::ScalarType dtype) {
  return static_cast<int64_t>(mib * (1 << 20)) / static_cast<int64_t>(c10::elementSize(dtype));
}

// An adapter to start from decides its rank, scaling and layers; the config
// may leave them out, or agree.
void take_adapter_settings(const config::Config& c, const models::ModelConfig& m, models::LoraOptions& o) {
  const config::FinetuneOptions& f = c.finetune;
  const hub::Adapter a = hub::read_adapter(f.adapter_from, m.family);
  const config::Config defaults;
  const std::string from = " (finetune.adapter_from " + f.adapter_from + ")";
  auto agree = [&](const std::string& key, bool same, const std::string& theirs) {
    if (!same && config_value(c, key) != config_value(defaults, key))
      throw UsageError(key + "=" + config_value(c, key) + " differs from the adapter's " + theirs + from +
                       "; leave it out or match it");
  };
  agree("finetune.r", f.r == a.settings.r, "r " + std::to_string(a.settings.r));
  agree("finetune.alpha", f.alpha == a.settings.alpha, "lora_alpha " + c10::str(a.settings.alpha));
  agree("finetune.rslora", f.rslora == a.settings.rslora,
        std::string("use_rslora ") + (a.settings.rslora ? "true" : "false"));
  o.r = a.settings.r;
  o.alpha = a.settings.alpha;
  o.rslora = a.settings.rslora;
  // Layers named in the config stay (the adapter must then cover exactly
  // them: check_adapter_fits, once they are adapted); else the adapter's.
  if (config_value(c, "finetune.target_modules") == config_value(defaults, "finetune.target_modules"))
    o.target_modules = a.settings.target_modules;
}

// finetune.method lora or qlora: the adapters to add (models/lora.h); none for full.
std::optional<models::LoraOptions> lora_options(const config::Config& c, const models::ModelConfig& m) {
  if (c.finetune.method == "full") return std::nullopt;
  models::LoraOptions o = finetune_lora(c);
  if (o.target_modules.empty()) o.target_modules = models::default_lora_targets(m.family);
  if (!c.finetune.adapter_from.empty()) take_adapter_settings(c, m, o);
  return o;
}

StartingPlan starting_plan(const config::Config& c, const Plan& plan) {
  StartingPlan s;
  s.seed = c.train.seed;
  s.init_from = c.model.init_from;
  s.adapter_from = c.finetune.adapter_from;
  s.lora = lora_options(c, plan.model);
  if (c.finetune.method == "qlora") {
    s.nf4.emplace();
    s.nf4->double_quant = c.finetune.double_quant;
  }
  return s;
}

// The FP8 format gradients travel in under parallel.comm_dtype=fp8 or a
// precision.fp8_opt_level (Note [FP8 on the wire]); none otherwise.
std::optional<precision::Fp8Format> fp8_wire_format(const config::Config& c) {
  const auto& p = c.precision;
  if (p.fp8_opt_level.empty() && c.parallel.comm_dtype != "fp8") return std::nullopt;
  return precision::fp8_format(p.fp8_format == "e4m3" ? precision::Fp8Mix::E4M3 : precision::Fp8Mix::Hybrid,
                               /*gradient=*/true);
}

// DDP's options: bucket caps, unused parameters, and the dtype gradients
// travel in (bf16 when parallel.comm_dtype or precision.reduce_dtype says
// so; DDP sums in fp32 either way), or FP8.
parallel::DDPOptions ddp_options(const config::Config& c, const Plan& plan) {
  const auto& p = c.parallel;
  parallel::DDPOptions o;
  o.gradient_as_bucket_view = true;  // our optimizers zero in place; no copies
  o.fp8_comm = fp8_wire_format(c);
  o.bucket_cap_bytes = static_cast<int64_t>(p.bucket_cap_mb * (1 << 20));
  o.first_bucket_cap_bytes = static_cast<int64_t>(p.first_bucket_mb * (1 << 20));
  o.last_bucket_cap_bytes = static_cast<int64_t>(p.last_bucket_mb * (1 << 20));
  o.find_unused_parameters = p.find_unused_parameters;
  const bool bf16 = p.comm_dtype == "bf16" || plan.policy.reduce == at::kBFloat16;
  o.comm_dtype = bf16 ? at::kBFloat16 : at::kFloat;
  return o;
}

// Note [Offloaded shards] (parallel/fsdp/flat_param.h): where the sharded
// engine keeps shards off the device. Shards of parameter offload to nvme are
// file-backed mappings under offload_dir (read ahead per unit); every other
// offloaded shard, and every gradient, is host memory, page-locked on a GPU.
void set_offload(const config::Config& c, const Plan& plan, fsdp::ShardedOptions& o) {
  const bool params = plan.offload_params != Offload::kNone;
  if (!params && plan.offload_optimizer == Offload::kNone) return;
  const bool files = plan.offload_params == Offload::kNvme;
  const bool pin = plan.cuda;  // copies to and from the GPU can then be asynchronous
  o.offload_params = params;
  o.read_ahead = files;
  const std::string dir = c.parallel.zero.offload_dir;
  o.offload_alloc = [files, pin, dir](int64_t numel, at::ScalarType dtype, bool gradient) {
    if (files && !gradient) return optim::file_backed_zeros(dir, numel, dtype);
    return host_empty(numel, dtype, pin);
  };
}

// DeepSpeed's stages: the zero section's buckets and bounds.
fsdp::ShardedOptions zero_options(const config::Config& c, const Plan& plan) {
  const auto& p = c.parallel;
  const at::ScalarType param_dtype = plan.policy.param;
  parallel::zero::ZeroOptions z;
  z.stage = zero_stage(plan.data_parallel);
  z.reduce_bucket_numel = mib_to_numel(p.zero.reduce_bucket_mb, param_dtype);
  // Stage 1/2 units taper at both ends as DDP's buckets do, with DDP's caps.
  z.first_bucket_numel = std::max<int64_t>(1, mib_to_numel(p.first_bucket_mb, param_dtype));
  z.last_bucket_numel = mib_to_numel(p.last_bucket_mb, param_dtype);
  z.allgather_bucket_numel = std::max<int64_t>(1, mib_to_numel(p.zero.allgather_bucket_mb, param_dtype));
  z.prefetch_bytes = static_cast<int64_t>(p.zero.prefetch_bucket_mb * (1 << 20));
  z.max_live_numel = p.zero.max_live_parameters;
  return parallel::zero::sharded_options(z);
}

// FSDP's sharding strategies: the fsdp section's wrap policy and prefetching.
fsdp::ShardedOptions fsdp_options(const config::Config& c, const Plan& plan) {
  const auto& f = c.parallel.fsdp;
  fsdp::ShardedOptions o;
  o.sharding = plan.data_parallel == config::DataParallelism::kFullShard     ? fsdp::Sharding::FullShard
               : plan.data_parallel == config::DataParallelism::kShardGradOp ? fsdp::Sharding::ShardGradOp
                                                                     : fsdp::Sharding::HybridShard;
  o.wrap.policy = fsdp::parse_wrap_policy(f.auto_wrap_policy);
  o.wrap.layer_cls = f.transformer_layer_cls;
  o.wrap.min_num_params = f.min_num_params;
  o.backward_prefetch = fsdp::parse_backward_prefetch(f.backward_prefetch);
  o.forward_prefetch = f.forward_prefetch;
  o.limit_all_gathers = f.limit_all_gathers;
  o.sync_module_states = f.sync_module_states;
  return o;
}

ShardedPlan sharded_plan(const config::Config& c, const Plan& plan) {
  ShardedPlan out;
  out.label = to_string(plan.data_parallel);
  const bool fsdp_keys = uses_fsdp_keys(plan.data_parallel);
  fsdp::ShardedOptions& o = out.options;
  o = fsdp_keys ? fsdp_options(c, plan) : zero_options(c, plan);
  out.hybrid = fsdp_keys && o.sharding == fsdp::Sharding::HybridShard;
  out.no_sync = fsdp_keys || zero_stage(plan.data_parallel) == 1;  // zero2/3 reduce every micro-batch
  o.master_dtype = at::kFloat;
  o.reduce_dtype = plan.policy.reduce;
  o.fp8_reduce = fp8_wire_format(c);
  if (plan.fp8_level == Fp8OptLevel::kO3) {
    // MS-AMP's O3: fp16 masters (fp32 gradient shards), and the FP8 linears'
    // weights gathered as E4M3 (Note [FP8 weight gathers] in parallel/fsdp);
    // the recipe names them once the model exists (select_fp8_weights).
    o.master_dtype = at::kHalf;
    o.grad_dtype = at::kFloat;
    o.fp8_gather = precision::Fp8Format::E4M3;
  }
  set_offload(c, plan, o);
  return out;
}

parallel::pipeline::PipelineOptions pipeline_options(const config::Config& c, const Plan& plan) {
  const auto& p = c.parallel;
  parallel::pipeline::PipelineOptions po;
  po.schedule = parallel::pipeline::parse_schedule(p.schedule);
  po.microbatches = static_cast<int>(plan.accum);
  po.virtual_stages = p.virtual_stages;
  po.balance = parallel::pipeline::parse_balance(p.pp_balance);
  po.micro_batch = plan.micro_batch;
  po.sequence_parallel_tp = plan.dims.tp > 1 && p.sequence_parallel;
  po.tp_size = plan.dims.tp;
  // Under cp stages exchange this rank's part of every sequence.
  if (plan.dims.cp > 1) po.seq_len = plan.model.block_size / plan.dims.cp;
  return po;
}

}  // namespace

EnginePlan plan_engines(const config::Config& c, const Plan& plan) {
  EnginePlan e;
  e.start = starting_plan(c, plan);
  e.ddp = ddp_options(c, plan);
  if (!runs_ddp(plan.data_parallel)) e.sharded = sharded_plan(c, plan);
  e.tensor.sequence_parallel = c.parallel.sequence_parallel;
  e.context.mode = parallel::context::parse_mode(c.parallel.cp_mode);
  e.context.flash = models::attention_path(plan.model.attention) == models::AttentionPath::Flash;
  if (plan.dims.pp > 1) e.pipeline = pipeline_options(c, plan);
  e.ep = c.parallel.ep;
  return e;
}

}  // namespace scaletrain::train

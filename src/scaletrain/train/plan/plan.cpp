#include "scaletrain/data/mixture.h"
#include "scaletrain/train/plan/plan.h"

#include <unistd.h>

#include <functional>
#include <map>

#include "scaletrain/config/config_values.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/parallel/pipeline/schedule.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/train/plan/model_config.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

// Problems found so far (Note [One plan]).
class Problems {
 public:
  // Runs `check`; a UsageError it throws becomes a problem. Returns whether it passed.
  bool check(const std::function<void()>& check) {
    try {
      check();
      return true;
    } catch (const UsageError& e) {
      list_.emplace_back(e.what());
      return false;
    }
  }
  void add(std::string problem) { list_.push_back(std::move(problem)); }
  void raise() const {
    if (!list_.empty()) throw UsageError(config::join_problems(list_));
  }

 private:
  std::vector<std::string> list_;
};

config::DataParallelism dp_of(const config::Config& c) { return data_parallelism(c.parallel); }
bool is_zero(const config::Config& c) { return zero_stage(dp_of(c)) > 0; }

// Note [Settings that apply]: a key that the run would not read, set to a
// value other than its default, is refused with the reason. Each rule names
// keys (a trailing '.' matches a whole section) and says when they apply.
struct ApplyRule {
  std::vector<std::string> keys;
  std::function<bool(const config::Config&)> applies;
  std::function<std::string(const config::Config&)> reason;
};

const std::vector<ApplyRule>& apply_rules() {
  static const std::vector<ApplyRule> rules = {
      {{"parallel.fsdp."},
       [](const config::Config& c) { return uses_fsdp_keys(dp_of(c)); },
       [](const config::Config& c) { return "parallel.fsdp applies to parallel.strategy=fsdp, not " + c.parallel.strategy; }},
      {{"parallel.fsdp.auto_wrap_policy", "parallel.fsdp.backward_prefetch", "parallel.fsdp.forward_prefetch",
        "parallel.fsdp.limit_all_gathers", "parallel.fsdp.sync_module_states",
        "parallel.fsdp.cpu_ram_efficient_loading", "parallel.fsdp.transformer_layer_cls",
        "parallel.fsdp.min_num_params"},
       [](const config::Config& c) { return dp_of(c) != config::DataParallelism::kNoShard; },
       [](const config::Config&) { return std::string("sharding_strategy NO_SHARD runs DDP, which has no units to gather"); }},
      {{"parallel.fsdp.transformer_layer_cls"},
       [](const config::Config& c) { return c.parallel.fsdp.auto_wrap_policy == "transformer"; },
       [](const config::Config& c) {
         return "it is read by auto_wrap_policy transformer, not " + c.parallel.fsdp.auto_wrap_policy;
       }},
      {{"parallel.fsdp.min_num_params"},
       [](const config::Config& c) { return c.parallel.fsdp.auto_wrap_policy == "size"; },
       [](const config::Config& c) { return "it is read by auto_wrap_policy size, not " + c.parallel.fsdp.auto_wrap_policy; }},
      {{"finetune."},
       [](const config::Config& c) { return c.finetune.method != "full"; },
       [](const config::Config&) { return std::string("finetune.method=full trains every parameter, without adapters"); }},
      {{"finetune.double_quant"},
       [](const config::Config& c) { return c.finetune.method == "qlora"; },
       [](const config::Config& c) { return "it is read by finetune.method qlora, not " + c.finetune.method; }},
      {{"parallel.zero."},
       [](const config::Config& c) { return is_zero(c); },
       [](const config::Config& c) { return "parallel.zero applies to strategies zero1-zero3, not " + c.parallel.strategy; }},
      {{"parallel.zero.reduce_bucket_mb", "parallel.zero.allgather_bucket_mb"},
       [](const config::Config& c) { return dp_of(c) != config::DataParallelism::kZero3; },
       [](const config::Config&) {
         return std::string("stage 3 gathers and reduces one transformer block at a time (stages 1-2 read it)");
       }},
      {{"parallel.zero.prefetch_bucket_mb", "parallel.zero.max_live_parameters", "parallel.zero.offload_param"},
       [](const config::Config& c) { return dp_of(c) == config::DataParallelism::kZero3; },
       [](const config::Config& c) {
         return "it concerns sharded parameters, which only zero3 has (strategy is " + c.parallel.strategy + ")";
       }},
      {{"parallel.zero.offload_dir"},
       [](const config::Config& c) {
         return c.parallel.zero.offload_optimizer == "nvme" || c.parallel.zero.offload_param == "nvme";
       },
       [](const config::Config&) { return std::string("it is read only when offloading to nvme"); }},
      {{"parallel.bucket_cap_mb", "parallel.find_unused_parameters"},
       [](const config::Config& c) { return runs_ddp(dp_of(c)); },
       [](const config::Config& c) { return "DDP reads it; strategy " + c.parallel.strategy + " does not"; }},
      // ZeRO-1/2 cut their backward buckets with DDP's first and last caps.
      {{"parallel.first_bucket_mb", "parallel.last_bucket_mb"},
       [](const config::Config& c) {
         const config::DataParallelism d = dp_of(c);
         return runs_ddp(d) || d == config::DataParallelism::kZero1 || d == config::DataParallelism::kZero2;
       },
       [](const config::Config& c) { return "DDP and ZeRO-1/2 read it; strategy " + c.parallel.strategy + " does not"; }},
      {{"parallel.schedule", "parallel.microbatches", "parallel.virtual_stages", "parallel.pp_balance"},
       [](const config::Config& c) { return c.parallel.pp > 1; },
       [](const config::Config&) { return std::string("pipelines read it (parallel.pp > 1)"); }},
      {{"parallel.cp_mode"},
       [](const config::Config& c) { return c.parallel.cp > 1; },
       [](const config::Config&) { return std::string("it applies with context parallelism (parallel.cp > 1)"); }},
      {{"parallel.sequence_parallel"},
       [](const config::Config& c) { return c.parallel.tp > 1; },
       [](const config::Config&) { return std::string("it applies with tensor parallelism (parallel.tp > 1)"); }},
      {{"checkpoint.every", "checkpoint.keep", "checkpoint.async"},
       [](const config::Config& c) { return !c.checkpoint.dir.empty(); },
       [](const config::Config&) { return std::string("checkpoint.dir is not set"); }},
      {{"precision.buffer_dtype"},
       [](const config::Config&) { return false; },
       [](const config::Config&) { return std::string("the model has no buffers (every tensor it keeps is a parameter)"); }},
      {{"data.position_reset", "data.document_separator"},
       [](const config::Config& c) { return c.data.pack == "documents"; },
       [](const config::Config&) { return std::string("it is read with data.pack=documents"); }},
      {{"train.sample_prompt", "train.sample_chat"},
       [](const config::Config& c) { return c.train.sample_tokens > 0; },
       [](const config::Config&) { return std::string("train.sample_tokens is 0 (no sample)"); }},
  };
  return rules;
}

bool matches(const std::string& rule_key, const std::string& key) {
  return rule_key.back() == '.' ? key.compare(0, rule_key.size(), rule_key) == 0 : key == rule_key;
}

// Keys set away from their defaults that the run would not read.
void check_settings_apply(const config::Config& c, const precision::PrecisionPolicy* policy, Problems& problems) {
  static const config::Config defaults;
  for (const auto& key : config::config_keys()) {
    const std::string value = config_value(c, key);
    if (value == config_value(defaults, key)) continue;
    for (const auto& rule : apply_rules()) {
      bool named = false;
      for (const auto& k : rule.keys) named = named || matches(k, key);
      if (named && !rule.applies(c)) {
        problems.add(key + "=" + value + " would have no effect: " + rule.reason(c));
        break;
      }
    }
  }
  // Loss-scaling keys need loss scaling (fp16, or bf16 with scale_bf16).
  if (!policy) return;
  const bool dynamic = c.precision.loss_scale == 0;
  for (const char* key : {"precision.loss_scale", "precision.initial_scale_power", "precision.loss_scale_window",
                          "precision.hysteresis", "precision.min_loss_scale"}) {
    const std::string value = config_value(c, key);
    if (value == config_value(defaults, key)) continue;
    if (!policy->loss_scaling)
      problems.add(std::string(key) + "=" + value + " would have no effect: this run does not scale the loss " +
                   "(fp16, or bf16 with precision.scale_bf16)");
    else if (!dynamic && std::string(key) != "precision.loss_scale")
      problems.add(std::string(key) + "=" + value + " would have no effect: precision.loss_scale fixes a static scale");
  }
  if (c.precision.scale_bf16 && c.precision.mode != "bf16" && c.precision.param_dtype != "bf16")
    problems.add("precision.scale_bf16=true would have no effect: nothing computes or is stored in bf16");
}

// FP8 (Note [FP8 linears] in precision/fp8.h): what it can be combined with,
// and which of its keys would act.
void check_fp8(const config::Config& c, Problems& problems) {
  const auto& p = c.precision;
  const precision::PrecisionOptions defaults;
  if (!p.fp8) {
    // The FP8 gradients of parallel.comm_dtype=fp8 take fp8_format's gradient format.
    const bool wire = c.parallel.comm_dtype == "fp8";
    for (auto [key, changed] : {std::pair{"precision.fp8_format", !wire && p.fp8_format != defaults.fp8_format},
                                std::pair{"precision.fp8_recipe", p.fp8_recipe != defaults.fp8_recipe},
                                std::pair{"precision.fp8_amax_history", p.fp8_amax_history != defaults.fp8_amax_history},
                                std::pair{"precision.fp8_margin", p.fp8_margin != defaults.fp8_margin}})
      if (changed) problems.add(std::string(key) + " would have no effect: precision.fp8 is off");
  } else if (p.fp8_recipe == "current" && p.fp8_amax_history != defaults.fp8_amax_history) {
    problems.add("precision.fp8_amax_history would have no effect: precision.fp8_recipe=current keeps no history");
  }
  if (!p.fp8_opt_level.empty() && !p.fp8)
    problems.add("precision.fp8_opt_level=" + p.fp8_opt_level + " needs precision.fp8=true (every level has FP8 linears)");
  // O3 gathers FP8 weights and keeps fp16 masters in the shards (Note [FP8
  // weight gathers] in parallel/fsdp): it needs parameters that are sharded.
  const config::DataParallelism d = dp_of(c);
  if (p.fp8_opt_level == "O3" && !shards_params(d) && d != config::DataParallelism::kShardGradOp)
    problems.add("precision.fp8_opt_level=O3 gathers FP8 weights and shards fp16 master weights: it needs "
                 "parallel.strategy=zero3 or fsdp with a sharding_strategy other than NO_SHARD (it is " +
                 to_string(d) + "; O2 works with every strategy)");
  // O1 and up, and parallel.comm_dtype=fp8: gradients travel as FP8 (Note
  // [FP8 on the wire]), cast from fp32 sums.
  const std::string why = !p.fp8_opt_level.empty() ? "precision.fp8_opt_level=" + p.fp8_opt_level
                                                   : std::string("parallel.comm_dtype=fp8");
  if (!p.fp8_opt_level.empty() && c.parallel.comm_dtype == "bf16")
    problems.add(why + " sends gradients as FP8, not as parallel.comm_dtype=bf16");
  if ((!p.fp8_opt_level.empty() || c.parallel.comm_dtype == "fp8") &&
      ((!p.reduce_dtype.empty() && p.reduce_dtype != "fp32") || (p.reduce_dtype.empty() && p.param_dtype != "fp32")))
    problems.add(why + " casts gradients to FP8 from fp32: precision.reduce_dtype must be fp32 (it is " +
                 (p.reduce_dtype.empty() ? p.param_dtype : p.reduce_dtype) + ")");
  if (!p.fp8) return;
  if (c.finetune.method == "qlora")
    problems.add("precision.fp8=true with finetune.method=qlora: an NF4 base weight is not cast to FP8 "
                 "(use finetune.method=lora)");
}

// Expert parallelism (parallel/expert): what it needs and what it composes with.
void check_expert_parallel(const config::Config& c, const models::ModelConfig& m, int dp, Problems& problems) {
  const auto& p = c.parallel;
  if (p.ep < 1) return problems.add("parallel.ep must be at least 1, got " + std::to_string(p.ep));
  if (p.ep == 1) return;
  const std::string ep = "parallel.ep=" + std::to_string(p.ep);
  if (m.num_local_experts == 0)
    return problems.add(ep + " would have no effect: the model has no MoE layers (model family " + m.family + ")");
  if (m.num_local_experts % p.ep != 0)
    problems.add(ep + " does not divide model.num_local_experts=" + std::to_string(m.num_local_experts) +
                 " (each rank holds the same number of experts)");
  if (dp > 0 && dp % p.ep != 0)
    problems.add(ep + " does not divide the " + std::to_string(dp) + " data-parallel ranks");
  // Note [Experts in the sharded engine] (parallel/fsdp): experts shard over
  // their expert-data group, which a second data-parallel dimension would split.
  if (dp_of(c) == config::DataParallelism::kHybridShard)
    problems.add(ep + " with parallel.fsdp.sharding_strategy=HYBRID_SHARD is not available: experts are sharded "
                 "over all the ranks that hold them (use FULL_SHARD or SHARD_GRAD_OP)");
  if (p.pp > 1) problems.add(ep + " with parallel.pp > 1 is not available yet");
  if (c.finetune.method != "full") problems.add(ep + " with finetune.method=" + c.finetune.method + " is not available yet");
}

// Context parallelism (parallel/context): what it splits and what it composes with.
void check_context_parallel(const config::Config& c, const models::ModelConfig& m, Problems& problems) {
  const auto& p = c.parallel;
  if (p.cp < 1) return problems.add("parallel.cp must be at least 1, got " + std::to_string(p.cp));
  if (p.cp == 1) return;
  const std::string cp = "parallel.cp=" + std::to_string(p.cp);
  if (m.num_local_experts > 0)
    problems.add(cp + " with MoE layers is not available: the load-balancing loss needs every token's routing on "
                 "one rank");
  if (m.dropout > 0) problems.add(cp + " with model.dropout > 0 is not available (split attention drops nothing)");
  if (p.sequence_parallel) problems.add(cp + " with parallel.sequence_parallel=true is not available yet");
  const int tp = std::max(1, p.tp);
  problems.check([&] {
    const std::string why = parallel::context::split_problem(parallel::context::parse_mode(p.cp_mode), p.cp,
                                                             m.n_head / tp, m.kv_heads() / tp, m.block_size);
    if (!why.empty()) throw UsageError(why);
  });
}

// What this build can fine-tune with adapters.
void check_finetune(const config::Config& c, Problems& problems) {
  // NF4 blocks run along the flattened weight: a row-parallel split would
  // cut them, and a rank's part of the double-quantized absmax would need
  // the whole weight's statistics. LoRA itself splits (models/lora.h).
  if (c.finetune.method == "qlora" && c.parallel.tp > 1)
    problems.add("finetune.method=qlora with parallel.tp > 1 is not available (NF4 blocks are not split across "
                 "tensor-parallel ranks); use finetune.method=lora with tp, or qlora with data or pipeline parallelism");
}

// What this build can run of the parallel section (no peers needed).
void check_strategy(const config::Config& c, bool cuda, Problems& problems, std::vector<std::string>& notices) {
  const auto& p = c.parallel;
  const auto& z = p.zero;
  const config::DataParallelism d = dp_of(c);
  const bool zero = is_zero(c);
  const bool fsdp_offload = uses_fsdp_keys(d) && p.fsdp.offload_params;
  // Note [Offloaded shards] (parallel/fsdp/flat_param.h): on a CPU device the
  // host is the device's own memory; the same code runs, its copies are
  // host-to-host, and only the nvme file backing changes where bytes live.
  if (zero && z.offload_param != "none") {
    if (d != config::DataParallelism::kZero3)
      problems.add("parallel.zero.offload_param=" + z.offload_param + " needs parallel.strategy=zero3 (stages 1 and " +
                   "2 keep whole parameters on every rank, got " + p.strategy + ")");
    else if (z.offload_optimizer == "none")
      notices.push_back("parallel.zero.offload_param=" + z.offload_param +
                        " also moves the fp32 shards the optimizer updates off the device, so the optimizer steps "
                        "them in host memory (as with offload_optimizer=cpu)");
  }
  if (zero && !cuda && (z.offload_optimizer == "cpu" || z.offload_param == "cpu"))
    notices.push_back("parallel.zero offload to cpu on a CPU device: host and device are the same memory, so the "
                      "offloaded shards are separate host copies and nothing is saved");
  if (fsdp_offload && !cuda)
    notices.push_back("parallel.fsdp.offload_params on a CPU device: host and device are the same memory, so the "
                      "offloaded shards are separate host copies and nothing is saved");
  if (zero && (!z.overlap_comm || !z.contiguous_gradients || !z.reduce_scatter || !z.allgather_partitions))
    problems.add(
        "parallel.zero: overlap_comm, contiguous_gradients, reduce_scatter and allgather_partitions must stay true "
        "(scaletrain always reduce-scatters flat gradient buffers during backward)");
  const bool nvme = zero && (z.offload_optimizer == "nvme" || z.offload_param == "nvme");
  if (nvme && ::access(z.offload_dir.c_str(), W_OK) != 0)
    problems.add("parallel.zero.offload_dir '" + z.offload_dir + "' is not a writable directory");
  if (z.offload_pin_memory && !cuda)
    problems.add(
        "parallel.zero.offload_pin_memory=true needs a CUDA device (page-locked host memory only speeds "
        "copies between host and GPU); this run computes on CPU");
  else if (z.offload_pin_memory)
    problems.add("parallel.zero.offload_pin_memory=true would have no effect: offloaded state is always "
                 "page-locked on a GPU run");
  if (d == config::DataParallelism::kHybridShard && p.dp_replicate < 2)
    problems.add("HYBRID_SHARD needs parallel.dp_replicate >= 2 (nodes) and dp_shard the ranks per node");
  if (d != config::DataParallelism::kHybridShard && p.dp_replicate != 1 && d != config::DataParallelism::kDdp)
    problems.add("parallel.dp_replicate=" + std::to_string(p.dp_replicate) +
                 " needs strategy ddp or fsdp with HYBRID_SHARD (" + p.strategy +
                 " shards over the whole data-parallel group)");
  if (p.backend == "nccl" && !cuda)
    problems.add("parallel.backend=nccl needs CUDA tensors; this run computes on CPU" +
                 std::string(c.train.device == "cpu" ? " (train.device=cpu)" : ""));
  if (p.comm_dtype == "bf16" && !c.precision.reduce_dtype.empty() && c.precision.reduce_dtype != "bf16")
    problems.add("parallel.comm_dtype=bf16 and precision.reduce_dtype=" + c.precision.reduce_dtype +
                 " disagree on the dtype gradients are reduced in");
  if (c.checkpoint.async && uses_fsdp_keys(d) && p.fsdp.state_dict_type == "FULL_STATE_DICT")
    problems.add(
        "checkpoint.async with parallel.fsdp.state_dict_type=FULL_STATE_DICT is not supported: the full "
        "state is gathered tensor by tensor, a collective that runs in the training thread");
}

// Pipeline keys, and the schedule's shape.
void check_pipeline(const config::Config& c, const models::ModelConfig& m, int dp, Problems& problems) {
  const auto& p = c.parallel;
  if (p.pp < 1) return problems.add("parallel.pp must be at least 1, got " + std::to_string(p.pp));
  if (p.pp == 1) return;
  if (c.train.sample_tokens > 0)
    problems.add("sampling a pipeline-parallel model is not available; set train.sample_tokens=0");
  if (p.tp > 1 && dp_of(c) != config::DataParallelism::kDdp)
    problems.add("parallel.tp=" + std::to_string(p.tp) + " with parallel.pp composes with strategy ddp only (got '" +
                 p.strategy + "')");
  if (p.microbatches < 0) problems.add("parallel.microbatches must be positive");
  if (p.microbatches > 0 && c.train.global_batch % (static_cast<int64_t>(p.microbatches) * dp) != 0)
    problems.add("train.global_batch=" + std::to_string(c.train.global_batch) + " is not divisible by " +
                 "parallel.microbatches=" + std::to_string(p.microbatches) + " x dp=" + std::to_string(dp));
  if (m.n_layer < static_cast<int64_t>(p.pp) * p.virtual_stages)
    problems.add("model.n_layer=" + std::to_string(m.n_layer) + " blocks cannot fill parallel.pp=" +
                 std::to_string(p.pp) + " x virtual_stages=" + std::to_string(p.virtual_stages) + " chunks");
}

// precision.fp8_opt_level and the offload keys as the plan's enums.
void resolve_precision_choices(const config::Config& c, Plan& plan) {
  const std::string& level = c.precision.fp8_opt_level;
  plan.fp8_level = level == "O1"   ? Fp8OptLevel::kO1
                   : level == "O2" ? Fp8OptLevel::kO2
                   : level == "O3" ? Fp8OptLevel::kO3
                                   : Fp8OptLevel::kNone;
  if (!level.empty() && plan.fp8_level == Fp8OptLevel::kNone)
    throw UsageError("precision.fp8_opt_level '" + level + "' is not one of O1, O2, O3");
  const auto offload = [](const std::string& key, const std::string& v) {
    if (v == "none") return Offload::kNone;
    if (v == "cpu") return Offload::kCpu;
    if (v == "nvme") return Offload::kNvme;
    throw UsageError(key + " '" + v + "' is not one of none, cpu, nvme");
  };
  const auto& z = c.parallel.zero;
  const config::DataParallelism d = plan.data_parallel;
  if (zero_stage(d) > 0) {
    plan.offload_params = offload("parallel.zero.offload_param", z.offload_param);
    plan.offload_optimizer = offload("parallel.zero.offload_optimizer", z.offload_optimizer);
  } else if (uses_fsdp_keys(d) && c.parallel.fsdp.offload_params) {
    plan.offload_params = Offload::kCpu;
  }
}

}  // namespace

Plan make_plan(const config::Config& c, int world_size, int local_rank, const DeviceEnvironment& env) {
  Plan plan;
  Problems problems;
  const auto& p = c.parallel;
  if (c.model.library.empty() && !c.model.library_args.empty())
    throw UsageError("model.library_args=" + c.model.library_args + " is read only with model.library");
  if (!c.model.library.empty())  // the families' plan; a library's module goes to the module trainer
    throw UsageError("model.library=" + c.model.library +
                     " names a user module, which scaletrain train (and launch) trains; this command plans the "
                     "CLI's families only");
  // The checks below read these; a name validate_config would refuse stops here.
  if (!problems.check([&] { plan.data_parallel = data_parallelism(p); })) problems.raise();
  const config::DataParallelism d = plan.data_parallel;
  problems.check([&] { resolve_precision_choices(c, plan); });
  problems.check([&] { plan.device = resolve_device(c.train.device, local_rank, env); });
  plan.cuda = plan.device.is_cuda();
  const bool model_ok = problems.check([&] { plan.model = resolve_model_config(c.model); });
  const bool policy_ok =
      problems.check([&] { plan.policy = precision::PrecisionPolicy::from_options(c.precision, plan.cuda); });
  // parallel.comm_dtype is the dtype gradients travel in under every
  // strategy: DDP's buckets and the sharded engine's reduce-scatters.
  if (policy_ok && p.comm_dtype == "bf16") plan.policy.reduce = at::kBFloat16;
  check_strategy(c, plan.cuda, problems, plan.notices);
  check_finetune(c, problems);
  check_fp8(c, problems);
  check_settings_apply(c, policy_ok ? &plan.policy : nullptr, problems);
  if (policy_ok && plan.policy.param != at::kFloat && runs_ddp(d))
    problems.add("precision.param_dtype=" + precision::dtype_name(plan.policy.param) +
                 " needs fp32 master weights, which the sharded strategies keep (zero1-3, fsdp); " +
                 (d == config::DataParallelism::kDdp ? "ddp" : "fsdp NO_SHARD (which is DDP)") + " has none");
  if (policy_ok && plan.policy.reduce == at::kHalf && !plan.cuda)
    problems.add("precision.reduce_dtype=fp16 needs CUDA (Gloo sums 16-bit payloads only as bf16 here)");
  if (c.data.path.empty() && c.data.mixture.empty())
    problems.add("data.path is not set (a token file from `scaletrain prepare`)");
  if (!c.data.path.empty() && !c.data.mixture.empty())
    problems.add("data.path and data.mixture are both set: give one (a mixture lists every dataset with its weight)");
  if (!c.data.mixture.empty()) problems.check([&] { data::parse_mixture(c.data.mixture); });

  const bool dims_ok = problems.check([&] {
    plan.dims = comm::MeshDims{p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp}.resolved(world_size);
  });
  if (model_ok) check_context_parallel(c, plan.model, problems);
  if (model_ok && p.tp > 1) problems.check([&] { models::check_tensor_parallel(plan.model, p.tp); });
  if (model_ok) check_expert_parallel(c, plan.model, dims_ok ? plan.dims.dp() : 0, problems);
  if (model_ok && dims_ok) {
    check_pipeline(c, plan.model, plan.dims.dp(), problems);
    // A pipeline's parallel.microbatches, when set, decides the micro-batch size.
    plan.micro_batch = p.pp > 1 && p.microbatches > 0
                           ? c.train.global_batch / (static_cast<int64_t>(p.microbatches) * plan.dims.dp())
                           : c.train.micro_batch;
    const bool layout_ok = problems.check([&] {
      data::SamplerOptions so;
      so.global_batch = c.train.global_batch;
      // The layout's arithmetic does not depend on the dataset's size.
      data::DistributedSampler layout(1, so);
      plan.accum = layout.micro_batches_per_step(plan.dims.dp(), static_cast<int>(plan.micro_batch));
    });
    if (layout_ok && p.pp > 1)
      problems.check([&] {
        parallel::pipeline::check_schedule(
            {parallel::pipeline::parse_schedule(p.schedule), p.pp, static_cast<int>(plan.accum), p.virtual_stages});
      });
  }

  // Memory-efficient initialization: zero3 always, fsdp when asked. The cases
  // it does not cover build the whole model first, and say so.
  const bool wants_deferred = d == config::DataParallelism::kZero3 || (uses_fsdp_keys(d) && p.fsdp.cpu_ram_efficient_loading);
  if (wants_deferred) {
    std::string why;
    if (p.pp > 1) why = "pipeline stages are cut from a whole model";
    plan.deferred_init = why.empty();
    if (!why.empty())
      plan.notices.push_back(std::string(d == config::DataParallelism::kZero3 ? "zero3's deferred initialization"
                                                               : "parallel.fsdp.cpu_ram_efficient_loading") +
                             " does not apply to this run (" + why +
                             "): every rank builds the whole model once, then keeps its shard");
  }
  plan.full_state_dict = uses_fsdp_keys(d) && p.fsdp.state_dict_type == "FULL_STATE_DICT";
  problems.raise();
  plan.engines = plan_engines(c, plan);
  return plan;
}

}  // namespace scaletrain::train

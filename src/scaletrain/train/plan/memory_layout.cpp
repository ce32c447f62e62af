// The estimator's layout of a run (train/plan/memory_layout.h).
#include "scaletrain/train/plan/memory_layout.h"

#include <algorithm>
#include <cmath>

#include "scaletrain/models/lora.h"
#include "scaletrain/models/spec_catalog.h"

namespace scaletrain::train {

namespace {
constexpr double kMiB = 1048576.0;

// The data-parallel sharding, its buckets and how far it gathers ahead.
void set_sharding(estimate::Layout& l, const config::Config& c, const Plan& plan, int dp_shard) {
  using estimate::Sharding;
  const auto& p = c.parallel;
  const models::ModelConfig& m = plan.model;
  const config::DataParallelism d = plan.data_parallel;
  l.bucket_bytes = static_cast<int64_t>(p.bucket_cap_mb * kMiB);
  if (zero_stage(d) > 0) {
    l.sharding = d == config::DataParallelism::kZero1   ? Sharding::kZero1
                 : d == config::DataParallelism::kZero2 ? Sharding::kZero2
                                                : Sharding::kZero3;
    l.bucket_bytes = static_cast<int64_t>(p.zero.reduce_bucket_mb * kMiB);
    l.prefetch_units = p.zero.prefetch_bucket_mb > 0 ? 1 : 0;
    if (l.sharding == Sharding::kZero3) {
      // The engine gathers blocks ahead while the bytes ahead are below
      // prefetch_bucket_mb (the last may overshoot), and starts none that
      // would put more than max_live_parameters elements gathered at once,
      // the root's and the block in use included.
      const estimate::ParamCounts n = estimate::count_params(models::estimator_spec(m));
      const int64_t block = (n.per_layer - n.per_layer_tp_split) + n.per_layer_tp_split / p.tp;
      const int64_t root = n.embedding + n.final_norm + n.head;
      const double block_bytes = static_cast<double>(block) * c10::elementSize(plan.policy.param);
      int64_t ahead = static_cast<int64_t>(std::ceil(p.zero.prefetch_bucket_mb * kMiB / block_bytes));
      ahead = std::min<int64_t>(ahead, std::max<int64_t>(0, m.n_layer - 1));
      ahead = std::min<int64_t>(ahead, std::max<int64_t>(0, (p.zero.max_live_parameters - root - block) / block));
      l.prefetch_units = ahead;
    }
  } else if (uses_fsdp_keys(d)) {
    l.fsdp_names = true;
    l.sharding = d == config::DataParallelism::kFullShard     ? Sharding::kZero3
                 : d == config::DataParallelism::kShardGradOp ? Sharding::kZero2
                 : d == config::DataParallelism::kHybridShard ? Sharding::kHybrid
                                                      : Sharding::kNone;
    if (l.sharding == Sharding::kHybrid) l.gpus_per_node = static_cast<int64_t>(dp_shard) * p.tp;
    l.prefetch_units = p.fsdp.backward_prefetch != "NONE" || p.fsdp.forward_prefetch ? 1 : 0;
  }
}

// The adapters' size per layer and whether the MLPs carry any.
void set_lora(estimate::Layout& l, const config::Config& c, const Plan& plan, const models::LoraOptions& lora) {
  const auto& p = c.parallel;
  const models::ModelConfig& m = plan.model;
  l.lora_rank = lora.r;
  l.qlora = c.finetune.method == "qlora";
  // The targets are layer names of any family: count the adapters of a
  // model built without bytes rather than map the names onto the
  // estimator's target sets; a split factor counts 1/tp per rank
  // (Note [LoRA under tensor parallelism]).
  auto shell = models::make_model(m, /*materialize=*/false);
  models::apply_lora(*shell, lora);
  // Whether the MLPs carry adapters is what the activation count needs.
  int64_t n = 0;
  bool mlp = false;
  for (const auto& item : shell->named_parameters()) {
    if (!models::is_adapter_parameter(item.key())) continue;
    n += item.value().numel() / (shell->parameter_split(item.key()).dim >= 0 ? p.tp : 1);
    mlp = mlp || item.key().find(".mlp.") != std::string::npos;
  }
  l.lora_layer_params = m.n_layer > 0 ? n / m.n_layer : 0;
  l.lora_targets = mlp ? estimate::LoraTargets::kAllLinear : estimate::LoraTargets::kAttention;
}

}  // namespace

estimate::Layout run_layout(const config::Config& c, const Plan& plan, int world_size, int dp_shard, int64_t microbatches,
                            bool gloo) {
  const auto& p = c.parallel;
  const models::ModelConfig& m = plan.model;
  const precision::PrecisionPolicy& policy = plan.policy;
  estimate::Layout l;
  l.world_size = world_size;
  l.tp = p.tp;
  l.pp = p.pp;
  if (p.pp > 1) {
    l.schedule = p.schedule == "gpipe"         ? estimate::Schedule::kGPipe
                 : p.schedule == "interleaved" ? estimate::Schedule::kInterleaved
                                               : estimate::Schedule::k1F1B;
    l.virtual_stages = p.virtual_stages;
  }
  l.micro_batch = plan.micro_batch;
  l.microbatches = microbatches;
  l.seq_len = m.block_size;
  l.dropout = m.dropout > 0;
  l.flash_attention = m.attention == "flash";
  l.fused_loss = m.fused;                          // under tp too: the kernel splits the vocabulary
  l.fused_blocks = m.fused && m.family != "gpt2";  // RMSNorm and SwiGLU: the llama family's
  l.fp8_linears = c.precision.fp8;
  l.fp8_moments = fp8_moments(plan.fp8_level);
  l.fp16_masters = plan.fp8_level == Fp8OptLevel::kO3;
  l.ep = c.parallel.ep;
  l.cp = c.parallel.cp;
  l.gloo = gloo;
  l.recompute = c.model.activation_checkpointing == "full" ? estimate::Recompute::kFull : estimate::Recompute::kNone;
  if (policy.param != at::kFloat)
    l.precision = estimate::Precision::kMixed16;  // 16-bit weights, fp32 master shards
  else if (policy.autocast())
    l.precision = estimate::Precision::kAutocast16;
  else
    l.precision = estimate::Precision::kFp32;
  set_sharding(l, c, plan, dp_shard);
  if (const auto& lora = plan.engines.start.lora) set_lora(l, c, plan, *lora);
  return l;
}

}  // namespace scaletrain::train

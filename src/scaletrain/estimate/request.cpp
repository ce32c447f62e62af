// estimate-memory as a library call. See request.h.
#include "scaletrain/estimate/request.h"

#include "scaletrain/estimate/model_spec.h"
#include "scaletrain/estimate/planner.h"
#include "scaletrain/estimate/report.h"
#include "scaletrain/util/error.h"

namespace scaletrain::estimate {

Method parse_method(const std::string& s) {
  if (s == "scaletrain") return Method::kScaletrain;
  if (s == "accelerate") return Method::kAccelerate;
  if (s == "deepspeed") return Method::kDeepSpeed;
  if (s == "all") return Method::kAll;
  throw UsageError("unknown method '" + s + "' (known: scaletrain, accelerate, deepspeed, all)");
}

Precision parse_precision(const std::string& s) {
  if (s == "fp32" || s == "float32") return Precision::kFp32;
  if (s == "mixed16" || s == "bf16" || s == "fp16" || s == "mixed") return Precision::kMixed16;
  if (s == "autocast16" || s == "autocast") return Precision::kAutocast16;
  if (s == "pure16" || s == "pure-bf16") return Precision::kPure16;
  throw UsageError("unknown precision '" + s + "' (known: fp32, mixed16, autocast16, pure16)");
}

Schedule parse_schedule(const std::string& s) {
  if (s == "gpipe") return Schedule::kGPipe;
  if (s == "1f1b") return Schedule::k1F1B;
  if (s == "interleaved" || s == "interleaved-1f1b") return Schedule::kInterleaved;
  throw UsageError("unknown schedule '" + s + "' (known: gpipe, 1f1b, interleaved)");
}

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "selective") return Recompute::kSelective;
  if (s == "full") return Recompute::kFull;
  throw UsageError("unknown recompute '" + s + "' (known: none, selective, full)");
}

LoraTargets parse_lora_targets(const std::string& s) {
  if (s == "qv") return LoraTargets::kQv;
  if (s == "attention") return LoraTargets::kAttention;
  if (s == "all-linear" || s == "all") return LoraTargets::kAllLinear;
  throw UsageError("unknown LoRA targets '" + s + "' (known: qv, attention, all-linear)");
}

Sharding parse_fsdp(const std::string& s) {
  if (s == "full" || s == "full-shard") return Sharding::kZero3;
  if (s == "shard-grad-op") return Sharding::kZero2;
  if (s == "no-shard") return Sharding::kNone;
  if (s == "hybrid" || s == "hybrid-shard") return Sharding::kHybrid;
  throw UsageError("unknown FSDP strategy '" + s + "' (known: full, shard-grad-op, no-shard, hybrid)");
}

Sharding sharding_from_zero_stage(int64_t stage) {
  switch (stage) {
    case 0: return Sharding::kNone;
    case 1: return Sharding::kZero1;
    case 2: return Sharding::kZero2;
    case 3: return Sharding::kZero3;
    default: throw UsageError("--zero-stage must be 0, 1, 2 or 3 (got " + std::to_string(stage) + ")");
  }
}

Layout resolve_layout(const Request& r) {
  if (r.nodes < 1) throw UsageError("--nodes must be >= 1");
  if (r.world_size < 0 || r.gpus_per_node < 0) throw UsageError("--world-size and --gpus-per-node must be >= 1");
  Layout l = r.layout;
  int64_t world = r.world_size, gpn = r.gpus_per_node;
  if (world == 0) world = r.nodes * (gpn > 0 ? gpn : 1);
  if (gpn == 0) {
    if (world % r.nodes != 0)
      throw UsageError("impossible layout: world size " + std::to_string(world) + " is not divisible by nodes=" +
                       std::to_string(r.nodes));
    gpn = world / r.nodes;
  }
  if (world != r.nodes * gpn)
    throw UsageError("impossible layout: world size " + std::to_string(world) + " != nodes " +
                     std::to_string(r.nodes) + " x gpus-per-node " + std::to_string(gpn));
  l.world_size = world;
  l.gpus_per_node = gpn;
  return l;
}

Result run(const Request& r, const ModelSpec& spec) {
  const ParamCounts counts = count_params(spec);
  const Layout layout = resolve_layout(r);
  Result out;
  std::vector<nlohmann::json> docs;
  const bool all = r.method == Method::kAll;

  if (r.fit_bytes > 0) {
    PlanOptions po;
    po.budget_bytes = r.fit_bytes;
    po.base = layout;
    po.try_offload = r.try_offload;
    po.max_rows = r.max_rows;
    const auto rows = plan(spec, po);
    out.text = render_plan(spec, po, rows);
    out.json = plan_json(spec, po, rows);
    return out;
  }
  if (r.method == Method::kScaletrain || all) {
    const RankEstimate est = estimate_rank(spec, layout);
    out.text += render_rank(spec, counts, layout, est);
    docs.push_back(scaletrain_json(spec, counts, layout, est));
  }
  if (r.method == Method::kAccelerate || all) {
    if (spec.shapeless())
      throw UsageError("the accelerate method needs the model's shapes (a preset or config.json), not a raw count");
    const auto rows = accelerate_rows(counts, r.dtypes);
    if (!out.text.empty()) out.text += "\n";
    out.text += render_accelerate(spec.name, rows);
    docs.push_back(accelerate_json(spec.name, counts, rows));
  }
  if (r.method == Method::kDeepSpeed || all) {
    DeepSpeedOptions o;
    o.num_nodes = r.nodes;
    o.gpus_per_node = layout.gpus_per_node;
    o.additional_buffer_factor = r.buffer_factor;
    const auto rows = deepspeed_rows(counts.total, counts.largest_module, o);
    if (!out.text.empty()) out.text += "\n";
    out.text += render_deepspeed(counts.total, counts.largest_module, o, rows);
    docs.push_back(deepspeed_json(spec.name, counts.total, counts.largest_module, o, rows));
  }
  out.json = docs.size() == 1 ? docs[0] : nlohmann::json(docs);
  return out;
}

}  // namespace scaletrain::estimate

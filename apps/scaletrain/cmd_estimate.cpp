// `scaletrain estimate-memory MODEL [options]`: flags mapped onto an
// estimate::Request; the arithmetic, the planner and the rendering live in
// src/scaletrain/estimate (so tests drive the same code).
//
//   scaletrain estimate-memory gpt2 --method accelerate
//   scaletrain estimate-memory llama-2-7b --method deepspeed --nodes 2 --gpus-per-node 8
//   scaletrain estimate-memory llama-3-8b --world-size 8 --zero-stage 3 --seq-len 8192 --recompute selective
//   scaletrain estimate-memory ./config.json --fit 80GB --world-size 64 --nodes 8 --json
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "scaletrain/estimate/planner.h"
#include "scaletrain/estimate/request.h"
#include "scaletrain/models/spec_catalog.h"
#include "scaletrain/util/error.h"

namespace scaletrain::cli {
namespace {

// Raw flag values; strings are parsed by the library so every bad value gets
// the same one-line UsageError the rest of the CLI uses.
struct EstimateFlags {
  std::string model;
  std::string method = "scaletrain";
  std::vector<std::string> dtypes;
  int64_t world_size = 0, nodes = 1, gpus_per_node = 0;
  int64_t zero_stage = -1;
  std::string fsdp;
  bool offload_optimizer = false, offload_params = false;
  std::string precision = "mixed16";
  int64_t tp = 1, pp = 1, ep = 1, cp = 1, microbatches = 1, virtual_stages = 2;
  std::string schedule = "1f1b";
  int64_t seq_len = 0, micro_batch = 1;
  std::string recompute = "none";
  std::string attention = "naive";
  bool sequence_parallel = false;
  int64_t lora_rank = 0;
  std::string lora_targets = "qv";
  bool qlora = false;
  double bucket_mb = 25;
  double buffer_factor = 1.5;
  std::string fit;
  bool try_offload = false;
  size_t max_rows = 20;
  bool json = false;
};

estimate::Request to_request(const EstimateFlags& f) {
  namespace est = scaletrain::estimate;
  est::Request r;
  r.model = f.model;
  r.method = est::parse_method(f.method);
  if (!f.dtypes.empty()) {
    r.dtypes.clear();
    for (const auto& d : f.dtypes) r.dtypes.push_back(est::parse_accel_dtype(d));
  }
  r.world_size = f.world_size;
  r.nodes = f.nodes;
  r.gpus_per_node = f.gpus_per_node;
  r.buffer_factor = f.buffer_factor;
  if (f.zero_stage >= 0 && !f.fsdp.empty()) throw UsageError("give --zero-stage or --fsdp, not both");
  est::Layout& l = r.layout;
  if (f.zero_stage >= 0) l.sharding = est::sharding_from_zero_stage(f.zero_stage);
  if (!f.fsdp.empty()) {
    l.sharding = est::parse_fsdp(f.fsdp);
    l.fsdp_names = true;
  }
  l.offload_optimizer = f.offload_optimizer;
  l.offload_params = f.offload_params;
  l.precision = est::parse_precision(f.precision);
  l.tp = f.tp;
  l.cp = f.cp;
  l.pp = f.pp;
  l.ep = f.ep;
  l.microbatches = f.microbatches;
  l.schedule = est::parse_schedule(f.schedule);
  l.virtual_stages = f.virtual_stages;
  l.seq_len = f.seq_len;
  l.micro_batch = f.micro_batch;
  l.recompute = est::parse_recompute(f.recompute);
  if (f.attention != "naive" && f.attention != "flash")
    throw UsageError("--attention must be naive or flash, got '" + f.attention + "'");
  l.flash_attention = f.attention == "flash";
  l.sequence_parallel = f.sequence_parallel;
  l.lora_rank = f.lora_rank;
  l.lora_targets = est::parse_lora_targets(f.lora_targets);
  l.qlora = f.qlora;
  l.bucket_bytes = static_cast<int64_t>(f.bucket_mb * (1 << 20));
  if (!f.fit.empty()) r.fit_bytes = est::parse_memory_size(f.fit);
  r.try_offload = f.try_offload;
  r.max_rows = f.max_rows;
  r.json = f.json;
  return r;
}

}  // namespace

void add_estimate_memory(CLI::App& app, Runner& run) {
  auto flags = std::make_shared<EstimateFlags>();
  CLI::App* sub = app.add_subcommand(
      "estimate-memory", "Memory per device for training a model under a layout, and layouts that fit");
  sub->add_option("model", flags->model, "Preset (gpt2, llama-2-7b, ...), path to a config.json, or a count (7.5B)")
      ->required();
  sub->add_option("--method", flags->method, "scaletrain (default) | accelerate | deepspeed | all");
  sub->add_option("--dtypes", flags->dtypes, "Accelerate columns: float32 float16 bfloat16 int8 int4");
  sub->add_option("--world-size", flags->world_size, "Ranks in the job (default nodes x gpus-per-node)");
  sub->add_option("--nodes", flags->nodes, "Machines (default 1)");
  sub->add_option("--gpus-per-node", flags->gpus_per_node, "Ranks per machine (default world-size / nodes)");
  sub->add_option("--zero-stage", flags->zero_stage, "ZeRO stage 0-3 over the data-parallel ranks");
  sub->add_option("--fsdp", flags->fsdp, "FSDP strategy: full | shard-grad-op | no-shard | hybrid");
  sub->add_flag("--offload-optimizer", flags->offload_optimizer, "fp32 master + Adam states in host memory");
  sub->add_flag("--offload-params", flags->offload_params, "Sharded weights in host memory (ZeRO-3 / FSDP)");
  sub->add_option("--precision", flags->precision, "fp32 | mixed16 (default) | autocast16 | pure16");
  sub->add_option("--tp", flags->tp, "Tensor-parallel degree");
  sub->add_option("--pp", flags->pp, "Pipeline stages");
  sub->add_option("--cp", flags->cp, "Context-parallel degree (each sequence split over cp ranks)");
  sub->add_option("--ep", flags->ep, "Expert-parallel degree (MoE models: each rank holds 1/ep of the experts)");
  sub->add_option("--microbatches", flags->microbatches, "Micro-batches per step (pipeline / accumulation)");
  sub->add_option("--schedule", flags->schedule, "Pipeline schedule: gpipe | 1f1b (default) | interleaved");
  sub->add_option("--virtual-stages", flags->virtual_stages, "Model chunks per stage for --schedule interleaved");
  sub->add_option("--seq-len", flags->seq_len, "Tokens per sample (default: the model's context length)");
  sub->add_option("--micro-batch", flags->micro_batch, "Samples per micro-batch (default 1)");
  sub->add_option("--recompute", flags->recompute, "Activation recompute: none | selective | full");
  sub->add_option("--attention", flags->attention,
                  "naive (default: the [s, s] scores kept) | flash (tiled: no scores kept, scaletrain's CPU default)");
  sub->add_flag("--sequence-parallel", flags->sequence_parallel, "Megatron sequence parallelism (tp > 1)");
  sub->add_option("--lora-rank,--lora-r", flags->lora_rank, "LoRA rank; > 0 freezes the base weights");
  sub->add_flag("--qlora", flags->qlora, "QLoRA: the frozen linear weights in 4-bit NF4 (needs --lora-rank)");
  sub->add_option("--lora-targets", flags->lora_targets, "LoRA adapters on: qv (default) | attention | all-linear");
  sub->add_option("--bucket-mb", flags->bucket_mb, "Gradient bucket size in MiB (default 25)");
  sub->add_option("--buffer-factor", flags->buffer_factor, "DeepSpeed additional_buffer_factor (default 1.5)");
  sub->add_option("--fit", flags->fit, "Planner: list layouts that fit this much per device (80GB, 80GiB)");
  sub->add_flag("--try-offload", flags->try_offload, "Planner: also consider offload");
  sub->add_option("--max-rows", flags->max_rows, "Planner: rows to show (0 = all, default 20)");
  sub->add_flag("--json", flags->json, "JSON instead of tables");
  sub->callback([flags, &run] {
    run = [flags] {
      const auto request = to_request(*flags);
      const auto result =
          scaletrain::estimate::run(request, scaletrain::models::resolve_estimator_model(request.model));
      if (flags->json) std::printf("%s\n", result.json.dump(2).c_str());
      else std::fputs(result.text.c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace scaletrain::cli

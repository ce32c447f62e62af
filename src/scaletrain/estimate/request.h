#pragma once
// One `estimate-memory` invocation as data: what the CLI parsed, resolved into
// a model and a layout, run through the chosen method(s), rendered as text and
// JSON. The CLI file only maps flags onto a Request; tests drive the same path.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/estimate/reference_methods.h"

namespace scaletrain::estimate {

// Which estimator answers.
enum class Method {
  kScaletrain,  // our per-rank model for the given layout (default)
  kAccelerate,  // `accelerate estimate-memory` figures
  kDeepSpeed,   // DeepSpeed ZeRO-2/3 model-state estimators
  kAll,         // all three, in that order
};

Method parse_method(const std::string& s);            // scaletrain | accelerate | deepspeed | all
Precision parse_precision(const std::string& s);      // fp32 | mixed16 | autocast16 | pure16 (bf16/fp16 = mixed16)
Schedule parse_schedule(const std::string& s);        // gpipe | 1f1b | interleaved
Recompute parse_recompute(const std::string& s);      // none | selective | full
LoraTargets parse_lora_targets(const std::string& s);  // qv | attention | all-linear
// --fsdp full | shard-grad-op | no-shard | hybrid (full-shard, hybrid-shard accepted).
Sharding parse_fsdp(const std::string& s);
// --zero-stage 0..3.
Sharding sharding_from_zero_stage(int64_t stage);

struct Request {
  std::string model;                  // preset, config.json path, or count ("7.5B"): the CLI resolves it
  Method method = Method::kScaletrain;  // estimator(s) to run
  std::vector<AccelDtype> dtypes = {AccelDtype::kFloat32, AccelDtype::kFloat16, AccelDtype::kInt8,
                                    AccelDtype::kInt4};  // Accelerate columns
  int64_t world_size = 0;             // 0 = nodes * gpus_per_node
  int64_t nodes = 1;                  // machines
  int64_t gpus_per_node = 0;          // 0 = world_size / nodes (1 when both unset)
  double buffer_factor = 1.5;         // DeepSpeed additional_buffer_factor
  Layout layout;                      // tp, pp, sharding, precision, activations...; world fields are filled in
  double fit_bytes = 0;               // > 0: run the planner for this budget instead of one layout
  bool try_offload = false;           // planner: consider offload too
  size_t max_rows = 20;               // planner: rows shown (0 = all)
  bool json = false;                  // render JSON instead of tables
};

struct Result {
  std::string text;     // tables (what the CLI prints without --json)
  nlohmann::json json;  // every figure (an object, or an array for --method all)
};

// Resolves world/nodes/gpus into the layout (UsageError when inconsistent).
Layout resolve_layout(const Request& request);

// Runs the request for `spec` (the model `request.model` names, resolved by
// models::resolve_estimator_model). UsageError for bad layouts or options.
Result run(const Request& request, const ModelSpec& spec);

}  // namespace scaletrain::estimate

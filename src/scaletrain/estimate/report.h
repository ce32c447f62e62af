#pragma once
// Rendering of every estimate: readable tables (default) and JSON (--json).
// Each JSON document carries every figure its table shows, both as raw bytes
// and as the exact text printed, so scripts never parse tables.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/estimate/model_spec.h"
#include "scaletrain/estimate/planner.h"
#include "scaletrain/estimate/reference_methods.h"

namespace scaletrain::estimate {

// A boxed table laid out as Accelerate's create_ascii_table does (cells
// centred, the last column widened when the title is longer than the table).
// An empty title gives a box without a title row.
std::string box_table(const std::vector<std::string>& headers, const std::vector<std::vector<std::string>>& rows,
                      const std::string& title);

// 1024-based size with binary unit names, 2 decimals: "13.48 GiB", "512.00 MiB".
std::string human_bytes(double bytes);
// "6.74B", "124.44M", "350.00K".
std::string human_count(double n);

// Accelerate method: its table, then the training stages table.
std::string render_accelerate(const std::string& model, const std::vector<AccelerateRow>& rows);
nlohmann::json accelerate_json(const std::string& model, const ParamCounts& counts,
                               const std::vector<AccelerateRow>& rows);

// DeepSpeed method: the ZeRO-2 then the ZeRO-3 text blocks as DeepSpeed prints them.
std::string render_deepspeed(int64_t total_params, int64_t largest_layer_params, const DeepSpeedOptions& o,
                             const std::vector<DeepSpeedRow>& rows);
nlohmann::json deepspeed_json(const std::string& model, int64_t total_params, int64_t largest_layer_params,
                              const DeepSpeedOptions& o, const std::vector<DeepSpeedRow>& rows);

// scaletrain method: one layout's per-rank breakdown.
std::string render_rank(const ModelSpec& spec, const ParamCounts& counts, const Layout& layout,
                        const RankEstimate& est);
nlohmann::json layout_json(const Layout& layout);
nlohmann::json rank_json(const RankEstimate& est);
nlohmann::json scaletrain_json(const ModelSpec& spec, const ParamCounts& counts, const Layout& layout,
                               const RankEstimate& est);

// Planner: the fitting layouts.
std::string render_plan(const ModelSpec& spec, const PlanOptions& options, const std::vector<PlanRow>& rows);
nlohmann::json plan_json(const ModelSpec& spec, const PlanOptions& options, const std::vector<PlanRow>& rows);

// The model's counts (every method's JSON embeds this).
nlohmann::json counts_json(const ModelSpec& spec, const ParamCounts& counts);

}  // namespace scaletrain::estimate

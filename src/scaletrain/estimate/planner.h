#pragma once
// The layout planner: given a model, a per-device memory budget and a world
// size, list every layout (tp, pp, ZeRO stage / hybrid sharding, recompute,
// sequence parallelism, offload) whose per-rank peak fits, cheapest
// communication first.
#include <cstdint>
#include <vector>

#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/estimate/model_spec.h"

namespace scaletrain::estimate {

struct PlanOptions {
  double budget_bytes = 80e9;  // device memory per rank a layout must fit in
  Layout base;                 // held fixed: world_size, gpus_per_node, precision, seq_len,
                               // micro_batch, microbatches, schedule, lora, bandwidths
  bool try_offload = false;    // also consider optimizer (and ZeRO-3 parameter) offload
  int64_t max_tp = 0;          // largest TP degree; 0 = gpus_per_node (TP across nodes is too slow)
  size_t max_rows = 0;         // keep the first N rows; 0 = all
};

// One candidate that fits.
struct PlanRow {
  Layout layout;          // the full layout
  RankEstimate estimate;  // its per-rank figures
};

// For every (tp, pp, sharding, offload) the first fitting variant in the order
// of least recomputation: (none), (none + SP), (selective), (selective + SP),
// (full), (full + SP); sorted by communication time, then by peak memory.
// Pipeline layouts need at least pp micro-batches per step (Layout::microbatches),
// otherwise the bubble alone wastes half the step; they are not listed.
// Invalid combinations (tp not dividing heads, ...) are skipped, not errors;
// an invalid base layout (world not a whole number of nodes) is a UsageError.
std::vector<PlanRow> plan(const ModelSpec& spec, const PlanOptions& options);

// "80GB" (1e9), "80GiB" (2^30), "512MB", "1.5TB", or a bare number of GB.
// UsageError for anything else.
double parse_memory_size(const std::string& text);

}  // namespace scaletrain::estimate

#pragma once
// The transient part of a rank's memory under scaletrain's engines, for
// estimate_rank (memory_model.cpp): what activations, gathered units, the
// engines' gradient buffers and the optimizer step's temporaries add to the
// model states at the worst moment of a step (Note [The worst moment] in
// peak.cpp). Pure arithmetic.
#include <cstdint>

#include "scaletrain/estimate/memory_model.h"

namespace scaletrain::estimate {

// One pipeline stage on one rank, as the engines see it. Counts are
// elements, sizes bytes.
struct StageShape {
  bool shapes = true;         // false: a raw parameter count (no layers, no activations)
  int64_t layers = 0;         // transformer layers on the stage
  double layer_params = 0;    // one layer's parameters (this rank's TP slice)
  double root_params = 0;     // embeddings, final norm, pooler, head on this stage
  double params = 0;          // all parameters of the stage
  double trainable = 0;       // of those, trained
  double largest_tensor = 0;  // biggest single parameter tensor (the optimizer's per-tensor temporaries)
  double inflight = 1;        // micro-batches whose activations the stage holds
  // Activations of one micro-batch (bytes).
  double act_layer = 0;       // stored per layer under the layout's recompute policy
  double act_layer_full = 0;  // one layer without recompute (re-materialized in backward)
  double act_first = 0;       // first stage only: embedding dropout mask
  double act_last = 0;        // last stage only: final norm and head inputs, fp32 log-softmax
  double ws_layer = 0;        // gradients in flight during one layer's backward
  double ws_last = 0;         // gradients in flight during the loss's backward
};

// Bytes per element of the states involved.
struct StageWidths {
  double weight = 4, grad = 4, compute = 4, optimizer_state = 4;  // optimizer_state: one Adam moment
};

// Fills gathered, comm_buffers, activations and workspace of `e` (model
// states are already in it); `n` is the size of the sharding group.
void add_transient_memory(const StageShape& s, const StageWidths& w, const Layout& l, int64_t n, RankEstimate& e);

}  // namespace scaletrain::estimate

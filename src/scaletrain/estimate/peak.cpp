// The worst moment of a training step under scaletrain's engines. See peak.h.
//
// Note [The worst moment]
// -----------------------
// Model states are there all the time; everything else comes and goes, and
// the peak is the moment where the most of it is alive at once. We evaluate
// the candidates and keep the largest:
// - the loss's backward: every activation of the micro-batch, plus the
//   gradients of the fp32 log-softmax (ws_last);
// - the backward of layer j (from the last layer down): the activations of
//   layers 1..j (the head's and the upper layers' are freed by then), the
//   re-materialized layer under full recompute, the gradients in flight
//   inside the layer (ws_layer), and the engine's whole-gradient buffers of
//   the units being accumulated or reduce-scattered (ZeRO-2/3, below);
// - the optimizer step: no activations, but the step's temporaries.
// Without recompute the first layer moments win (activations dominate);
// with full recompute the engines' gradient buffers or the step can.
//
// Engine buffers, measured with the trainer's tensor-byte counter
// (bench/RESULTS.md section 7):
// - DDP keeps no extra buffer: gradients are views into its buckets
//   (PyTorch's gradient_as_bucket_view). The buckets are rebuilt once, after
//   the first backward (parallel/ddp, Note [Bucket rebuild]); for that moment
//   the gradients exist twice.
// - The sharded engine (ZeRO-1/2/3, FSDP) forms units: a root (embeddings,
//   final norm, head, and under ZeRO-1/2 the trailing layers that fill no
//   bucket) and either one layer each (ZeRO-3) or as many consecutive layers
//   as fill a reduce bucket (ZeRO-1/2's size policy). On Gloo its
//   reduce-scatter, an all-to-all, receives whole units into buffers the
//   group pools and keeps (comm/group.h, Note [Scratch buffers]): one per
//   reduce in flight plus the one being started, each as large as the
//   largest unit (Layout::gloo; NCCL reduce-scatters in place). ZeRO-2/3 also
//   keep a receive shard beside each gradient shard (ZeRO-1 reduces in place
//   into its whole gradients), and ZeRO-3's parameter shards are buffers of
//   their own beside the gathered units, on one rank too. Under ZeRO-2/3 a unit's whole
//   gradients exist from its first gradient until its reduce has finished,
//   and the root, first to get gradients and last to be reduced, holds its
//   whole gradients through all of backward; under ZeRO-3 the root's
//   parameters stay gathered from forward to the end of backward, next to
//   the unit computing and the one prefetched.
// - The step: the global norm squares each gradient tensor in fp64 (16 bytes
//   per element of the largest tensor), AdamW's denominator takes two
//   temporaries of the largest tensor, and ZeRO-1/2 gather the updated shards
//   from a copy of every shard while Gloo flattens each all-gather's output
//   (its two worker threads: two units at a time).
// These replace the DeepSpeed-style "two buckets in flight" this model
// started from; DeepSpeed, or PyTorch DDP without bucket views, would need
// that term back.
#include "scaletrain/estimate/peak.h"

#include <algorithm>
#include <cmath>

namespace scaletrain::estimate {

namespace {

// Units of the sharded engine on the stage (elements): one layer, the root,
// a block unit of `per_unit` layers, and how many block units there are.
struct EngineUnits {
  double layer = 0, root = 0, unit = 0;
  int64_t per_unit = 1, units = 0;
};

EngineUnits engine_units(const StageShape& s, const StageWidths& w, const Layout& l, bool zero3) {
  const double layer = s.shapes ? s.layer_params : 0.0;
  double root = s.shapes ? s.root_params : 0.0, unit = layer;
  int64_t per_unit = 1, units = s.layers;
  if (!zero3) {
    const double bucket = static_cast<double>(l.bucket_bytes) / w.weight;
    if (!s.shapes) {
      unit = std::min(bucket, s.params);
      units = unit > 0 ? static_cast<int64_t>(std::ceil(s.params / unit)) : 0;
    } else if (s.layers > 0) {
      per_unit = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(bucket / layer)));
      units = s.layers / per_unit;
      unit = units > 0 ? static_cast<double>(per_unit) * layer : 0.0;
      root += static_cast<double>(s.layers % per_unit) * layer;
    }
  }
  return {layer, root, unit, per_unit, units};
}

// The optimizer step's temporaries (bytes); `largest` is the largest unit.
double step_temporaries(const StageShape& s, const StageWidths& w, const Layout& l, int64_t n, double largest,
                        int64_t units) {
  const bool ddp = l.sharding == Sharding::kNone;
  const double opt_tensor = ddp ? s.largest_tensor : std::ceil(largest / static_cast<double>(n));
  double step = std::max(16.0 * opt_tensor, 2.0 * w.optimizer_state * opt_tensor);
  if (ddp) step = std::max(step, s.trainable * w.grad);  // the one-time bucket rebuild
  if (l.sharding == Sharding::kZero1 || l.sharding == Sharding::kZero2) {
    const double flat_outputs = l.gloo && n > 1 ? static_cast<double>(std::min<int64_t>(2, units + 1)) * largest : 0.0;
    step = std::max(step, (s.params / static_cast<double>(n) + flat_outputs) * w.weight);
  }
  return step;
}

}  // namespace

void add_transient_memory(const StageShape& s, const StageWidths& w, const Layout& l, int64_t n, RankEstimate& e) {
  const bool ddp = l.sharding == Sharding::kNone;
  const bool zero3 = l.sharding == Sharding::kZero3 || l.sharding == Sharding::kHybrid;
  const bool whole_unit_grads = l.sharding == Sharding::kZero2 || zero3;  // grads sharded after each unit's reduce
  const double frac = s.params > 0 ? s.trainable / s.params : 1.0;
  const double g = frac * w.grad;  // gradient bytes per parameter of a unit

  // Units of the sharded engine.
  const auto [layer, root, unit, per_unit, units] = engine_units(s, w, l, zero3);
  const double largest = std::max(unit, root);

  // Buffers the engine keeps between steps.
  double persistent = 0;
  if (!ddp && l.gloo && n > 1)
    persistent = std::min(s.trainable * w.grad, static_cast<double>(l.reduces_in_flight + 1) * largest * g);
  if (whole_unit_grads) persistent += s.trainable * w.grad / static_cast<double>(n);

  // Activations: what every micro-batch in flight stores.
  const double per_mb = static_cast<double>(s.layers) * s.act_layer + s.act_first + s.act_last;
  const bool full = l.recompute == Recompute::kFull && s.layers > 0;
  e.recomputed = full ? s.act_layer_full : 0.0;
  e.activations = s.inflight * per_mb + e.recomputed;
  const double others = (s.inflight - 1) * per_mb;

  // Gathered during forward and backward.
  double gathered = 0;
  if (zero3)
    gathered = (root + static_cast<double>(1 + l.prefetch_units) * layer) * w.compute;
  else if (l.precision == Precision::kAutocast16)
    gathered = s.params * w.compute;  // autocast's weight casts
  const double root_grads = whole_unit_grads && s.shapes ? root * g : 0.0;

  struct Moment {
    double act = 0, grads = 0, gathered = 0;
    double sum() const { return act + grads + gathered; }
  };
  Moment worst;
  auto consider = [&worst](const Moment& m) {
    if (m.sum() > worst.sum()) worst = m;
  };
  if (s.shapes && s.act_last > 0) consider({others + per_mb + s.ws_last, root_grads, gathered});
  for (int64_t j = s.layers; j >= 1; --j) {  // layer j's backward, j = 1 the first layer
    Moment m{others + s.act_first + static_cast<double>(j) * s.act_layer + (full ? s.act_layer_full : 0.0) + s.ws_layer,
             root_grads, gathered};
    if (whole_unit_grads) {
      // The unit holding layer j accumulates; the units above it (finished
      // earlier in backward) are still being reduced, up to reduces_in_flight.
      int64_t above = -1;
      if (zero3)
        above = s.layers - j;
      else if (j - 1 < units * per_unit)
        above = units - 1 - (j - 1) / per_unit;
      const double u = zero3 ? layer : unit;
      if (above >= 0) m.grads += static_cast<double>(1 + std::min<int64_t>(l.reduces_in_flight, above)) * u * g;
    }
    consider(m);
  }
  if (!s.shapes && whole_unit_grads) consider({0.0, largest * g, gathered});

  // The optimizer step's temporaries.
  const double step = step_temporaries(s, w, l, n, largest, units);
  consider({step, 0.0, 0.0});

  e.gathered = worst.gathered;
  e.comm_buffers = persistent + worst.grads;
  // What the worst moment adds to the stored activations: gradients in
  // flight, or the step's temporaries (then nothing is stored). A moment deep
  // in a recomputed backward, with some stored inputs already freed, counts
  // them anyway (a slight overestimate).
  e.workspace = std::max(0.0, worst.act - e.activations);
}

}  // namespace scaletrain::estimate

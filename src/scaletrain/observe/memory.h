#pragma once
// The memory estimator's per-rank prediction for a run next to what the
// ranks really hold, logged by the trainer after setup and at the end of a
// run (a line on stdout and a {"record": "memory"} line in metrics.path).
// The layout the estimator predicts for comes from train/plan/memory_layout.h.
//
// Note [What is measured]
// -----------------------
// The estimator (estimate/memory_model.h) predicts tensor bytes: model states
// (parameters, gradients, optimizer states), activations saved for backward,
// gathered units and gradient buffers. A process's resident set holds more:
// libtorch's code and static data, thread stacks, Gloo's buffers, the mapped
// token file, and memory glibc keeps after tensors are freed. So a run
// reports, per rank (the maximum over ranks, since every data-parallel rank
// is the same kind of rank here):
//   states       parameters + gradients the strategy holds
//                (DataParallel::model_state_bytes) + AdamW's two states;
//   activations  tensor bytes one micro-batch's forward leaves alive for its
//                backward (the largest over the run's micro-batches), counted
//                from before the strategy's forward: units a strategy keeps
//                gathered until backward (ZeRO-3's root) are included;
//   tensor peak  the most bytes of live CPU tensors at any moment of the
//                training steps: counted by a wrapper around libtorch's CPU
//                allocator (TensorBytes), so it is the same quantity the
//                estimator predicts, including transients;
//   rss          resident set before the model was built (baseline) and its
//                peak during the training steps; peak - baseline is the
//                growth the run caused, overhead included: file-backed pages
//                (libtorch's code as it first runs, the token file; reported
//                apart) and heap glibc keeps after tensors are freed.
// "predicted / tensor peak" is the comparison the estimator is held to.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "scaletrain/comm/group.h"
#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/observe/metrics.h"

namespace scaletrain::observe {

// Live bytes of CPU tensors, counted by a wrapper installed around libtorch's
// CPU allocator (process-wide, like the allocator it wraps). Tensors
// allocated before install() are not counted, nor their release.
class TensorBytes {
 public:
  // Installs the counting allocator once; false if libtorch kept another
  // allocator (then every figure below reads 0).
  static bool install();
  static bool installed();
  static int64_t current();
  static int64_t peak();
  static void reset_peak();  // peak := current
};

// Peak resident set since the last reset_rss_peak() (VmHWM), in MiB.
double rss_peak_mb();
// File-backed part of the resident set now (RssFile: code pages, mapped
// files), in MiB.
double rss_file_mb();
// Heap memory glibc holds free in its arenas now (not returned to the
// kernel, so still resident once touched), in MiB.
double heap_free_mb();
// Gives the heap memory glibc holds free back to the kernel (malloc_trim):
// what setup freed (a loader's converted copy of each tensor, a quantizer's
// dequantized weights) would otherwise stay resident for the whole run.
void release_free_heap();
// Makes the kernel's peak resident set the current one (/proc/self/clear_refs);
// false when the kernel does not allow it (then rss_peak_mb() is the lifetime peak).
bool reset_rss_peak();

// Measured figures of one rank, bytes (rss in MiB).
struct MeasuredMemory {
  double states = 0;              // parameters + gradients + optimizer states held now
  double activations = 0;         // kept by one forward for its backward (0: not measured: before
                                  // training, or a pipeline, whose micro-batches overlap)
  double tensors = 0;             // live tensor bytes now
  double tensor_peak = 0;         // peak live tensor bytes since the last reset (0 before training)
  double rss_baseline_mb = 0;     // resident set before the model was built
  double rss_peak_mb = 0;         // peak resident set since training started (setup: now)
  double rss_file_growth_mb = 0;  // growth of the file-backed part (libtorch code first run, the token file)
  double heap_free_mb = 0;        // freed heap glibc still holds (mallinfo2 fordblks), now
};

// Takes the maximum of every rank's `local` figures over `all` (collective),
// then on `lead` prints memory_line() and writes memory_record() to `sink`.
// An estimator that cannot describe the layout prints why instead.
void report_memory(const std::string& phase, const estimate::ModelSpec& model, const estimate::Layout& layout,
                   const MeasuredMemory& local, comm::Group& all, bool lead, MetricsSink& sink);

// One log line ("memory after setup ..." / "memory at the end ...") comparing
// `predicted` with `measured` (already the maximum over `ranks` ranks), and
// the same as one JSON object {"record": "memory", "phase": PHASE, ...}.
std::string memory_line(const std::string& phase, const estimate::Layout& layout,
                        const estimate::RankEstimate& predicted, const MeasuredMemory& measured, int ranks);
nlohmann::json memory_record(const std::string& phase, const estimate::Layout& layout,
                             const estimate::RankEstimate& predicted, const MeasuredMemory& measured, int ranks);

}  // namespace scaletrain::observe

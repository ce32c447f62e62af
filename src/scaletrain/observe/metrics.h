#pragma once
// Per-step measurements of a run and where they go: one log line, a JSON line
// in metrics.path (rank 0), and a progress bar when stdout is a terminal.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace scaletrain::observe {

struct StepMetrics {
  int64_t step = 0;           // 1-based optimizer step
  double loss = 0;            // mean training loss over the global batch
  double lr = 0;              // learning rate used by this step
  double step_ms = 0;         // wall time of the step
  double samples_per_s = 0;   // global samples (sequences) per second
  // Global tokens per second and model FLOPs utilization per rank (0..1);
  // tokens_per_s < 0: the run counts no tokens (a user's module), and
  // neither is written.
  double tokens_per_s = 0;
  double mfu = 0;
  double peak_rss_mb = 0;     // this process's peak resident set
  double comm_wait_ms = 0;    // time backward/step blocked on communication
  double grad_norm = 0;       // global gradient norm before clipping
  double loss_scale = 1;      // loss scale of this step (1 without loss scaling)
  int64_t skipped_steps = 0;  // steps skipped so far because gradients overflowed
  // The device allocator's peaks (a GPU run; negative: no device allocator, RSS is the figure).
  double device_max_allocated_mb = -1;
  double device_max_reserved_mb = -1;
  // MoE models (Note [MoE routing] in models/moe.h), over the whole job: the
  // load-balancing and z losses (means over sequences and MoE layers, before
  // their coefficients), slots each expert took (summed over layers), and
  // slots the capacity limit dropped. Empty tokens_per_expert: a dense model.
  double moe_aux_loss = 0;
  double moe_z_loss = 0;
  std::vector<int64_t> moe_tokens_per_expert;
  int64_t moe_dropped = 0;
};

class MetricsSink {
 public:
  // `path` may be empty (no file). Progress bar only if `progress` and stdout
  // is a terminal. `append`: a restarted attempt of the same job adds to the
  // file (a first start replaces it).
  MetricsSink(const std::string& path, int64_t total_steps, bool progress, bool append = false);
  ~MetricsSink();
  void write(const StepMetrics& m, bool log_line);
  // Appends one JSON object that is not a step (it carries a "record" key
  // naming its kind, e.g. {"record": "memory", ...}) to the file, if any.
  void write_record(const std::string& json);

 private:
  std::ofstream file_;
  int64_t total_;
  bool bar_;
};

// Peak resident set size of this process in MiB (getrusage).
double peak_rss_mb();
// This process's resident set now (VmRSS), in MiB.
double current_rss_mb();

// Sets torch's intra-op threads and, when the BLAS is OpenBLAS's pthread
// build (which ignores torch's setting), OpenBLAS's own thread count.
void set_compute_threads(int n);

// How the BLAS that libtorch loaded runs its threads: "openmp", "pthreads" or
// "sequential" for OpenBLAS (openblas_get_parallel), "" for another BLAS.
// OpenBLAS's pthreads build keeps a thread pool of its own beside libtorch's
// OpenMP one, and the two contend for the cores (docs/kernels.md, "Threads").
std::string blas_threading();

// FLOP/s of a square fp32 GEMM of size n on the current torch threads: the
// peak MFU is measured against (`scaletrain bench-gemm`). Best of `reps`.
double measure_gemm_flops(int64_t n = 1024, int reps = 7);
// The same on the current CUDA device, in bf16 (n x n x n products, each
// timed between device synchronizations).
double measure_device_gemm_flops(int64_t n = 8192, int reps = 7);

}  // namespace scaletrain::observe

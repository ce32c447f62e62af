#pragma once
// The two estimators people already run, reproduced figure for figure, so
// `scaletrain estimate-memory --method accelerate|deepspeed` prints what
// `accelerate estimate-memory` and DeepSpeed's estimate_zero{2,3}_model_states_mem_needs
// print for the same model.
//
// Accelerate (commands/estimate.py, utils calculate_maximum_sizes):
//   sizes are bytes of the fp32 AutoModel (no LM head), buffers included; the
//   dtype columns divide by 2 (float16), 4 (int8), 8 (int4); "Training using
//   Adam" is the highest of four stages computed from the fp32 size T:
//     float32:         model T, gradients T,        optimizer 2T, step 4T
//     float16/bf16:    model T, gradients T + T//2, optimizer 2T, step 2T
//     int8/int4:       not estimated ("N/A").
//   Figures print with convert_bytes: divide by 1024 until below 1024, round
//   to 2 decimals, Python float repr ("474.7 MB", "1.61 GB").
//
// DeepSpeed (runtime/zero/stage_1_and_2.py and stage3.py), P = total params,
// G = nodes * gpus_per_node, f = additional_buffer_factor (1.5), Lp = largest
// layer params:
//   ZeRO-2 offload:    GPU 2P;              CPU P * max(4G, 16) * f
//   ZeRO-2 no offload: GPU 4P + int(16P/G); CPU P * 4 * gpus_per_node * f
//   ZeRO-3 (see zero3_row for the five branches): GPU 4Lp + k*P/G,
//   CPU 18P/nodes*f, ...
//   Figures print as bytes / 2**30 with 2 decimals, labelled "GB".
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/estimate/model_spec.h"

namespace scaletrain::estimate {

// Accelerate's dtype choices (bfloat16 behaves as float16).
enum class AccelDtype { kFloat32, kFloat16, kBfloat16, kInt8, kInt4 };

const char* accel_dtype_name(AccelDtype d);
// Parses "float32", "float16", "bfloat16", "int8", "int4" (also fp32, fp16,
// bf16); UsageError otherwise.
AccelDtype parse_accel_dtype(const std::string& s);

// One row of the Accelerate table. Training stages are -1 where Accelerate
// does not estimate them (int8, int4).
struct AccelerateRow {
  AccelDtype dtype = AccelDtype::kFloat32;
  double largest_layer_bytes = 0;  // "Largest Layer" for this dtype
  double total_bytes = 0;          // "Total Size" for this dtype
  double model_bytes = -1;         // training stage "Model"
  double gradients_bytes = -1;     // training stage "Gradients" (weight grads + 16-bit GEMM copy)
  double optimizer_bytes = -1;     // training stage "Backward pass" (Adam states allocated)
  double step_bytes = -1;          // training stage "Optimizer step"
  double highest_bytes = -1;       // "Training using Adam": max of the four
};

// Rows for `dtypes`, in that order, for the model's AutoModel counts.
std::vector<AccelerateRow> accelerate_rows(const ParamCounts& counts, const std::vector<AccelDtype>& dtypes);

// Same arithmetic from a raw fp32 byte size and largest-layer size (what
// Accelerate's calculate_maximum_sizes returns).
AccelerateRow accelerate_row(double total_fp32_bytes, double largest_fp32_bytes, AccelDtype dtype);

// Hardware and tuning knobs of the DeepSpeed estimators (their defaults).
struct DeepSpeedOptions {
  int64_t num_nodes = 1;                  // machines
  int64_t gpus_per_node = 1;              // GPUs per machine
  double additional_buffer_factor = 1.5;  // DeepSpeed's fudge factor on CPU memory
};

// One line of DeepSpeed's "per CPU | per GPU | Options" table, in bytes.
struct DeepSpeedRow {
  int stage = 2;                  // 2 or 3
  bool offload_optimizer = false;  // offload_optimizer=cpu (ZeRO-2: cpu_offload)
  bool offload_param = false;      // offload_param=cpu (ZeRO-3 only)
  bool zero_init = false;          // zero.Init used to build the model (ZeRO-3 only)
  int64_t cpu_bytes = 0;           // per CPU (per node)
  int64_t gpu_bytes = 0;           // per GPU
  std::string options;             // DeepSpeed's options text
};

DeepSpeedRow zero2_row(int64_t total_params, bool offload_optimizer, const DeepSpeedOptions& o);
DeepSpeedRow zero3_row(int64_t total_params, int64_t largest_layer_params, bool offload_optimizer,
                       bool offload_param, bool zero_init, const DeepSpeedOptions& o);

// All rows in DeepSpeed's print order: ZeRO-2 (offload, no offload), then
// ZeRO-3 (offload both x zero_init 1/0, offload optimizer x 1/0, none x 1/0).
std::vector<DeepSpeedRow> deepspeed_rows(int64_t total_params, int64_t largest_layer_params,
                                         const DeepSpeedOptions& o);

// Python-exact formatting used by the reference tools.
// convert_bytes: "512 bytes", "474.7 MB", "1.61 GB" (is_int: Python int input).
std::string convert_bytes(double size, bool is_int = false);
// Python's f"{x:{width}.2f}".
std::string fixed2(double x, int width = 0);
// Python's str.center(width) (CPython's split of odd padding).
std::string center(const std::string& s, size_t width);

}  // namespace scaletrain::estimate

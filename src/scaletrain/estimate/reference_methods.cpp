// Accelerate and DeepSpeed estimators, reproduced. See reference_methods.h for
// the formulas; this file keeps their integer/float evaluation order, because
// the printed figures depend on it (int() truncation, `//` floor division).
#include "scaletrain/estimate/reference_methods.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "scaletrain/util/error.h"

namespace scaletrain::estimate {

const char* accel_dtype_name(AccelDtype d) {
  switch (d) {
    case AccelDtype::kFloat32: return "float32";
    case AccelDtype::kFloat16: return "float16";
    case AccelDtype::kBfloat16: return "bfloat16";
    case AccelDtype::kInt8: return "int8";
    case AccelDtype::kInt4: return "int4";
  }
  return "?";
}

AccelDtype parse_accel_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32") return AccelDtype::kFloat32;
  if (s == "float16" || s == "fp16") return AccelDtype::kFloat16;
  if (s == "bfloat16" || s == "bf16") return AccelDtype::kBfloat16;
  if (s == "int8") return AccelDtype::kInt8;
  if (s == "int4") return AccelDtype::kInt4;
  throw UsageError("unknown dtype '" + s + "' (known: float32, float16, bfloat16, int8, int4)");
}

AccelerateRow accelerate_row(double total, double largest, AccelDtype dtype) {
  AccelerateRow r;
  r.dtype = dtype;
  // Training usage is computed from the fp32 size before the dtype division,
  // exactly as Accelerate's gather_data does.
  const double fp16 = std::floor(total / 2);  // Python `bytes // 2`
  switch (dtype) {
    case AccelDtype::kFloat32:
      r.model_bytes = total;
      r.gradients_bytes = total;
      r.optimizer_bytes = 2 * total;
      r.step_bytes = 4 * total;
      break;
    case AccelDtype::kFloat16:
    case AccelDtype::kBfloat16:
      // Weights are kept in fp32 and fp16; gradients 1.5x (fp32 grad + fp16
      // GEMM output); Adam's two fp32 states; the step allocates nothing new.
      r.model_bytes = total;
      r.gradients_bytes = total + fp16;
      r.optimizer_bytes = 2 * total;
      r.step_bytes = r.optimizer_bytes;
      break;
    case AccelDtype::kInt8:
    case AccelDtype::kInt4: break;  // Accelerate leaves these at -1 ("N/A")
  }
  r.highest_bytes = std::max({r.model_bytes, r.gradients_bytes, r.optimizer_bytes, r.step_bytes});
  double div = 1;
  switch (dtype) {
    case AccelDtype::kFloat32: div = 1; break;
    case AccelDtype::kFloat16:
    case AccelDtype::kBfloat16: div = 2; break;
    case AccelDtype::kInt8: div = 4; break;
    case AccelDtype::kInt4: div = 8; break;
  }
  r.total_bytes = total / div;
  r.largest_layer_bytes = largest / div;
  return r;
}

std::vector<AccelerateRow> accelerate_rows(const ParamCounts& c, const std::vector<AccelDtype>& dtypes) {
  const double total = 4.0 * static_cast<double>(c.base_model) + c.buffer_bytes;
  std::vector<AccelerateRow> rows;
  rows.reserve(dtypes.size());
  for (AccelDtype d : dtypes) rows.push_back(accelerate_row(total, c.largest_layer_bytes, d));
  return rows;
}

DeepSpeedRow zero2_row(int64_t P, bool offload, const DeepSpeedOptions& o) {
  DeepSpeedRow r;
  r.stage = 2;
  r.offload_optimizer = offload;
  const int64_t gpus = o.num_nodes * o.gpus_per_node;
  const double f = o.additional_buffer_factor;
  if (offload) {
    r.gpu_bytes = 2 * P;
    r.cpu_bytes = static_cast<int64_t>(static_cast<double>(P * std::max<int64_t>(4 * gpus, 16)) * f);
  } else {
    r.gpu_bytes = 4 * P + static_cast<int64_t>(static_cast<double>(16 * P) / static_cast<double>(gpus));
    r.cpu_bytes = static_cast<int64_t>(static_cast<double>(P * 4 * o.gpus_per_node) * f);
  }
  r.options = offload ? "offload_optimizer=cpu " : "offload_optimizer=none";
  return r;
}

DeepSpeedRow zero3_row(int64_t P, int64_t Lp, bool offload_optimizer, bool offload_param, bool zero_init,
                       const DeepSpeedOptions& o) {
  DeepSpeedRow r;
  r.stage = 3;
  r.offload_optimizer = offload_optimizer;
  r.offload_param = offload_param;
  r.zero_init = zero_init;
  const int64_t gpus = o.num_nodes * o.gpus_per_node;
  const double f = o.additional_buffer_factor;
  const double gpus_factor = 1.0 / static_cast<double>(o.num_nodes);
  const int64_t largest_layer_memory = 4 * Lp;
  // Python evaluates `P * 18 * gpus_factor * f` left to right: an exact int
  // product, then float multiplications. Same order here.
  auto per_node = [&](int64_t bytes_per_param) {
    if (zero_init) return static_cast<double>(P * bytes_per_param) * gpus_factor * f;
    const double m = std::max(static_cast<double>(4 * o.gpus_per_node),
                              static_cast<double>(bytes_per_param) * gpus_factor);
    return static_cast<double>(P) * m * f;
  };
  double cpu = 0;
  if (offload_optimizer) {
    if (offload_param) {
      r.gpu_bytes = largest_layer_memory;
      cpu = per_node(18);
    } else {
      r.gpu_bytes = largest_layer_memory + static_cast<int64_t>(static_cast<double>(2 * P) / static_cast<double>(gpus));
      cpu = per_node(16);
    }
  } else {
    r.gpu_bytes = largest_layer_memory + static_cast<int64_t>(static_cast<double>(18 * P) / static_cast<double>(gpus));
    cpu = zero_init ? static_cast<double>(Lp * 4 * o.gpus_per_node) * f
                    : static_cast<double>(P * 4 * o.gpus_per_node) * f;
  }
  r.cpu_bytes = static_cast<int64_t>(cpu);
  r.options = std::string("offload_param=") + (offload_param ? "cpu " : "none") +
              ", offload_optimizer=" + (offload_optimizer ? "cpu " : "none") +
              ", zero_init=" + (zero_init ? "1" : "0");
  return r;
}

std::vector<DeepSpeedRow> deepspeed_rows(int64_t P, int64_t Lp, const DeepSpeedOptions& o) {
  std::vector<DeepSpeedRow> rows{zero2_row(P, true, o), zero2_row(P, false, o)};
  for (bool opt : {true, false})
    for (bool par : {true, false}) {
      if (!opt && par) continue;  // param offload needs optimizer offload
      for (bool init : {true, false}) rows.push_back(zero3_row(P, Lp, opt, par, init, o));
    }
  return rows;
}

namespace {

// "%.2f" then Python's float repr of the rounded value: glibc rounds the exact
// binary value half-to-even like CPython's round(); repr drops trailing zeros
// but keeps one decimal.
std::string py_round2(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", x);
  std::string s(buf);
  while (s.size() > 1 && s.back() == '0' && s[s.size() - 2] != '.') s.pop_back();
  if (s == "-0.0") s = "0.0";
  return s;
}

}  // namespace

std::string convert_bytes(double size, bool is_int) {
  static const char* units[] = {"bytes", "KB", "MB", "GB", "TB"};
  for (const char* unit : units) {
    if (size < 1024.0) {
      if (is_int) return std::to_string(static_cast<int64_t>(size)) + " " + unit;
      return py_round2(size) + " " + unit;
    }
    size /= 1024.0;
    is_int = false;  // Python's `/=` turns an int into a float
  }
  return py_round2(size) + " PB";
}

std::string fixed2(double x, int width) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%*.2f", width, x);
  return buf;
}

std::string center(const std::string& s, size_t width) {
  if (s.size() >= width) return s;
  const size_t marg = width - s.size();
  const size_t left = marg / 2 + (marg & width & 1);
  return std::string(left, ' ') + s + std::string(marg - left, ' ');
}

}  // namespace scaletrain::estimate

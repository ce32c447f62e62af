#include "scaletrain/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "scaletrain/config/config_values.h"
#include "scaletrain/util/error.h"

namespace scaletrain::config {

int64_t to_int(const std::string& key, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (!v.empty() && *end == '\0' && errno != ERANGE) return x;
  // Counts written like 1e8 (PyTorch's min_num_params) are fine when they are whole numbers.
  errno = 0;
  double d = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE || d != std::floor(d) || std::fabs(d) > 9.2e18)
    throw UsageError(key + ": '" + v + "' is not an integer");
  return static_cast<int64_t>(d);
}

double to_double(const std::string& key, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || errno == ERANGE) throw UsageError(key + ": '" + v + "' is not a number");
  if (!std::isfinite(x)) throw UsageError(key + ": '" + v + "' is not a finite number");
  return x;
}

bool to_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "True" || v == "1" || v == "yes") return true;
  if (v == "false" || v == "False" || v == "0" || v == "no") return false;
  throw UsageError(key + ": '" + v + "' is not true or false");
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : " | ") + (x.empty() ? std::string("\"\"") : x);
  return out;
}

std::string join_problems(const std::vector<std::string>& problems) {
  if (problems.size() == 1) return problems[0];
  std::string all = std::to_string(problems.size()) + " problems in the config: ";
  for (size_t i = 0; i < problems.size(); ++i) all += (i ? "; " : "") + problems[i];
  return all;
}

YAML::Node read_yaml_file(const std::string& path) {
  std::ifstream probe(path);
  if (!probe) throw UsageError("config file " + path + " cannot be read");
  try {
    return YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw UsageError("config file " + path + " is not valid YAML (line " + std::to_string(e.mark.line + 1) +
                     ", column " + std::to_string(e.mark.column + 1) + "): " + e.msg);
  }
}

namespace {

// One key of the table: how to set it from text and how to show its value.
struct Field {
  std::function<void(Config&, const std::string&)> set;
  std::function<std::string(const Config&)> get;
  const char* type = "";  // what `show` takes: int | float | bool | string | steps (config_key_table)
};

// Enum-like keys: their choices and how to read the current value.
struct Choice {
  std::vector<std::string> values;
  std::function<const std::string&(const Config&)> get;
};

const std::map<std::string, Choice>& choices() {
  static const std::map<std::string, Choice> table = [] {
    std::map<std::string, Choice> t;
    const std::vector<std::string> dtypes{"fp32", "bf16", "fp16"}, dtype_or_same{"", "fp32", "bf16", "fp16"},
        offload{"none", "cpu", "nvme"};
    // clang-format off
#define ST_CHOICE(section, name, ...) \
  t[#section "." #name] = Choice{__VA_ARGS__, [](const Config& c) -> const std::string& { return c.section.name; }};
    ST_CHOICE(model, activation_checkpointing, {"none", "full"})
    ST_CHOICE(model, moe_drop_policy, {"probs", "position"})
    ST_CHOICE(model, attention, {"flash", "naive"})
    ST_CHOICE(data, pack, {"concat", "documents"})
    ST_CHOICE(data, loss_on, {"all", "completion", "assistant"})
    ST_CHOICE(train, lr_schedule, {"cosine", "linear", "constant"})
    ST_CHOICE(train, warmup_type, {"linear", "log"})
    ST_CHOICE(parallel, strategy, {"ddp", "zero1", "zero2", "zero3", "fsdp"})
    ST_CHOICE(parallel, comm_dtype, {"fp32", "bf16", "fp8"})
    ST_CHOICE(parallel, backend, {"auto", "gloo", "nccl"})
    ST_CHOICE(parallel, schedule, {"gpipe", "1f1b", "interleaved"})
    ST_CHOICE(parallel, cp_mode, {"ring", "all_to_all"})
    ST_CHOICE(parallel, pp_balance, {"params", "time"})
    ST_CHOICE(parallel.fsdp, sharding_strategy, {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"})
    ST_CHOICE(parallel.fsdp, auto_wrap_policy, {"transformer", "size", "none"})
    ST_CHOICE(parallel.fsdp, backward_prefetch, {"BACKWARD_PRE", "BACKWARD_POST", "NONE"})
    ST_CHOICE(parallel.fsdp, state_dict_type, {"FULL_STATE_DICT", "SHARDED_STATE_DICT"})
    ST_CHOICE(parallel.zero, offload_optimizer, offload)
    ST_CHOICE(parallel.zero, offload_param, offload)
    ST_CHOICE(precision, mode, dtypes)
    ST_CHOICE(precision, param_dtype, dtypes)
    ST_CHOICE(precision, reduce_dtype, dtype_or_same)
    ST_CHOICE(precision, buffer_dtype, dtype_or_same)
    ST_CHOICE(precision, fp8_format, {"hybrid", "e4m3"})
    ST_CHOICE(precision, fp8_recipe, {"delayed", "current"})
    ST_CHOICE(precision, fp8_opt_level, {"", "O1", "O2", "O3"})
    ST_CHOICE(finetune, method, {"full", "lora", "qlora"})
    ST_CHOICE(finetune, init, {"kaiming", "gaussian"})
    ST_CHOICE(finetune, bias, {"none"})
#undef ST_CHOICE
    // clang-format on
    return t;
  }();
  return table;
}

void check_choice(const std::string& key, const std::string& value) {
  const auto& c = choices().at(key);
  if (std::find(c.values.begin(), c.values.end(), value) == c.values.end())
    throw UsageError(key + " must be one of " + join(c.values) + ", got '" + value + "'");
}

std::string show_int(int64_t v) { return std::to_string(v); }
// model.capacity_factor: dropless routing is the key left unset, so an
// explicit value must be a capacity.
double positive_capacity(const std::string& v) {
  const double x = to_double("model.capacity_factor", v);
  if (!(x > 0))
    throw UsageError("model.capacity_factor must be positive, got " + v + " (leave it unset for dropless routing)");
  return x;
}

std::string show_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
std::string show_bool(bool v) { return v ? "true" : "false"; }
std::string show_str(const std::string& v) { return v; }
// metrics.trace_steps: "N" or "FIRST,LAST" (a YAML list arrives joined by commas).
std::vector<int64_t> to_step_range(const std::string& key, const std::string& v) {
  std::vector<int64_t> steps;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) steps.push_back(to_int(key, item));
  if (steps.size() == 1) steps.push_back(steps[0]);
  if (steps.size() != 2 || steps[0] < 1 || steps[1] < steps[0])
    throw UsageError(key + " must be one step or a range [first, last] of steps counted from 1, got '" + v + "'");
  return steps;
}
std::string show_steps(const std::vector<int64_t>& s) {
  return s.empty() ? "" : std::to_string(s[0]) + "," + std::to_string(s[1]);
}
std::string checked_choice(const std::string& key, const std::string& v) {
  check_choice(key, v);
  return v;
}
// A row's type, named after the show function the row uses (config_key_table).
const char* shown_type(std::string (*)(int64_t)) { return "int"; }
const char* shown_type(std::string (*)(double)) { return "float"; }
const char* shown_type(std::string (*)(bool)) { return "bool"; }
const char* shown_type(std::string (*)(const std::string&)) { return "string"; }
const char* shown_type(std::string (*)(const std::vector<int64_t>&)) { return "steps"; }

// The table of keys: one entry per field. `section` may be nested (parallel.fsdp).
// It is one function of some 160 lines because it is a table: a row per key,
// which splitting by section would only scatter.
const std::map<std::string, Field>& fields() {
  static const std::map<std::string, Field> table = [] {
    std::map<std::string, Field> t;
    // One row per key, grouped by section.
    // clang-format off
#define ST_FIELD(section, name, parse, show)                                                      \
  t[#section "." #name] = Field{[](Config& c, const std::string& v) { c.section.name = parse; }, \
                                [](const Config& c) { return show(c.section.name); }, shown_type(show)};
#define ST_INT(section, name) ST_FIELD(section, name, to_int(#section "." #name, v), show_int)
#define ST_DBL(section, name) ST_FIELD(section, name, to_double(#section "." #name, v), show_double)
#define ST_BOOL(section, name) ST_FIELD(section, name, to_bool(#section "." #name, v), show_bool)
#define ST_STR(section, name) ST_FIELD(section, name, v, show_str)
#define ST_ENUM(section, name) ST_FIELD(section, name, checked_choice(#section "." #name, v), show_str)
    // model
    ST_STR(model, preset)
    ST_STR(model, config)
    ST_INT(model, n_layer)
    ST_INT(model, n_head)
    ST_INT(model, n_kv_head)
    ST_INT(model, intermediate_size)
    ST_INT(model, n_embd)
    ST_INT(model, block_size)
    ST_INT(model, vocab_size)
    ST_DBL(model, dropout)
    ST_INT(model, num_local_experts)
    ST_INT(model, num_experts_per_tok)
    ST_DBL(model, router_aux_loss_coef)
    ST_DBL(model, router_z_loss_coef)
    ST_FIELD(model, capacity_factor, positive_capacity(v), show_double)
    ST_ENUM(model, moe_drop_policy)
    ST_STR(model, init_from)
    ST_STR(model, library)
    ST_STR(model, library_args)
    ST_ENUM(model, activation_checkpointing)
    ST_ENUM(model, attention)
    ST_BOOL(model, fused)
    // data
    ST_STR(data, path)
    ST_STR(data, tokenizer)
    ST_STR(data, mixture)
    ST_ENUM(data, loss_on)
    ST_BOOL(data, packing)
    ST_ENUM(data, pack)
    ST_BOOL(data, position_reset)
    ST_INT(data, document_separator)
    // train
    ST_INT(train, steps)
    ST_INT(train, global_batch)
    ST_INT(train, micro_batch)
    ST_DBL(train, lr)
    ST_INT(train, warmup_steps)
    ST_DBL(train, min_lr_ratio)
    ST_DBL(train, weight_decay)
    ST_DBL(train, beta1)
    ST_DBL(train, beta2)
    ST_DBL(train, eps)
    ST_DBL(train, grad_clip)
    ST_INT(train, seed)
    ST_INT(train, sample_tokens)
    ST_STR(train, sample_prompt)
    ST_BOOL(train, sample_chat)
    ST_ENUM(train, lr_schedule)
    ST_ENUM(train, warmup_type)
    ST_DBL(train, warmup_start_ratio)
    ST_INT(train, stop_at)
    ST_STR(train, device)
    // parallel
    ST_ENUM(parallel, strategy)
    ST_INT(parallel, dp_replicate)
    ST_INT(parallel, dp_shard)
    ST_INT(parallel, tp)
    ST_INT(parallel, ep)
    ST_INT(parallel, cp)
    ST_ENUM(parallel, cp_mode)
    ST_INT(parallel, pp)
    ST_ENUM(parallel, schedule)
    ST_INT(parallel, microbatches)
    ST_INT(parallel, virtual_stages)
    ST_ENUM(parallel, pp_balance)
    ST_DBL(parallel, bucket_cap_mb)
    ST_DBL(parallel, first_bucket_mb)
    ST_DBL(parallel, last_bucket_mb)
    ST_BOOL(parallel, find_unused_parameters)
    ST_BOOL(parallel, sequence_parallel)
    ST_ENUM(parallel, comm_dtype)
    ST_ENUM(parallel, backend)
    ST_DBL(parallel, timeout_s)
    ST_BOOL(parallel, debug_collectives)
    // parallel.fsdp
    ST_ENUM(parallel.fsdp, sharding_strategy)
    ST_ENUM(parallel.fsdp, auto_wrap_policy)
    ST_STR(parallel.fsdp, transformer_layer_cls)
    ST_INT(parallel.fsdp, min_num_params)
    ST_ENUM(parallel.fsdp, backward_prefetch)
    ST_BOOL(parallel.fsdp, forward_prefetch)
    ST_BOOL(parallel.fsdp, limit_all_gathers)
    ST_BOOL(parallel.fsdp, offload_params)
    ST_BOOL(parallel.fsdp, sync_module_states)
    ST_BOOL(parallel.fsdp, cpu_ram_efficient_loading)
    ST_ENUM(parallel.fsdp, state_dict_type)
    // parallel.zero
    ST_DBL(parallel.zero, reduce_bucket_mb)
    ST_DBL(parallel.zero, allgather_bucket_mb)
    ST_BOOL(parallel.zero, overlap_comm)
    ST_BOOL(parallel.zero, contiguous_gradients)
    ST_BOOL(parallel.zero, reduce_scatter)
    ST_BOOL(parallel.zero, allgather_partitions)
    ST_ENUM(parallel.zero, offload_optimizer)
    ST_ENUM(parallel.zero, offload_param)
    ST_STR(parallel.zero, offload_dir)
    ST_BOOL(parallel.zero, offload_pin_memory)
    ST_DBL(parallel.zero, prefetch_bucket_mb)
    ST_INT(parallel.zero, max_live_parameters)
    // precision
    ST_ENUM(precision, mode)
    ST_ENUM(precision, param_dtype)
    ST_ENUM(precision, reduce_dtype)
    ST_ENUM(precision, buffer_dtype)
    ST_DBL(precision, loss_scale)
    ST_INT(precision, initial_scale_power)
    ST_INT(precision, loss_scale_window)
    ST_INT(precision, hysteresis)
    ST_DBL(precision, min_loss_scale)
    ST_BOOL(precision, scale_bf16)
    ST_BOOL(precision, fp8)
    ST_ENUM(precision, fp8_format)
    ST_ENUM(precision, fp8_recipe)
    ST_INT(precision, fp8_amax_history)
    ST_INT(precision, fp8_margin)
    ST_ENUM(precision, fp8_opt_level)
    // metrics
    ST_STR(metrics, path)
    ST_DBL(metrics, peak_flops)
    ST_INT(metrics, log_every)
    ST_BOOL(metrics, progress)
    ST_FIELD(metrics, trace_steps, v.empty() ? std::vector<int64_t>{} : to_step_range("metrics.trace_steps", v), show_steps)
    ST_STR(metrics, trace_dir)
    // checkpoint
    ST_STR(checkpoint, dir)
    ST_INT(checkpoint, every)
    ST_INT(checkpoint, keep)
    ST_STR(checkpoint, resume)
    ST_BOOL(checkpoint, async)
    // finetune
    ST_ENUM(finetune, method)
    ST_INT(finetune, r)
    ST_DBL(finetune, alpha)
    ST_BOOL(finetune, rslora)
    ST_DBL(finetune, dropout)
    ST_STR(finetune, target_modules)
    ST_ENUM(finetune, init)
    ST_ENUM(finetune, bias)
    ST_BOOL(finetune, double_quant)
    ST_STR(finetune, adapter_from)
#undef ST_FIELD
#undef ST_INT
#undef ST_DBL
#undef ST_BOOL
#undef ST_STR
#undef ST_ENUM
    // clang-format on
    return t;
  }();
  return table;
}

const char* const kSections =
    "(known: model, data, train, parallel, metrics, precision, checkpoint, finetune, and the keys of Accelerate config "
    "files)";

// True when some key starts with "prefix." (a section or sub-section).
bool is_section(const std::string& prefix) {
  for (auto& [k, s] : fields())
    if (k.compare(0, prefix.size() + 1, prefix + ".") == 0) return true;
  return false;
}

void set_key(Config& c, const std::string& key, const std::string& value) {
  auto it = fields().find(key);
  if (it == fields().end()) {
    // Name the keys of the innermost known (sub-)section: "parallel.fsdp", then "parallel".
    std::string section = key.substr(0, key.rfind('.'));
    while (!is_section(section) && section.find('.') != std::string::npos)
      section = section.substr(0, section.rfind('.'));
    std::string known;
    for (auto& [k, s] : fields())
      if (k.compare(0, section.size() + 1, section + ".") == 0) known += (known.empty() ? "" : ", ") + k;
    if (known.empty()) throw UsageError("unknown config section '" + section + "' " + kSections);
    throw UsageError("unknown config key '" + key + "' (known in " + section + ": " + known + ")");
  }
  it->second.set(c, value);
}

}  // namespace

void validate_config(const Config& c) {
  // Every problem at once, in one line (like make_plan, Note [One plan]).
  std::vector<std::string> problems;
  auto fail = [&](const std::string& problem) { problems.push_back(problem); };
  for (const auto& [key, choice] : choices()) {
    try {
      check_choice(key, choice.get(c));
    } catch (const UsageError& e) {
      fail(e.what());
    }
  }
  if (c.train.steps < 1) fail("train.steps must be at least 1");
  if (c.train.global_batch < 1 || c.train.micro_batch < 1)
    fail("train.global_batch and train.micro_batch must be at least 1");
  if (c.train.lr <= 0) fail("train.lr must be positive");
  if (c.train.eps <= 0) fail("train.eps must be positive");
  if (c.train.warmup_start_ratio < 0 || c.train.warmup_start_ratio > 1)
    fail("train.warmup_start_ratio must be in [0, 1]");
  if (c.parallel.bucket_cap_mb <= 0 || c.parallel.first_bucket_mb <= 0)
    fail("parallel.bucket_cap_mb and parallel.first_bucket_mb must be positive");
  if (c.parallel.last_bucket_mb < 0) fail("parallel.last_bucket_mb must be >= 0 (0 turns the small tail off)");
  if (c.parallel.timeout_s <= 0) fail("parallel.timeout_s must be positive");
  const auto& f = c.parallel.fsdp;
  if (f.min_num_params < 1) fail("parallel.fsdp.min_num_params must be at least 1");
  const auto& z = c.parallel.zero;
  if (z.reduce_bucket_mb <= 0 || z.allgather_bucket_mb <= 0 || z.prefetch_bucket_mb <= 0)
    fail("parallel.zero.reduce_bucket_mb, allgather_bucket_mb and prefetch_bucket_mb must be positive");
  if (z.max_live_parameters < 1) fail("parallel.zero.max_live_parameters must be at least 1");
  if ((z.offload_optimizer == "nvme" || z.offload_param == "nvme") && z.offload_dir.empty())
    fail("parallel.zero.offload_dir must be set when offloading to nvme");
  const auto& p = c.precision;
  if (p.loss_scale < 0) fail("precision.loss_scale must be 0 (dynamic) or positive");
  if (p.initial_scale_power < 0 || p.initial_scale_power > 62) fail("precision.initial_scale_power must be in [0, 62]");
  if (p.loss_scale_window < 1) fail("precision.loss_scale_window must be at least 1");
  if (p.hysteresis < 1) fail("precision.hysteresis must be at least 1");
  if (p.min_loss_scale <= 0) fail("precision.min_loss_scale must be positive");
  if (p.fp8_amax_history < 1) fail("precision.fp8_amax_history must be at least 1");
  if (p.fp8_margin < 0 || p.fp8_margin > 60) fail("precision.fp8_margin must be in [0, 60]");
  if (c.metrics.log_every < 1) fail("metrics.log_every must be at least 1");
  if (!c.metrics.trace_steps.empty() && c.metrics.trace_steps[1] > c.train.steps)
    fail("metrics.trace_steps ends at step " + std::to_string(c.metrics.trace_steps[1]) +
         ", after the run's last (train.steps " + std::to_string(c.train.steps) + ")");
  if (!c.metrics.trace_steps.empty() && c.metrics.trace_dir.empty()) fail("metrics.trace_dir must name a directory");
  if (c.train.stop_at < 0 || c.train.stop_at > c.train.steps) fail("train.stop_at must be in [0, train.steps]");
  if (c.checkpoint.every < 0) fail("checkpoint.every must be 0 (end of run only) or positive");
  if (c.checkpoint.keep < 0) fail("checkpoint.keep must be 0 (keep all) or positive");
  if (c.checkpoint.resume.empty()) fail("checkpoint.resume must be auto, never or a checkpoint path");
  if (c.finetune.r < 1) fail("finetune.r must be at least 1");
  if (!(c.finetune.alpha > 0) || !std::isfinite(c.finetune.alpha)) fail("finetune.alpha must be a positive number");
  if (!(c.finetune.dropout >= 0 && c.finetune.dropout < 1)) fail("finetune.dropout must be in [0, 1)");
  // AdamW's and the schedule's ranges (NaN fails every comparison, so `!(in range)`).
  const auto& t = c.train;
  const auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  if (!(t.beta1 >= 0 && t.beta1 < 1)) fail("train.beta1 must be in [0, 1), got " + num(t.beta1));
  if (!(t.beta2 >= 0 && t.beta2 < 1)) fail("train.beta2 must be in [0, 1), got " + num(t.beta2));
  if (!(t.weight_decay >= 0)) fail("train.weight_decay must be >= 0, got " + num(t.weight_decay));
  if (!(t.grad_clip >= 0)) fail("train.grad_clip must be >= 0 (0: no clipping), got " + num(t.grad_clip));
  if (!(t.min_lr_ratio >= 0 && t.min_lr_ratio <= 1))
    fail("train.min_lr_ratio must be in [0, 1], got " + num(t.min_lr_ratio));
  if (t.warmup_steps < 0) fail("train.warmup_steps must be >= 0, got " + std::to_string(t.warmup_steps));
  if (t.sample_tokens < 0)
    fail("train.sample_tokens must be >= 0 (0: no sample), got " + std::to_string(t.sample_tokens));
  if (!problems.empty()) throw UsageError(join_problems(problems));
}

std::string config_value(const Config& config, const std::string& key) {
  auto it = fields().find(key);
  if (it == fields().end()) throw std::invalid_argument("config_value: unknown key " + key);
  return it->second.get(config);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> keys;
  for (auto& [k, s] : fields()) keys.push_back(k);
  return keys;
}

std::vector<ConfigKeyInfo> config_key_table() {
  const Config defaults;
  std::vector<ConfigKeyInfo> rows;
  for (const auto& [key, field] : fields()) {
    ConfigKeyInfo row{key, field.type, field.get(defaults), {}};
    if (auto c = choices().find(key); c != choices().end()) {
      row.type = "choice";
      row.choices = c->second.values;
    }
    // The shortest text that reads back as the same double (0.95, not 0.94999999999999996).
    if (row.type == "float") {
      const double v = std::strtod(row.default_value.c_str(), nullptr);
      char buf[32];
      for (int digits = 1; digits <= 17; ++digits) {
        std::snprintf(buf, sizeof buf, "%.*g", digits, v);
        if (std::strtod(buf, nullptr) == v) break;
      }
      if (std::strchr(buf, 'e') && v == std::floor(v) && std::fabs(v) < 1e15) std::snprintf(buf, sizeof buf, "%.0f", v);
      row.default_value = buf;
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

bool is_config_section(const std::string& prefix) { return is_section(prefix); }

bool is_config_key(const std::string& key) { return fields().count(key) > 0; }

void set_config_key(Config& config, const std::string& key, const std::string& value) { set_key(config, key, value); }

std::string unknown_section(const std::string& name) { return "unknown config section '" + name + "' " + kSections; }

void apply_override(Config& config, const std::string& assignment) {
  std::string a = assignment;
  if (a.rfind("--", 0) == 0) a = a.substr(2);
  auto eq = a.find('=');
  if (eq == std::string::npos || a.find('.') > eq)
    throw UsageError("override '" + assignment + "' is not of the form --section.key=value");
  set_key(config, a.substr(0, eq), a.substr(eq + 1));
}

}  // namespace scaletrain::config

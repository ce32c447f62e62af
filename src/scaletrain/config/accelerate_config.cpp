#include "scaletrain/config/accelerate_config.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "scaletrain/config/config_values.h"
#include "scaletrain/config/deepspeed_config.h"
#include "scaletrain/models/hf_names.h"
#include "scaletrain/util/error.h"

// Note [Accelerate keys]
// A file written by `accelerate config` runs unedited. Its top-level keys:
// - Training keys. `mixed_precision` (no | bf16 | fp16) sets precision.mode;
//   fp8 sets precision.fp8=true with bf16 autocast for everything that is
//   not an FP8 linear. fp8_config maps backend TE (FP8 linears) or MSAMP
//   (with opt_level, default O2: precision.fp8_opt_level), fp8_format
//   HYBRID | E4M3, amax_history_len and margin onto precision.fp8_*; the
//   values our recipe has (amax_compute_algo max, interval 1,
//   use_autocast_during_eval false) are accepted, others are errors.
//   `distributed_type`: NO and MULTI_CPU imply parallel.strategy=ddp; the
//   device kinds (MULTI_GPU, MULTI_NPU, MULTI_XPU, ...) imply ddp too, with a
//   notice that this CPU build runs CPU processes; FSDP (or an `fsdp_config`
//   section) implies fsdp; DEEPSPEED takes `deepspeed_config`; XLA, TPU and
//   MEGATRON_LM are errors. An explicit parallel.strategy or precision.mode
//   that disagrees is an error. Explicit parallel.fsdp.* keys and overrides
//   win over fsdp_config.
// - fsdp_config: fsdp_* keys map onto parallel.fsdp.* (older Accelerate wrote
//   the sharding strategy as 1..4, PyTorch's ShardingStrategy values; 5,
//   HYBRID_SHARD_ZERO2, has no equivalent). fsdp_activation_checkpointing
//   true sets model.activation_checkpointing=full. fsdp_use_orig_params: our
//   FSDP engine keeps the original parameters visible to the optimizer (the
//   flat shard is a view of them, and AdamW decays matrices only, per
//   original parameter): that is use_orig_params=true; false, PyTorch's
//   optimizer-over-flat-parameters mode, is accepted with a notice that the
//   optimizer sees the original parameters anyway.
//   fsdp_transformer_layer_cls_to_wrap names a Hugging Face class of a family
//   this build has (models/hf_names.h).
// - deepspeed_config: zero_stage, offload_*_device, offload_*_nvme_path,
//   gradient_accumulation_steps, gradient_clipping and zero3_save_16bit_model
//   become the DeepSpeed JSON Accelerate would build, with bf16/fp16 from
//   mixed_precision, applied by config/deepspeed_config.cpp once the
//   data-parallel size is known; or deepspeed_config_file names a DeepSpeed
//   JSON (relative to the working directory, else to this file), which then
//   excludes the other keys, as in Accelerate. zero3_init_flag false gets a
//   notice: ZeRO-3 here always builds the model shard by shard.
// - Launcher keys (num_processes, num_machines, machine_rank,
//   main_process_ip, main_process_port, rdzv_backend, same_network) are read
//   by `scaletrain launch --config_file`; `scaletrain train` accepts them
//   with one notice (its world comes from the environment the launcher set).
// - Keys about devices, Python or other launchers (use_cpu false, gpu_ids,
//   downcast_bf16, tpu_*, commands, command_file, enable_cpu_affinity,
//   dynamo_config, ipex_config, mpirun_config, main_training_function other
//   than main, debug) are accepted with one notice each when their value asks
//   for something; null, false, "no", empty lists and maps ask for nothing.
//   megatron_lm_config, tp_config and parallelism_config with content are
//   errors (use parallel.tp / parallel.pp). Any other key is an
//   error; all of a file's unknown keys are named in one error.

namespace scaletrain::config {
namespace {

const std::vector<std::string> kLauncherKeys = {"num_processes",     "num_machines", "machine_rank", "main_process_ip",
                                                "main_process_port", "rdzv_backend", "same_network"};

// Accepted, no effect on this build; why, per key.
const std::map<std::string, std::string>& inert_keys() {
  static const std::map<std::string, std::string> t = {
      {"use_cpu", "this build computes on CPU"},
      {"gpu_ids", "a CPU build has no GPUs to choose"},
      {"downcast_bf16", "a TPU setting"},
      {"tpu_name", "a TPU setting"},
      {"tpu_zone", "a TPU setting"},
      {"tpu_use_cluster", "a TPU setting"},
      {"tpu_use_sudo", "a TPU setting"},
      {"tpu_vm", "a TPU setting"},
      {"tpu_env", "a TPU setting"},
      {"commands", "a TPU-pod setting"},
      {"command_file", "a TPU-pod setting"},
      {"enable_cpu_affinity", "threads per rank are set by `scaletrain launch --threads`; ranks are not pinned"},
      {"dynamo_config", "libtorch's C++ API has no torch.compile"},
      {"dynamo_backend", "libtorch's C++ API has no torch.compile"},
      {"ipex_config", "Intel Extension for PyTorch is not used"},
      {"mpirun_config", "workers are started by `scaletrain launch`, not mpirun"},
      {"main_training_function", "`scaletrain train` is the training program"},
      {"debug", "collective shapes are not cross-checked; see parallel.timeout_s for hangs"},
  };
  return t;
}

// Keys that configure parallelism we express differently: content is an error.
const std::map<std::string, std::string>& refused_sections() {
  static const std::map<std::string, std::string> t = {
      {"megatron_lm_config", "use parallel.tp, parallel.pp and parallel.sequence_parallel"},
      {"tp_config", "use parallel.tp"},
      {"parallelism_config", "use parallel.dp_replicate, dp_shard, tp and pp"},
  };
  return t;
}

// A value that asks for nothing: null, false, "no"/"NO", empty, or main_training_function "main".
bool inert_value(const std::string& name, const YAML::Node& v) {
  if (!v || v.IsNull()) return true;
  if ((v.IsMap() || v.IsSequence()) && v.size() == 0) return true;
  if (v.IsScalar()) {
    const std::string& s = v.Scalar();
    if (name == "use_cpu") return s == "true" || s == "True";  // true is what this build does; false asks for a GPU
    if (s == "false" || s == "False" || s == "no" || s == "NO" || s == "null" || s.empty()) return true;
    if (name == "main_training_function" && s == "main") return true;
  }
  return false;
}

std::string dump(const YAML::Node& v) {
  YAML::Emitter e;
  e.SetMapFormat(YAML::Flow);
  e.SetSeqFormat(YAML::Flow);
  e << v;
  return e.c_str();
}

std::string scalar(const std::string& key, const YAML::Node& v) {
  if (!v.IsScalar()) throw UsageError(key + " must be a single value");
  return v.Scalar();
}

std::string map_value(const std::string& key, const std::string& v,
                      const std::vector<std::pair<std::string, std::string>>& table) {
  std::vector<std::string> accepted;
  for (const auto& [from, to] : table) {
    if (v == from) return to;
    accepted.push_back(from);
  }
  throw UsageError(key + " must be one of " + join(accepted) + ", got '" + v + "'");
}

// fp8_config (Accelerate's FP8 recipe) as precision.fp8* keys: Note [FP8 linears].
void read_fp8_config(AccelerateSettings& out, const YAML::Node& section) {
  if (section.IsNull()) return;
  if (!section.IsMap()) throw UsageError("fp8_config must be a map of keys");
  std::string backend = "TE";
  for (const auto& kv : section) {
    const std::string name = kv.first.as<std::string>(), key = "fp8_config." + name;
    const std::string v = scalar(key, kv.second);
    if (name == "backend") {
      backend = map_value(key, v, {{"TE", "TE"}, {"te", "TE"}, {"MSAMP", "MSAMP"}, {"msamp", "MSAMP"}});
    } else if (name == "opt_level") {
      out.fp8["precision.fp8_opt_level"] = map_value(key, v, {{"O1", "O1"}, {"O2", "O2"}, {"O3", "O3"}});
    } else if (name == "fp8_format") {
      out.fp8["precision.fp8_format"] = map_value(key, v, {{"HYBRID", "hybrid"}, {"E4M3", "e4m3"}});
    } else if (name == "amax_history_len") {
      out.fp8["precision.fp8_amax_history"] = v;
    } else if (name == "margin") {
      out.fp8["precision.fp8_margin"] = v;
    } else if (name == "amax_compute_algo") {
      map_value(key, v, {{"max", "max"}});  // the largest amax of the history is what delayed scaling takes
    } else if (name == "interval") {
      map_value(key, v, {{"1", "1"}});  // scales are updated every step
    } else if (name == "use_autocast_during_eval") {
      if (to_bool(key, v)) throw UsageError(key + "=true: there is no evaluation pass here");
    } else {
      throw UsageError("unknown fp8_config key '" + name +
                       "' (known: backend, opt_level, fp8_format, "
                       "amax_history_len, amax_compute_algo, margin, interval, use_autocast_during_eval)");
    }
  }
  if (backend == "MSAMP" && !out.fp8.count("precision.fp8_opt_level")) out.fp8["precision.fp8_opt_level"] = "O2";
  if (backend != "MSAMP" && out.fp8.count("precision.fp8_opt_level"))
    throw UsageError("fp8_config.opt_level applies to backend MSAMP, not " + backend);
  out.fp8_config = true;
}

void set_fsdp_key(Config& c, const std::string& name, const std::string& v, const std::string& file) {
  const std::string key = "fsdp_config." + name;
  auto& f = c.parallel.fsdp;
  if (name == "fsdp_sharding_strategy")
    f.sharding_strategy = map_value(key, v,
                                    {{"FULL_SHARD", "FULL_SHARD"},
                                     {"SHARD_GRAD_OP", "SHARD_GRAD_OP"},
                                     {"NO_SHARD", "NO_SHARD"},
                                     {"HYBRID_SHARD", "HYBRID_SHARD"},
                                     {"1", "FULL_SHARD"},
                                     {"2", "SHARD_GRAD_OP"},
                                     {"3", "NO_SHARD"},
                                     {"4", "HYBRID_SHARD"}});
  else if (name == "fsdp_auto_wrap_policy")
    f.auto_wrap_policy = map_value(
        key, v, {{"TRANSFORMER_BASED_WRAP", "transformer"}, {"SIZE_BASED_WRAP", "size"}, {"NO_WRAP", "none"}});
  else if (name == "fsdp_transformer_layer_cls_to_wrap")
    f.transformer_layer_cls = models::block_class_from_hf(key, v);
  else if (name == "fsdp_min_num_params")
    f.min_num_params = to_int(key, v);
  else if (name == "fsdp_backward_prefetch")
    f.backward_prefetch = map_value(
        key, v, {{"BACKWARD_PRE", "BACKWARD_PRE"}, {"BACKWARD_POST", "BACKWARD_POST"}, {"NO_PREFETCH", "NONE"}});
  else if (name == "fsdp_forward_prefetch")
    f.forward_prefetch = to_bool(key, v);
  else if (name == "fsdp_offload_params")
    f.offload_params = to_bool(key, v);
  else if (name == "fsdp_sync_module_states")
    f.sync_module_states = to_bool(key, v);
  else if (name == "fsdp_cpu_ram_efficient_loading")
    f.cpu_ram_efficient_loading = to_bool(key, v);
  else if (name == "fsdp_state_dict_type")
    f.state_dict_type =
        map_value(key, v, {{"FULL_STATE_DICT", "FULL_STATE_DICT"}, {"SHARDED_STATE_DICT", "SHARDED_STATE_DICT"}});
  else if (name == "fsdp_activation_checkpointing") {
    if (to_bool(key, v)) c.model.activation_checkpointing = "full";
  } else if (name == "fsdp_version") {
    // FSDP2 shards per parameter (DTensor) where FSDP1 shards flat buffers;
    // what is sharded, gathered and reduced is the same, so both run on this
    // build's flat-buffer engine.
    const int64_t version = to_int(key, v);
    if (version != 1 && version != 2) throw UsageError(key + " must be 1 or 2, got " + v);
    if (version == 2)
      c.notices.push_back(file + ": " + key +
                          "=2 runs on this build's flat-parameter FSDP (same sharding, gathers and reduce-scatters)");
  } else if (name == "fsdp_reshard_after_forward") {
    // FSDP2's spelling of the choice between FULL_SHARD and SHARD_GRAD_OP.
    f.sharding_strategy = to_bool(key, v) ? "FULL_SHARD" : "SHARD_GRAD_OP";
  } else if (name == "fsdp_use_orig_params") {
    if (!to_bool(key, v))
      c.notices.push_back(file + ": " + key +
                          "=false has no effect on this build (the optimizer always sees the original parameters, "
                          "as with true)");
  } else
    throw UsageError("unknown config key '" + key +
                     "' (known in fsdp_config: fsdp_sharding_strategy, fsdp_auto_wrap_policy, "
                     "fsdp_transformer_layer_cls_to_wrap, fsdp_min_num_params, fsdp_backward_prefetch, "
                     "fsdp_forward_prefetch, fsdp_offload_params, fsdp_sync_module_states, "
                     "fsdp_cpu_ram_efficient_loading, fsdp_state_dict_type, fsdp_activation_checkpointing, "
                     "fsdp_use_orig_params, fsdp_version, fsdp_reshard_after_forward)");
}

// A YAML scalar as JSON: numbers stay numbers (gradient_clipping: 1.0).
nlohmann::json json_scalar(const std::string& key, const std::string& v, bool integer) {
  if (v == "auto") return v;
  if (integer) return to_int(key, v);
  return to_double(key, v);
}

// deepspeed_config: Accelerate's DeepSpeed plugin keys, translated.
void read_deepspeed_section(Config& c, AccelerateSettings& out, const YAML::Node& section, const std::string& file) {
  nlohmann::json ds = nlohmann::json::object();
  nlohmann::json zero = nlohmann::json::object();
  std::vector<std::string> plugin_keys;  // the keys deepspeed_config_file excludes
  std::vector<std::string> problems;
  std::string ds_file;
  int64_t stage = -1;
  std::optional<bool> init_flag;
  for (const auto& kv : section) {
    const std::string name = kv.first.as<std::string>();
    const std::string key = "deepspeed_config." + name;
    try {
      if (name == "deepspeed_config_file") {
        ds_file = scalar(key, kv.second);
        continue;
      }
      if (name == "deepspeed_multinode_launcher" || name == "deepspeed_hostfile" ||
          name == "deepspeed_exclusion_filter" || name == "deepspeed_inclusion_filter" ||
          name == "deepspeed_moe_layer_cls_names") {
        const bool inert =
            inert_value(name, kv.second) || (name == "deepspeed_multinode_launcher" && kv.second.IsScalar() &&
                                             kv.second.Scalar() == "standard");  // standard: torchrun-style, as ours
        if (!inert)
          c.notices.push_back(file + ": " + key + "=" + dump(kv.second) +
                              " has no effect on this build (workers are started by `scaletrain launch`)");
        continue;
      }
      plugin_keys.push_back(name);
      const std::string v = scalar(key, kv.second);
      if (name == "zero_stage") {
        stage = to_int(key, v);
        zero["stage"] = stage;
      } else if (name == "offload_optimizer_device" || name == "offload_param_device") {
        zero[name == "offload_param_device" ? "offload_param" : "offload_optimizer"]["device"] = v;
      } else if (name == "offload_optimizer_nvme_path" || name == "offload_param_nvme_path") {
        zero[name == "offload_param_nvme_path" ? "offload_param" : "offload_optimizer"]["nvme_path"] = v;
      } else if (name == "gradient_accumulation_steps") {
        ds[name] = json_scalar(key, v, true);
      } else if (name == "gradient_clipping") {
        ds[name] = json_scalar(key, v, false);
      } else if (name == "zero3_save_16bit_model") {
        zero["stage3_gather_16bit_weights_on_model_save"] = to_bool(key, v);
      } else if (name == "zero3_init_flag") {
        init_flag = to_bool(key, v);
      } else {
        throw UsageError("unknown config key '" + key +
                         "' (known in deepspeed_config: zero_stage, offload_optimizer_device, offload_param_device, "
                         "offload_optimizer_nvme_path, offload_param_nvme_path, gradient_accumulation_steps, "
                         "gradient_clipping, zero3_init_flag, zero3_save_16bit_model, deepspeed_config_file, "
                         "deepspeed_multinode_launcher, deepspeed_hostfile, deepspeed_exclusion_filter, "
                         "deepspeed_inclusion_filter, deepspeed_moe_layer_cls_names)");
      }
    } catch (const UsageError& e) {
      problems.push_back(e.what());
    }
  }
  if (!problems.empty()) throw UsageError(join_problems(problems));
  if (!ds_file.empty()) {
    if (!plugin_keys.empty()) {
      std::string list;
      for (const auto& k : plugin_keys) list += (list.empty() ? "" : ", ") + k;
      throw UsageError("deepspeed_config.deepspeed_config_file excludes deepspeed_config." + list +
                       " (set them in the DeepSpeed file)");
    }
    namespace fs = std::filesystem;
    fs::path p(ds_file);
    if (p.is_relative() && !fs::exists(p)) p = fs::path(file).parent_path() / p;
    out.deepspeed_file = p.string();
    return;
  }
  if (init_flag && !*init_flag && stage == 3)
    c.notices.push_back(file +
                        ": deepspeed_config.zero3_init_flag=false has no effect on this build (ZeRO-3 "
                        "always builds the model shard by shard)");
  if (!zero.empty()) ds["zero_optimization"] = zero;
  out.deepspeed = ds;
}

}  // namespace

bool is_accelerate_key(const std::string& name) {
  static const std::set<std::string> keys = {"compute_environment", "distributed_type", "mixed_precision",
                                             "fsdp_config",         "deepspeed_config", "fp16",
                                             "fp8_config"};
  return keys.count(name) || inert_keys().count(name) || refused_sections().count(name) ||
         std::find(kLauncherKeys.begin(), kLauncherKeys.end(), name) != kLauncherKeys.end();
}

void read_accelerate_key(Config& c, AccelerateSettings& out, const std::string& name, const YAML::Node& value,
                         const std::string& file) {
  out.file = file;
  if (name == "mixed_precision") {
    // fp8: FP8 linears, and bf16 autocast for everything else (what Accelerate runs FP8 recipes under).
    out.mixed_precision = map_value("mixed_precision", scalar(name, value),
                                    {{"no", "fp32"}, {"bf16", "bf16"}, {"fp16", "fp16"}, {"fp8", "bf16"}});
    if (scalar(name, value) == "fp8") out.fp8["precision.fp8"] = "true";
  } else if (name == "fp8_config") {
    read_fp8_config(out, value);
  } else if (name == "fp16") {  // Accelerate's old spelling of mixed_precision: fp16
    if (to_bool(name, scalar(name, value))) out.mixed_precision = "fp16";
  } else if (name == "compute_environment") {
    map_value(name, scalar(name, value), {{"LOCAL_MACHINE", ""}});
  } else if (name == "distributed_type") {
    const std::string v = scalar(name, value);
    std::string strategy;
    if (v == "NO" || v == "MULTI_CPU") {
      strategy = "ddp";
    } else if (v == "FSDP") {
      strategy = "fsdp";
    } else if (v == "DEEPSPEED") {
      strategy = "";  // from deepspeed_config (zero_stage)
    } else if (v == "MULTI_GPU" || v == "MULTI_NPU" || v == "MULTI_XPU" || v == "MULTI_MLU" || v == "MULTI_MUSA" ||
               v == "MULTI_SDAA" || v == "MULTI_HPU") {
      strategy = "ddp";
      c.notices.push_back(file + ": distributed_type=" + v +
                          " runs as data parallelism over CPU processes (a CPU build has no accelerators)");
    } else {
      throw UsageError("distributed_type " + v +
                       " is not supported (supported: NO, MULTI_CPU, MULTI_GPU and kin, FSDP, DEEPSPEED)");
    }
    if (!strategy.empty() && out.strategy.empty()) out.strategy = strategy, out.implied_by = "distributed_type " + v;
    if (strategy == "ddp" && out.implied_by == "fsdp_config")
      throw UsageError("distributed_type " + v + " disagrees with the fsdp_config section");
  } else if (name == "fsdp_config") {
    if (!value.IsMap() && !value.IsNull()) throw UsageError("fsdp_config must be a map of keys");
    if (value.IsMap() && value.size() > 0) {
      std::vector<std::string> problems;
      for (const auto& kv : value) {
        const std::string key = kv.first.as<std::string>();
        try {
          set_fsdp_key(c, key, scalar("fsdp_config." + key, kv.second), file);
        } catch (const UsageError& e) {
          problems.push_back(e.what());
        }
      }
      if (!problems.empty()) throw UsageError(join_problems(problems));
      if (out.strategy == "ddp") throw UsageError("the fsdp_config section disagrees with " + out.implied_by);
      out.strategy = "fsdp", out.implied_by = "fsdp_config";
    }
  } else if (name == "deepspeed_config") {
    if (!value.IsMap() && !value.IsNull()) throw UsageError("deepspeed_config must be a map of keys");
    if (value.IsMap() && value.size() > 0) read_deepspeed_section(c, out, value, file);
  } else if (std::find(kLauncherKeys.begin(), kLauncherKeys.end(), name) != kLauncherKeys.end()) {
    out.launcher.push_back(name);
  } else if (auto r = refused_sections().find(name); r != refused_sections().end()) {
    if (!inert_value(name, value)) throw UsageError(name + " is not supported here: " + r->second);
  } else if (auto i = inert_keys().find(name); i != inert_keys().end()) {
    if (!inert_value(name, value))
      c.notices.push_back(file + ": " + name + "=" + dump(value) + " has no effect on this build (" + i->second + ")");
  } else {
    throw UsageError("unknown Accelerate key '" + name + "'");
  }
}

void finish_accelerate(Config& c, const AccelerateSettings& s, const std::set<std::string>& given,
                       const ModelWidth& model_width) {
  if (s.file.empty()) return;
  const bool deepspeed = !s.deepspeed.is_null() || !s.deepspeed_file.empty();
  if (!s.strategy.empty() && !deepspeed) {
    if (given.count("parallel.strategy") && c.parallel.strategy != s.strategy)
      throw UsageError(s.implied_by + " implies parallel.strategy=" + s.strategy + ", but parallel.strategy is '" +
                       c.parallel.strategy + "'");
    c.parallel.strategy = s.strategy;
  }
  if (!s.mixed_precision.empty()) {
    if (given.count("precision.mode") && c.precision.mode != s.mixed_precision)
      throw UsageError("mixed_precision implies precision.mode=" + s.mixed_precision + ", but precision.mode is '" +
                       c.precision.mode + "'");
    c.precision.mode = s.mixed_precision;
  }
  if (s.fp8_config && !s.fp8.count("precision.fp8"))
    throw UsageError("fp8_config applies to mixed_precision: fp8, which " + s.file + " does not set");
  for (const auto& [key, value] : s.fp8) {
    if (given.count(key) && config_value(c, key) != value)
      throw UsageError(s.file + " implies " + key + "=" + value + ", but " + key + " is '" + config_value(c, key) +
                       "'");
    if (!given.count(key)) apply_override(c, key + "=" + value);
  }
  if (!s.launcher.empty()) {
    std::string list;
    for (const auto& k : s.launcher) list += (list.empty() ? "" : ", ") + k;
    c.notices.push_back(s.file + ": " + list +
                        " are launcher settings, read by `scaletrain launch --config_file`; this process takes its "
                        "world from the environment");
  }
  const int dp = deepspeed ? deepspeed_data_parallel_size(c) : 1;
  if (!s.deepspeed_file.empty()) apply_deepspeed_config(c, s.deepspeed_file, dp, model_width);
  if (!s.deepspeed.is_null()) {
    nlohmann::json ds = s.deepspeed;
    // Accelerate fills the DeepSpeed precision section from mixed_precision.
    if (c.precision.mode == "bf16") ds["bf16"] = {{"enabled", true}};
    if (c.precision.mode == "fp16") ds["fp16"] = {{"enabled", true}};
    apply_deepspeed_json(c, ds, s.file + " (deepspeed_config)", dp, model_width);
  }
}

AccelerateLaunch read_accelerate_launch(const std::string& path) {
  const YAML::Node root = read_yaml_file(path);
  AccelerateLaunch l;
  if (!root.IsMap()) return l;
  auto get = [&](const char* key) -> std::string {
    const YAML::Node v = root[key];
    if (!v || v.IsNull()) return "";
    if (!v.IsScalar()) throw UsageError(path + ": " + key + " must be a single value");
    return v.Scalar();
  };
  try {
    if (auto v = get("num_processes"); !v.empty()) l.num_processes = static_cast<int>(to_int("num_processes", v));
    if (auto v = get("num_machines"); !v.empty()) l.num_machines = static_cast<int>(to_int("num_machines", v));
    if (auto v = get("machine_rank"); !v.empty()) l.machine_rank = static_cast<int>(to_int("machine_rank", v));
    l.main_process_ip = get("main_process_ip");
    if (auto v = get("main_process_port"); !v.empty())
      l.main_process_port = static_cast<int>(to_int("main_process_port", v));
  } catch (const UsageError& e) {
    throw UsageError(path + ": " + e.what());
  }
  if (l.num_machines < 1) throw UsageError(path + ": num_machines must be at least 1");
  if (l.num_processes < 1 || l.num_processes % l.num_machines != 0)
    throw UsageError(
        path + ": num_processes=" + std::to_string(l.num_processes) +
        " (over all machines) must be a positive multiple of num_machines=" + std::to_string(l.num_machines));
  if (const auto rdzv = get("rdzv_backend"); !rdzv.empty() && rdzv != "static")
    l.notes.push_back(path + ": rdzv_backend=" + rdzv +
                      " has no effect (scaletrain launch always meets at main_process_ip:main_process_port, "
                      "as static does)");
  if (const auto same = get("same_network"); !same.empty() && !to_bool("same_network", same))
    l.notes.push_back(path + ": same_network=false has no effect (the rendezvous address is main_process_ip)");
  return l;
}

}  // namespace scaletrain::config

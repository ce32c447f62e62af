#include "scaletrain/config/deepspeed_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "scaletrain/comm/env.h"

#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

// Note [DeepSpeed mapping]
// - Every key is mapped onto a Config field, or accepted with one start-up
//   notice (Config::notices) saying it has no effect on this build, or is an
//   error. All unknown keys of a file are named in one error ("file: unknown
//   keys 'a' (known in zero_optimization: ...), 'b' (...)"). Nothing else is
//   ignored.
// - Accepted with a notice (no effect here): stage3_param_persistence_threshold
//   (every parameter is sharded), stage3_max_reuse_distance, sub_group_size
//   (each rank steps its whole shard), stage3_gather_16bit_weights_on_model_save
//   and its older fp16 spelling (checkpoints are sharded),
//   zero_allow_untested_optimizer (only AdamW is accepted anyway),
//   wall_clock_breakdown, the aio section and the offload tuning keys
//   (pin_memory, buffer_count, buffer_size, max_in_cpu, pipeline_read,
//   pipeline_write, fast_init, ratio). A boolean that is false asks for
//   nothing and gets no notice. Keys of a disabled offload section (device
//   none) are accepted without notice, and its nvme_path is not compared with
//   the other section's. optimizer.params.torch_adam picks PyTorch's Adam
//   kernel over DeepSpeed's fused one (same arithmetic): type-checked only.
// - offload_optimizer / offload_param device cpu or nvme set
//   parallel.zero.offload_optimizer / offload_param (on a CPU device the plan
//   says at start that host and device are one memory there). DeepSpeed's
//   pin_memory never sets parallel.zero.offload_pin_memory (refused on a CPU
//   run; set it in our config on a GPU run).
// - activation_checkpointing: the section's presence turns block-level
//   recomputation on (model.activation_checkpointing=full), as Megatron-style
//   models configured by it checkpoint each layer; its keys
//   (partition_activations, cpu_checkpointing, contiguous_memory_optimization,
//   synchronize_checkpoint_boundary, profile, number_checkpoints) tune
//   DeepSpeed's own implementation and get a notice when set.
// - "auto" resolves from our own config, as the Hugging Face trainer does:
//   reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 x hidden^2,
//   stage3_param_persistence_threshold = 10 x hidden (hidden = model width,
//   asked of the reader's ModelWidth only when one of these is "auto":
//   train/plan/config.h's readers resolve the model for it);
//   batch sizes from train.global_batch / micro_batch; gradient_clipping from
//   train.grad_clip; lr, betas, eps, weight_decay from train.*; the
//   scheduler's warmup_max_lr = train.lr, warmup_min_lr = 0,
//   warmup_num_steps = train.warmup_steps, total_num_steps = train.steps;
//   fp16/bf16 enabled = whether precision.mode is that dtype.
// - Explicit values win over the YAML config and over --section.key overrides.
// - Absent keys: where DeepSpeed's default changes the arithmetic (optimizer
//   hyper-parameters, scheduler parameters, fp16 loss scaling) DeepSpeed's
//   default applies once its section is present; performance knobs (bucket
//   sizes, overlap) and absent sections keep the YAML's values.
// - Sizes: DeepSpeed counts bucket sizes in elements, we in MiB. An element is
//   2 bytes when bf16 or fp16 is enabled, else 4.
// - Batch sizes: DeepSpeed's rule train_batch_size = micro x accumulation x dp.
//   Three explicit values must agree; two determine the third; with fewer,
//   the missing ones come from the YAML (train.micro_batch, then
//   train.global_batch). The result sets train.global_batch and
//   train.micro_batch (the accumulation is implied by them).
// - Schedulers map onto train.lr_schedule: WarmupLR -> constant after warmup
//   at warmup_max_lr; WarmupDecayLR -> linear decay to warmup_min_lr at
//   total_num_steps; WarmupCosineLR -> cosine decay to cos_min_ratio x lr.
//   total_num_steps sets train.steps. Our ramp counts from step + 1 (see
//   optim::lr_at), DeepSpeed's from step: the same curve shifted by one step.
// - Optimizer: only AdamW. "AdamW", or "Adam" whose adam_w_mode is true
//   (DeepSpeed's default), is AdamW; "Adam" with adam_w_mode false (L2
//   regularised Adam) and any other type is an error.

namespace scaletrain::config {
namespace {

using nlohmann::json;

class Reader {
 public:
  Reader(std::string file, std::vector<std::string>* notices) : file_(std::move(file)), notices_(notices) {}

  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw UsageError(file_ + ": " + key + (msg.rfind('=', 0) == 0 ? "" : " ") + msg);
  }

  // Records the keys of `obj` outside `known` (finish() reports them all);
  // `prefix` names obj ("" = top level).
  void check_keys(const json& obj, const std::string& prefix, const std::set<std::string>& known) const {
    if (!obj.is_object()) fail(prefix.empty() ? "the top level" : prefix, "must be an object");
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      if (known.count(it.key())) continue;
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      unknown_.push_back("'" + name(prefix, it.key()) + "' (known" + (prefix.empty() ? "" : " in " + prefix) + ": " +
                         list + ")");
    }
  }

  // One error naming every unknown key met so far.
  void finish() const {
    if (unknown_.empty()) return;
    std::string all;
    for (const auto& u : unknown_) all += (all.empty() ? "" : ", ") + u;
    throw UsageError(file_ + ": unknown key" + (unknown_.size() > 1 ? "s " : " ") + all);
  }

  // A start-up line: `key` (with its value) is accepted and has no effect here.
  void notice(const std::string& key, const json& value, const std::string& why) const {
    notices_->push_back(file_ + ": " + key + "=" + value.dump() + " has no effect on this build (" + why + ")");
  }
  void note(const std::string& line) const { notices_->push_back(file_ + ": " + line); }

  static std::string name(const std::string& prefix, const std::string& key) {
    return prefix.empty() ? key : prefix + "." + key;
  }
  static bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }
  // A key present with a value that asks for something (not false, not null).
  static bool asks(const json& obj, const std::string& key) {
    return obj.contains(key) && !obj[key].is_null() && !(obj[key].is_boolean() && !obj[key].get<bool>());
  }

  // Typed getters: nullopt when the key is absent or "auto".
  std::optional<double> number(const json& obj, const std::string& prefix, const std::string& key) const {
    if (!obj.contains(key) || is_auto(obj[key])) return std::nullopt;
    if (!obj[key].is_number()) fail(name(prefix, key), "must be a number, got " + obj[key].dump());
    return obj[key].get<double>();
  }
  std::optional<int64_t> integer(const json& obj, const std::string& prefix, const std::string& key) const {
    auto d = number(obj, prefix, key);  // DeepSpeed configs write counts as 5e8 too
    if (d && (*d != std::floor(*d) || std::fabs(*d) > 9.2e18))
      fail(name(prefix, key), "must be an integer, got " + obj[key].dump());
    return d ? std::optional<int64_t>(static_cast<int64_t>(*d)) : std::nullopt;
  }
  std::optional<bool> boolean(const json& obj, const std::string& prefix, const std::string& key) const {
    if (!obj.contains(key) || is_auto(obj[key])) return std::nullopt;
    if (!obj[key].is_boolean()) fail(name(prefix, key), "must be true or false, got " + obj[key].dump());
    return obj[key].get<bool>();
  }
  std::optional<std::string> string(const json& obj, const std::string& prefix, const std::string& key) const {
    if (!obj.contains(key) || is_auto(obj[key])) return std::nullopt;
    if (!obj[key].is_string()) fail(name(prefix, key), "must be a string, got " + obj[key].dump());
    return obj[key].get<std::string>();
  }
  const json& object(const json& obj, const std::string& prefix, const std::string& key,
                     const std::set<std::string>& known) const {
    check_keys(obj[key], name(prefix, key), known);
    return obj[key];
  }

 private:
  std::string file_;
  std::vector<std::string>* notices_;
  mutable std::vector<std::string> unknown_;
};

template <typename T>
void set_if(T& field, const std::optional<T>& v) {
  if (v) field = *v;
}

// The model width "auto" sizes are derived from (Note [DeepSpeed mapping]),
// asked of `width` the first time a key needs it.
class Hidden {
 public:
  Hidden(const Reader& r, const Config& c, const ModelWidth& width) : r_(r), c_(c), width_(width) {}
  double operator()(const std::string& key) {
    if (!value_) {
      if (!width_)
        r_.fail(key,
                "=\"auto\" is sized from the model's width, which this reader was not given (give the size "
                "in elements)");
      value_ = static_cast<double>(width_(c_.model));
    }
    return *value_;
  }

 private:
  const Reader& r_;
  const Config& c_;
  const ModelWidth& width_;
  std::optional<double> value_;
};

// bf16 / fp16 sections: precision.mode and param_dtype, fp16 loss scaling.
void map_precision(const Reader& r, const json& root, Config& c) {
  std::optional<bool> bf16, fp16;
  // "bfloat16" is DeepSpeed's older spelling of "bf16" (still in transformers' test configs).
  for (const char* key : {"bf16", "bfloat16"}) {
    if (!root.contains(key)) continue;
    const json& b = r.object(root, "", key, {"enabled"});
    // "auto": on when the YAML's precision.mode says so; off leaves the YAML's dtype alone.
    if (b.contains("enabled") && Reader::is_auto(b["enabled"])) {
      if (c.precision.mode == "bf16") bf16 = true;
    } else if (auto v = r.boolean(b, key, "enabled"))
      bf16 = v;
  }
  if (root.contains("fp16")) {
    const json& f =
        r.object(root, "", "fp16",
                 {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"});
    if (f.contains("enabled") && Reader::is_auto(f["enabled"])) {
      if (c.precision.mode == "fp16") fp16 = true;
    } else {
      fp16 = r.boolean(f, "fp16", "enabled");
    }
    // The loss-scaling keys act only when fp16 is on; otherwise each one
    // given (not "auto") is said to have no effect, and precision.* keeps
    // the YAML's values (which make_plan checks).
    precision::PrecisionOptions scaled = c.precision;
    auto& p = fp16.value_or(false) ? c.precision : scaled;
    if (!fp16.value_or(false))
      for (const char* k : {"loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"})
        if (f.contains(k) && !Reader::is_auto(f[k]))
          r.notice(std::string("fp16.") + k, f[k], "fp16 is not enabled, so nothing scales the loss");
    // DeepSpeed's defaults for absent keys: dynamic, 2^16, window 1000, hysteresis 2, min 1.
    p.loss_scale = r.number(f, "fp16", "loss_scale").value_or(f.contains("loss_scale") ? p.loss_scale : 0.0);
    p.initial_scale_power = r.integer(f, "fp16", "initial_scale_power")
                                .value_or(f.contains("initial_scale_power") ? p.initial_scale_power : 16);
    p.loss_scale_window = r.integer(f, "fp16", "loss_scale_window")
                              .value_or(f.contains("loss_scale_window") ? p.loss_scale_window : 1000);
    p.hysteresis = r.integer(f, "fp16", "hysteresis").value_or(f.contains("hysteresis") ? p.hysteresis : 2);
    p.min_loss_scale =
        r.number(f, "fp16", "min_loss_scale").value_or(f.contains("min_loss_scale") ? p.min_loss_scale : 1.0);
  }
  if (bf16.value_or(false) && fp16.value_or(false)) r.fail("bf16.enabled", "and fp16.enabled cannot both be true");
  std::optional<std::string> dtype;
  if (bf16.value_or(false))
    dtype = "bf16";
  else if (fp16.value_or(false))
    dtype = "fp16";
  else if ((bf16 && !*bf16) || (fp16 && !*fp16))
    dtype = "fp32";  // explicitly disabled
  if (dtype) c.precision.mode = c.precision.param_dtype = *dtype;
}

// Offload sections share one nvme_path (one offload directory here), and
// only enabled sections are compared (Note [DeepSpeed mapping]).
void map_offload(const Reader& r, const json& z, const std::string& key, std::string& device,
                 std::optional<std::string>& nvme_path) {
  const std::string prefix = "zero_optimization." + key;
  const json& o = r.object(z, "zero_optimization", key,
                           {"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                            "pipeline_read", "pipeline_write", "fast_init", "ratio"});
  std::string d = r.string(o, prefix, "device").value_or("none");
  if (d != "none" && d != "cpu" && d != "nvme")
    r.fail(prefix + ".device", "must be none, cpu or nvme, got '" + d + "'");
  for (const char* k : {"buffer_count", "buffer_size", "max_in_cpu", "ratio"}) r.number(o, prefix, k);
  for (const char* k : {"pin_memory", "pipeline_read", "pipeline_write", "fast_init"}) r.boolean(o, prefix, k);
  r.string(o, prefix, "nvme_path");
  if (d == "none") return;  // a disabled section: nothing in it applies
  device = d;               // parallel.zero.offload_*: cpu or nvme (Note [Offloaded shards])
  if (d == "nvme") {
    if (auto p = r.string(o, prefix, "nvme_path")) {
      if (nvme_path && *nvme_path != *p)
        r.fail(prefix + ".nvme_path",
               "differs from the other offload's nvme_path (one offload directory is supported)");
      nvme_path = p;
    }
  }
  for (const char* k : {"pin_memory", "pipeline_read", "pipeline_write", "fast_init"})
    if (Reader::asks(o, k)) r.notice(prefix + "." + k, o[k], "a CPU build has no device copies to pin or overlap");
  for (const char* k : {"buffer_count", "buffer_size", "max_in_cpu", "ratio"})
    if (o.contains(k)) r.notice(prefix + "." + k, o[k], "file-backed states are read and written whole, per step");
}

// zero_optimization's keys that are accepted and act on nothing here, each
// with a notice (Note [DeepSpeed mapping]); "auto" values are shown resolved.
void zero_keys_without_effect(const Reader& r, const json& z, const std::string& P, Hidden& hidden) {
  if (z.contains("stage3_param_persistence_threshold")) {
    const std::string key = P + ".stage3_param_persistence_threshold";
    json v = z["stage3_param_persistence_threshold"];
    if (Reader::is_auto(v)) v = static_cast<int64_t>(10 * hidden(key));  // shown resolved
    r.integer(z, P, "stage3_param_persistence_threshold");
    r.notice(key, v, "every parameter is sharded, however small");
  }
  if (z.contains("stage3_max_reuse_distance")) {
    r.integer(z, P, "stage3_max_reuse_distance");
    r.notice(P + ".stage3_max_reuse_distance", z["stage3_max_reuse_distance"],
             "gathered units are released after use; stage3_max_live_parameters bounds them");
  }
  if (z.contains("sub_group_size")) {
    r.integer(z, P, "sub_group_size");
    r.notice(P + ".sub_group_size", z["sub_group_size"], "each rank's optimizer steps its whole shard at once");
  }
  for (const char* k : {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"}) {
    r.boolean(z, P, k);
    if (Reader::asks(z, k))
      r.notice(P + "." + k, z[k], "checkpoints are written sharded; `scaletrain checkpoint` consolidates them");
  }
}

void map_zero(const Reader& r, const json& root, Config& c, double element_bytes, Hidden& hidden) {
  if (!root.contains("zero_optimization")) return;
  const std::string P = "zero_optimization";
  const json& z = r.object(root, "", P,
                           {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                            "contiguous_gradients", "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size",
                            "stage3_max_live_parameters", "reduce_scatter", "allgather_partitions",
                            "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                            "stage3_max_reuse_distance", "stage3_param_persistence_threshold", "sub_group_size"});
  if (auto s = r.integer(z, P, "stage")) {
    if (*s < 0 || *s > 3) r.fail(P + ".stage", "must be 0, 1, 2 or 3, got " + std::to_string(*s));
    c.parallel.strategy = *s == 0 ? "ddp" : "zero" + std::to_string(*s);
  }
  auto& o = c.parallel.zero;
  const double mib = 1024.0 * 1024.0;
  // "auto" sizes, as the Hugging Face trainer fills them in: `auto_factor`
  // x hidden^2 elements.
  auto elements_to_mb = [&](const char* key, double& field, std::optional<double> auto_factor) {
    std::optional<double> n;
    if (auto v = r.integer(z, P, key)) {
      if (*v < 1) r.fail(P + "." + key, "must be positive");
      n = static_cast<double>(*v);
    } else if (z.contains(key) && auto_factor) {
      const double h = hidden(P + "." + key);
      n = std::floor(*auto_factor * h * h);
    }
    if (n) field = *n * element_bytes / mib;
  };
  // Each size acts in the stages that read it (Note [Settings that apply] in
  // train/plan/plan.h); in the others it is accepted with a notice, so a file
  // written for several stages still runs.
  const std::string& strategy = c.parallel.strategy;
  const bool stage12 = strategy == "zero1" || strategy == "zero2", stage3 = strategy == "zero3";
  double unused = 0;
  auto sized = [&](const char* key, double& field, std::optional<double> auto_factor, bool applies, const char* why) {
    if (!z.contains(key)) return;
    elements_to_mb(key, applies ? field : unused, auto_factor);
    if (!applies) r.notice(P + "." + key, z[key], why);
  };
  sized("reduce_bucket_size", o.reduce_bucket_mb, 1.0, stage12,
        "stage 3 reduce-scatters one transformer block at a time, and stage 0 is DDP's buckets");
  sized("allgather_bucket_size", o.allgather_bucket_mb, std::nullopt, stage12,
        "it sizes the gathers of stages 1-2 only");
  sized("stage3_prefetch_bucket_size", o.prefetch_bucket_mb, 0.9, stage3, "it applies to stage 3 only");
  if (auto n = r.integer(z, P, "stage3_max_live_parameters")) {
    if (stage3)
      o.max_live_parameters = *n;
    else
      r.notice(P + ".stage3_max_live_parameters", z["stage3_max_live_parameters"], "it applies to stage 3 only");
  }
  set_if(o.overlap_comm, r.boolean(z, P, "overlap_comm"));
  set_if(o.contiguous_gradients, r.boolean(z, P, "contiguous_gradients"));
  set_if(o.reduce_scatter, r.boolean(z, P, "reduce_scatter"));
  set_if(o.allgather_partitions, r.boolean(z, P, "allgather_partitions"));
  std::optional<std::string> nvme_path;
  if (z.contains("offload_optimizer")) map_offload(r, z, "offload_optimizer", o.offload_optimizer, nvme_path);
  if (z.contains("offload_param")) map_offload(r, z, "offload_param", o.offload_param, nvme_path);
  set_if(o.offload_dir, nvme_path);
  zero_keys_without_effect(r, z, P, hidden);
}

// activation_checkpointing: the section turns block recomputation on.
void map_activation_checkpointing(const Reader& r, const json& root, Config& c) {
  if (!root.contains("activation_checkpointing")) return;
  const std::string P = "activation_checkpointing";
  const json& a = r.object(root, "", P,
                           {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                            "synchronize_checkpoint_boundary", "profile", "number_checkpoints"});
  for (const char* k : {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                        "synchronize_checkpoint_boundary", "profile"})
    r.boolean(a, P, k);
  c.model.activation_checkpointing = "full";
  r.note(P + " sets model.activation_checkpointing=full (each block's input is kept, the block recomputed)");
  const std::map<std::string, std::string> why = {
      {"partition_activations", "checkpointed inputs are kept whole on each tensor-parallel rank"},
      {"cpu_checkpointing", "a CPU build keeps checkpoints in CPU memory already"},
      {"contiguous_memory_optimization", "checkpoints are ordinary tensors, not one preallocated buffer"},
      {"synchronize_checkpoint_boundary", "a CPU build has no device stream to synchronize"},
      {"profile", "recomputation is not timed separately"},
      {"number_checkpoints", "every block is checkpointed"}};
  for (const auto& [k, w] : why)
    if (Reader::asks(a, k)) r.notice(P + "." + k, a[k], w);
}

// aio: DeepSpeed's asynchronous NVMe I/O library; accepted as a whole.
void map_aio(const Reader& r, const json& root) {
  if (!root.contains("aio")) return;
  const json& a = r.object(root, "", "aio",
                           {"block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
                            "overlap_events", "use_gds"});
  if (!a.empty()) r.notice("aio", a, "file-backed optimizer states use plain POSIX reads and writes");
}

void map_batch(const Reader& r, const json& root, Config& c, int dp) {
  auto tb = r.integer(root, "", "train_batch_size");
  auto mb = r.integer(root, "", "train_micro_batch_size_per_gpu");
  auto ga = r.integer(root, "", "gradient_accumulation_steps");
  for (auto [v, key] : {std::pair{tb, "train_batch_size"}, std::pair{mb, "train_micro_batch_size_per_gpu"},
                        std::pair{ga, "gradient_accumulation_steps"}})
    if (v && *v < 1) r.fail(key, "must be at least 1, got " + std::to_string(*v));
  if (!tb && !mb && !ga) return;
  const std::string rule =
      " (DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu x "
      "gradient_accumulation_steps x data-parallel size " +
      std::to_string(dp) + ")";
  // Fewer than two explicit values: complete them from the YAML config.
  if (!tb + !mb + !ga >= 2) {
    if (!mb && !(tb && ga)) mb = c.train.micro_batch;
    if (!tb && !ga) tb = c.train.global_batch;
  }
  if (tb && mb && ga) {
    if (*tb != *mb * *ga * dp)
      r.fail("train_batch_size", "=" + std::to_string(*tb) + " does not equal train_micro_batch_size_per_gpu=" +
                                     std::to_string(*mb) + " x gradient_accumulation_steps=" + std::to_string(*ga) +
                                     " x data-parallel size " + std::to_string(dp));
  } else if (tb && mb) {
    if (*tb % (*mb * dp) != 0)
      r.fail("train_batch_size", "=" + std::to_string(*tb) + " is not a multiple of train_micro_batch_size_per_gpu=" +
                                     std::to_string(*mb) + " x data-parallel size " + std::to_string(dp) + rule);
  } else if (tb && ga) {
    if (*tb % (*ga * dp) != 0)
      r.fail("train_batch_size", "=" + std::to_string(*tb) + " is not a multiple of gradient_accumulation_steps=" +
                                     std::to_string(*ga) + " x data-parallel size " + std::to_string(dp) + rule);
    mb = *tb / (*ga * dp);
  } else {  // mb && ga
    tb = *mb * *ga * dp;
  }
  c.train.global_batch = *tb;
  c.train.micro_batch = *mb;
}

void map_optimizer(const Reader& r, const json& root, Config& c) {
  if (!root.contains("optimizer")) return;
  const json& o = r.object(root, "", "optimizer", {"type", "params"});
  const auto type = r.string(o, "optimizer", "type");
  if (!type) r.fail("optimizer.type", "must be set (AdamW)");
  const json empty = json::object();
  const json& p = o.contains("params") ? r.object(o, "optimizer", "params",
                                                  {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"})
                                       : empty;
  const std::string P = "optimizer.params";
  r.boolean(p, P, "torch_adam");  // cosmetic (kernel choice), only type-checked
  const bool adam_w_mode = r.boolean(p, P, "adam_w_mode").value_or(true);
  if (*type == "Adam" && !adam_w_mode)
    r.fail("optimizer.type", "Adam with adam_w_mode false (L2-regularised Adam) is not supported: use AdamW");
  if (*type != "Adam" && *type != "AdamW")
    r.fail("optimizer.type", "'" + *type + "' is not supported (supported: AdamW, or Adam with adam_w_mode true)");
  // DeepSpeed's defaults for absent parameters: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.
  auto& t = c.train;
  t.lr = r.number(p, P, "lr").value_or(p.contains("lr") ? t.lr : 1e-3);
  t.eps = r.number(p, P, "eps").value_or(p.contains("eps") ? t.eps : 1e-8);
  t.weight_decay = r.number(p, P, "weight_decay").value_or(p.contains("weight_decay") ? t.weight_decay : 0.0);
  if (!p.contains("betas")) {
    t.beta1 = 0.9, t.beta2 = 0.999;
  } else if (!Reader::is_auto(p["betas"])) {
    const json& b = p["betas"];
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number())
      r.fail(P + ".betas", "must be a list of two numbers, got " + b.dump());
    t.beta1 = b[0].get<double>(), t.beta2 = b[1].get<double>();
  }
}

void map_scheduler(const Reader& r, const json& root, Config& c) {
  if (!root.contains("scheduler")) return;
  const json& s = r.object(root, "", "scheduler", {"type", "params"});
  const auto type = r.string(s, "scheduler", "type");
  if (!type) r.fail("scheduler.type", "must be set (WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  const bool cosine = *type == "WarmupCosineLR";
  std::set<std::string> known;
  if (*type == "WarmupLR")
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
  else if (*type == "WarmupDecayLR")
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"};
  else if (cosine)
    known = {"warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps"};
  else
    r.fail("scheduler.type", "'" + *type + "' is not supported (supported: WarmupLR, WarmupDecayLR, WarmupCosineLR)");
  const json empty = json::object();
  const json& p = s.contains("params") ? r.object(s, "scheduler", "params", known) : empty;
  const std::string P = "scheduler.params";
  auto& t = c.train;
  // DeepSpeed's defaults for absent parameters: 1000 warmup steps, log ramp,
  // min lr 0, max lr 1e-3 (WarmupLR/WarmupDecayLR), cos_min_ratio 1e-4.
  auto given = [&](const char* k) { return p.contains(k); };
  t.warmup_steps = r.integer(p, P, "warmup_num_steps").value_or(given("warmup_num_steps") ? t.warmup_steps : 1000);
  const auto wt = r.string(p, P, "warmup_type");
  if (wt && *wt != "log" && *wt != "linear") r.fail(P + ".warmup_type", "must be log or linear, got '" + *wt + "'");
  t.warmup_type = wt.value_or(given("warmup_type") ? t.warmup_type : "log");
  if (auto n = r.integer(p, P, "total_num_steps")) {
    if (*n < 1) r.fail(P + ".total_num_steps", "must be at least 1");
    t.steps = *n;
  }
  if (cosine) {
    t.lr_schedule = "cosine";
    t.warmup_start_ratio =
        r.number(p, P, "warmup_min_ratio").value_or(given("warmup_min_ratio") ? t.warmup_start_ratio : 0.0);
    t.min_lr_ratio = r.number(p, P, "cos_min_ratio").value_or(given("cos_min_ratio") ? t.min_lr_ratio : 1e-4);
    return;
  }
  t.lr_schedule = *type == "WarmupLR" ? "constant" : "linear";
  // The scheduler's warmup_max_lr is the peak (it overrides the optimizer's lr, as in DeepSpeed).
  t.lr = r.number(p, P, "warmup_max_lr").value_or(given("warmup_max_lr") ? t.lr : 1e-3);
  if (t.lr <= 0) r.fail(P + ".warmup_max_lr", "must be positive");
  // Absent: DeepSpeed's default 0; "auto": 0, as the Hugging Face trainer fills it.
  const double ratio = r.number(p, P, "warmup_min_lr").value_or(0.0) / t.lr;
  t.warmup_start_ratio = ratio;
  t.min_lr_ratio = ratio;  // WarmupDecayLR decays to warmup_min_lr
}

}  // namespace

void apply_deepspeed_json(Config& c, const nlohmann::json& root, const std::string& origin, int dp,
                          const ModelWidth& model_width) {
  if (dp < 1) throw UsageError("data-parallel size must be at least 1, got " + std::to_string(dp));
  const Reader r(origin, &c.notices);
  r.check_keys(
      root, "",
      {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
       "gradient_clipping", "optimizer", "scheduler", "bf16", "bfloat16", "fp16", "steps_per_print",
       "wall_clock_breakdown", "zero_allow_untested_optimizer", "activation_checkpointing", "aio"});
  map_precision(r, root, c);
  const double element_bytes = c.precision.param_dtype == "fp32" ? 4.0 : 2.0;
  Hidden hidden(r, c, model_width);
  map_zero(r, root, c, element_bytes, hidden);
  map_batch(r, root, c, dp);
  map_optimizer(r, root, c);
  map_scheduler(r, root, c);
  map_activation_checkpointing(r, root, c);
  map_aio(r, root);
  if (auto g = r.number(root, "", "gradient_clipping")) {
    if (*g < 0) r.fail("gradient_clipping", "must be 0 (off) or positive");
    c.train.grad_clip = *g;
  }
  if (auto n = r.integer(root, "", "steps_per_print")) {
    if (*n < 1) r.fail("steps_per_print", "must be at least 1");
    c.metrics.log_every = *n;
  }
  if (r.boolean(root, "", "wall_clock_breakdown").value_or(false))
    r.notice("wall_clock_breakdown", true, "per-step time and communication wait are in the metrics file instead");
  if (r.boolean(root, "", "zero_allow_untested_optimizer").value_or(false))
    r.notice("zero_allow_untested_optimizer", true, "only AdamW is accepted, and it is the tested one");
  r.finish();
  try {
    validate_config(c);
  } catch (const UsageError& e) {
    throw UsageError(origin + ": " + e.what());
  }
}

void apply_deepspeed_config(Config& c, const std::string& path, int dp, const ModelWidth& model_width) {
  // Note [Strict JSON]: repeated keys are refused, as DeepSpeed refuses them.
  const nlohmann::json root = util::read_json_file(path, "deepspeed config " + path);
  apply_deepspeed_json(c, root, path, dp, model_width);
}

int deepspeed_data_parallel_size(const Config& c) {
  // DeepSpeed's batch rule needs the data-parallel degree: the world over tp x pp.
  const int world = comm::world_info_from_env().world_size;
  const int model_parallel = static_cast<int>(std::max<int64_t>(1, int64_t{c.parallel.tp} * c.parallel.pp));
  return std::max(1, world / model_parallel);
}

}  // namespace scaletrain::config

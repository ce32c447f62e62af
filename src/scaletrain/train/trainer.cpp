// Longer than 600 lines (issue 35): the loop, resume and save, and the
// step's logging in one file. The seams: resume/save and logging, to move
// out when issue 35 splits train/ by job.
#include "scaletrain/train/trainer.h"

#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <filesystem>
#include <memory>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/comm/activity.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/moe.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/memory_report.h"
#include "scaletrain/train/metrics.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/train/plan.h"
#include "scaletrain/train/batches.h"
#include "scaletrain/train/device.h"
#include "scaletrain/train/strategy.h"
#include "scaletrain/train/tracing.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

// The precision section's FP8 settings (validated by make_plan).
precision::Fp8LinearOptions fp8_linear_options(const precision::PrecisionOptions& p) {
  precision::Fp8LinearOptions o;
  o.mix = p.fp8_format == "e4m3" ? precision::Fp8Mix::E4M3 : precision::Fp8Mix::Hybrid;
  o.delayed = p.fp8_recipe == "delayed";
  o.history = p.fp8_amax_history;
  o.margin = static_cast<int>(p.fp8_margin);
  return o;
}

// ", fp8 linears (hybrid, delayed scaling over 1024 steps, margin 0), O1;
// gradients travel as FP8 E5M2" or "".
std::string fp8_description(const Config& c) {
  const auto& p = c.precision;
  std::string out;
  if (p.fp8)
    out += ", fp8 linears (" + p.fp8_format + ", " +
           (p.fp8_recipe == "delayed" ? "delayed scaling over " + std::to_string(p.fp8_amax_history) + " steps"
                                      : std::string("current scaling")) +
           ", margin " + std::to_string(p.fp8_margin) + ")" + (p.fp8_opt_level.empty() ? "" : ", " + p.fp8_opt_level) +
           (p.fp8_opt_level == "O2"   ? " (Adam moments in FP8 and fp16)"
            : p.fp8_opt_level == "O3" ? " (Adam moments in FP8 and fp16, fp16 master weights, FP8 weight gathers)"
                                      : "");
  if (const auto wire = fp8_wire_format(c.parallel, p))
    out += std::string("; gradients travel as FP8 ") + (*wire == precision::Fp8Format::E5M2 ? "E5M2" : "E4M3");
  return out;
}

// Threads per rank: what the launcher decided (SCALETRAIN_THREADS or
// OMP_NUM_THREADS), else libtorch's default.
void set_threads() {
  for (const char* var : {"SCALETRAIN_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) {
      int n = std::atoi(v);
      if (n > 0) {
        set_compute_threads(n);
        return;
      }
    }
  }
}

optim::ScheduleOptions schedule(const TrainOptions& t) {
  optim::ScheduleOptions s;
  s.warmup_steps = t.warmup_steps;
  s.total_steps = t.steps;
  s.min_lr_ratio = t.min_lr_ratio;
  s.decay = t.lr_schedule == "linear"     ? optim::Decay::Linear
            : t.lr_schedule == "constant" ? optim::Decay::Constant
                                          : optim::Decay::Cosine;
  s.warmup = t.warmup_type == "log" ? optim::Warmup::Log : optim::Warmup::Linear;
  s.warmup_start_ratio = t.warmup_start_ratio;
  return s;
}

// The launcher's attempt number (launch --max-restarts): 0 on a first start.
int restart_count() {
  for (const char* name : {"SCALETRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n >= 0 && n < 1000000) return static_cast<int>(n);
      throw UsageError(std::string(name) + "=" + v + " is not an attempt number");
    }
  return 0;
}

// The checkpoint to resume from per checkpoint.resume, or "" for a fresh start.
// Under auto, the newest complete checkpoint whose files pass their checksums:
// a newer one that fails is skipped with a line naming the bad file (`lead`
// prints it), and when every one fails the run stops rather than starting
// over beside them.
// A restarted group (restart_count() > 0) goes on from the newest intact
// checkpoint of checkpoint.dir whatever checkpoint.resume says: the first
// attempt's progress is there, and starting over would redo it (or, with a
// fixed path, go back to it).
std::string resume_path(const CheckpointingOptions& c, bool lead) {
  if (const int restart = restart_count(); restart > 0) {
    if (c.dir.empty() || checkpoint::complete_checkpoints(c.dir).empty()) {
      if (lead && (c.resume == "auto" || c.resume == "never"))
        std::printf("scaletrain: restart %d of the group: no checkpoint to go on from (%s), starting at step 0\n",
                    restart, c.dir.empty() ? "checkpoint.dir is not set" : ("none in " + c.dir).c_str());
    } else if (c.resume != "auto") {
      if (lead)
        std::printf("scaletrain: restart %d of the group: resuming from the newest intact checkpoint in %s "
                    "(checkpoint.resume=%s is for a first start)\n", restart, c.dir.c_str(), c.resume.c_str());
      CheckpointingOptions newest = c;
      newest.resume = "auto";
      return resume_path(newest, lead);
    }
  }
  if (c.resume == "never") return "";
  if (c.resume == "auto") {
    if (c.dir.empty()) return "";
    const std::vector<std::string> all = checkpoint::complete_checkpoints(c.dir);
    std::string newest_bad;
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      std::string bad;
      try {
        const std::vector<std::string> problems = checkpoint::verify_files(*it, checkpoint::read_index(*it));
        if (problems.empty()) return *it;
        bad = "corrupt file " + problems.front();
      } catch (const UsageError& e) {
        bad = e.what();
      }
      if (lead) std::printf("scaletrain: checkpoint.resume=auto: skipping %s: %s\n", it->c_str(), bad.c_str());
      if (newest_bad.empty()) newest_bad = bad;
    }
    if (!all.empty())
      throw UsageError("checkpoint.resume=auto: none of the " + std::to_string(all.size()) + " checkpoints in " +
                       c.dir + " is intact (the newest: " + newest_bad +
                       "); remove them, or set checkpoint.resume=never to start over");
    return "";
  }
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(c.resume) / "index.json")) return c.resume;         // a step directory
  if (auto newest = checkpoint::newest_checkpoint(c.resume)) return *newest;  // a root of step directories
  throw UsageError("checkpoint.resume=" + c.resume + " is not a complete checkpoint nor a directory holding one");
}

checkpoint::ModelShape model_shape(const models::ModelConfig& m) {
  return {m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.bias, m.family,
          models::config_to_hf(m).dump()};
}

// The files of data.tokenizer a checkpoint keeps a copy of (Note [Checkpoint
// assets] in checkpoint/sharded.h), as (name in the step directory, source):
// the tokenizer.json (data.tokenizer itself, or the one in that directory),
// and the tokenizer_config.json / special_tokens_map.json beside it; a
// directory of GPT-2's vocab.json + merges.txt gives those two.
std::vector<std::pair<std::string, std::string>> tokenizer_assets(const std::string& tokenizer) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::string>> out;
  if (tokenizer.empty()) return out;
  const fs::path path(tokenizer);
  const fs::path dir = fs::is_directory(path) ? path : path.parent_path();
  auto add = [&](const std::string& name, const fs::path& from) {
    if (fs::is_regular_file(from)) out.emplace_back("tokenizer/" + name, from.string());
  };
  if (fs::is_directory(path)) {
    add("tokenizer.json", dir / "tokenizer.json");
    if (out.empty()) {
      add("vocab.json", dir / "vocab.json");
      add("merges.txt", dir / "merges.txt");
    }
  } else {
    add("tokenizer.json", path);
  }
  add("tokenizer_config.json", dir / "tokenizer_config.json");
  add("special_tokens_map.json", dir / "special_tokens_map.json");
  return out;
}

// Everything a run holds between setup and the end, so each phase below is a
// short function and the loop reads as a recipe (Note [Training step]).
struct Run {
  const Config& cfg;
  const Plan& plan;
  data::SampleSource& dataset;
  comm::MeshDims dims;
  std::shared_ptr<comm::World> world;
  std::unique_ptr<comm::Mesh> mesh;
  bool lead = false;
  Parallelized par;
  std::vector<at::Tensor> params;  // what the optimizer updates
  std::unique_ptr<optim::AdamW> opt;
  int64_t opt_bytes = 0;
  std::unique_ptr<precision::LossScaler> scaler;
  std::vector<precision::Fp8LinearPtr> fp8;  // precision.fp8: the blocks' linears, in module order
  optim::ScheduleOptions sched;
  std::unique_ptr<data::DistributedSampler> sampler;
  double peak_flops = 0;
  double flops_per_token = 0;  // of one training step, frozen weights' gradients left out (MFU)
  double setup_peak_mb = 0, rss_before_setup = 0, rss_file_before_setup = 0;
  checkpoint::Layout layout;  // what this rank saves and loads
  std::string finetune;       // checkpoint::ModelShape::finetune of this run ("" when every parameter trains)
  std::unique_ptr<checkpoint::Checkpointer> ckpt;
  std::unique_ptr<MetricsSink> sink;
  MeasuredMemory mem;
  estimate::Layout mem_layout;
  double lifetime_rss_peak_mb = 0;

  DataParallel& dp() { return *par.dp; }
  models::CausalLM& model() { return *par.model; }
};

// Joins the job and builds the mesh, the model, its strategy and the optimizer.
void setup(Run& r, const comm::WorldInfo& info) {
  const Config& cfg = r.cfg;
  set_threads();
  // Note [One device per rank]: the device is current before anything is
  // allocated or NCCL starts, and the backend follows the device unless forced.
  use_device(r.plan.device);
  comm::WorldOptions wo;
  wo.backend = comm::parse_backend(cfg.parallel.backend);
  if (wo.backend == comm::Backend::Auto) wo.backend = r.plan.cuda ? comm::Backend::Nccl : comm::Backend::Gloo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.parallel.timeout_s * 1000));
  wo.debug_collectives = cfg.parallel.debug_collectives;
  r.world = comm::World::init(info, wo);
  r.mesh = std::make_unique<comm::Mesh>(*r.world, r.dims);
  r.lead = r.world->rank() == 0;

  // Setup memory: the peak resident set while the model is built and wrapped,
  // above what the process held before (an upper bound: an earlier peak counts).
  // Note [Setup memory and glibc]: glibc raises its mmap threshold to the
  // size of any large block freed (up to 32 MiB), after which tensors of that
  // size come from the heap and stay resident when freed: a model built and
  // sharded one tensor at a time would still leave its whole size in RSS.
  // During setup large blocks are mmap'd (returned to the OS on free); after
  // it the threshold is fixed where the dynamic rule would have taken it, so
  // per-step temporaries are reused without page faults.
  r.rss_before_setup = current_rss_mb();
  r.rss_file_before_setup = rss_file_mb();
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  r.par = parallelize(cfg, r.plan, *r.world, *r.mesh);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  r.setup_peak_mb = peak_rss_mb() - r.rss_before_setup;
  r.model().set_activation_checkpointing(models::parse_activation_checkpointing(cfg.model.activation_checkpointing));
  if (cfg.precision.fp8) r.fp8 = models::use_fp8(r.model(), fp8_linear_options(cfg.precision));

  r.params = r.dp().optimizer_params();
  optim::AdamWOptions ao;
  ao.lr = cfg.train.lr;
  ao.beta1 = cfg.train.beta1;
  ao.beta2 = cfg.train.beta2;
  ao.eps = cfg.train.eps;
  ao.weight_decay = cfg.train.weight_decay;
  if (r.plan.offload_optimizer == Offload::kNvme) ao.state_dir = cfg.parallel.zero.offload_dir;
  ao.fp8_moments = fp8_moments(r.plan.fp8_level);
  ao.fused = cfg.model.fused;  // one pass per element (kernels/adamw.h); false: ATen's ops
  r.opt = std::make_unique<optim::AdamW>(r.params, r.dp().decay_numel(), ao);
  for (size_t i = 0; i < r.opt->exp_avg().size(); ++i)
    r.opt_bytes += r.opt->exp_avg()[i].nbytes() + r.opt->exp_avg_sq()[i].nbytes();
  r.sched = schedule(cfg.train);
  if (r.plan.policy.loss_scaling)
    r.scaler = std::make_unique<precision::LossScaler>(precision::loss_scaler_options(cfg.precision));
  data::SamplerOptions so;
  so.seed = cfg.train.seed;
  so.global_batch = cfg.train.global_batch;
  r.sampler = std::make_unique<data::DistributedSampler>(r.dataset.num_samples(), so);
  // A GPU's peak is measured there in bf16; metrics.peak_flops gives the data-sheet figure instead.
  r.peak_flops = cfg.metrics.peak_flops > 0 ? cfg.metrics.peak_flops
                 : r.plan.cuda              ? measure_device_gemm_flops()
                                            : measure_gemm_flops();
  r.flops_per_token = r.model().step_flops_per_token(r.plan.model.block_size);  // once: which weights train does not change
}

void print_start(Run& r, const comm::WorldInfo& info) {
  if (!r.lead) return;
  const Config& cfg = r.cfg;
  std::printf("scaletrain: %s, %lld parameters, world %d (%s), mesh %s, %s%s\n", cfg.model.preset.c_str(),
              static_cast<long long>(r.model().num_parameters()), r.world->size(), info.source.c_str(),
              (r.dims.describe() + (r.dims.cp > 1 ? " (" + cfg.parallel.cp_mode + " attention)" : "")).c_str(),
              ((r.world->backend() == comm::BackendKind::Nccl ? "nccl" : "gloo") + std::string(" on ") +
               r.plan.device.str())
                  .c_str(),
              r.world->debug_collectives() && r.world->size() > 1
                  ? "; every collective's fingerprint compared across ranks first (debug_collectives)"
                  : "");
  if (auto lora = lora_options(cfg, r.plan.model)) {
    int64_t trainable = 0, layers = 0;
    for (const auto& item : r.model().named_parameters()) {
      if (item.value().requires_grad()) trainable += item.value().numel();
      if (models::is_adapter_parameter(item.key())) ++layers;
    }
    std::string targets;
    for (const auto& t : lora->target_modules) targets += (targets.empty() ? "" : ",") + t;
    std::printf("scaletrain: finetune %s r=%lld scaling %.6g on %lld layers (%s): %lld trainable parameters\n",
                cfg.finetune.method.c_str(), static_cast<long long>(lora->r), lora->scaling(),
                static_cast<long long>(layers / 2), targets.c_str(), static_cast<long long>(trainable));
  }
  std::printf(
      "scaletrain: %lld samples of %lld tokens; global batch %lld = micro %lld x accumulation %lld x dp %d; "
      "%d threads/rank; peak %.1f GFLOP/s/rank\n",
      static_cast<long long>(r.dataset.num_samples()), static_cast<long long>(r.plan.model.block_size),
      static_cast<long long>(cfg.train.global_batch), static_cast<long long>(r.plan.micro_batch),
      static_cast<long long>(r.plan.accum), r.dims.dp(), torch::get_num_threads(), r.peak_flops / 1e9);
  std::printf("scaletrain: data: %s; loss on %s tokens\n", r.dataset.describe().c_str(), cfg.data.loss_on.c_str());
  std::printf(
      "scaletrain: strategy %s; precision: %s; model states %.1f MiB/rank (params+grads %.1f, "
      "optimizer %.1f); setup peak +%.1f MiB RSS\n",
      r.dp().describe().c_str(), (r.plan.policy.describe() + fp8_description(cfg)).c_str(),
      (r.dp().model_state_bytes() + r.opt_bytes) / 1048576.0, r.dp().model_state_bytes() / 1048576.0,
      r.opt_bytes / 1048576.0, r.setup_peak_mb);
  // Accepted settings that work differently here, once: from config files
  // (DeepSpeed, Accelerate) and from the plan.
  for (const auto& n : cfg.notices) std::printf("scaletrain: note: %s\n", n.c_str());
  for (const auto& n : r.plan.notices) std::printf("scaletrain: note: %s\n", n.c_str());
  std::fflush(stdout);
}

// A finetune run saves and loads its adapters only: every piece of a frozen
// parameter is dropped (frozen flats are whole slots; adapters never share
// a slot with frozen parameters).
checkpoint::Layout adapters_only(checkpoint::Layout l) {
  std::vector<checkpoint::Slot> kept;
  for (auto& slot : l.slots) {
    std::vector<checkpoint::SlotPiece> pieces;
    for (auto& p : slot.pieces)
      if (models::is_adapter_parameter(p.name)) pieces.push_back(std::move(p));
    if (pieces.empty()) continue;
    slot.pieces = std::move(pieces);
    kept.push_back(std::move(slot));
  }
  l.slots = std::move(kept);
  return l;
}

// A checkpoint resumes a run of the same kind: full into full, adapters into
// adapters of the same settings on the same base.
void check_resumable(const checkpoint::Index& x, const std::string& from, const Run& r) {
  if (x.model.finetune.empty() == r.finetune.empty()) {
    if (r.finetune.empty()) return;
    const auto saved = hub::settings_from_json(nlohmann::json::parse(x.model.finetune), from + "/index.json");
    const auto now = hub::settings_from_json(nlohmann::json::parse(r.finetune), "this run");
    if (saved.base != now.base)
      throw UsageError("checkpoint " + from + " holds adapters of base '" + saved.base +
                       "', but model.init_from is '" + now.base + "' ('' = the seeded random init)");
    if (saved.method != now.method || saved.r != now.r || saved.target_modules != now.target_modules ||
        saved.double_quant != now.double_quant)
      throw UsageError("checkpoint " + from + " holds " + saved.method + " adapters (r=" + std::to_string(saved.r) +
                       ", layers " + c10::Join(",", saved.target_modules) + "), not those this run's finetune section " +
                       "asks for (" + now.method + ", r=" + std::to_string(now.r) + ", layers " +
                       c10::Join(",", now.target_modules) + ")");
    return;
  }
  if (r.finetune.empty())
    throw UsageError("checkpoint " + from + " holds adapters only (finetune.method " +
                     nlohmann::json::parse(x.model.finetune).value("method", std::string("lora")) +
                     "); resume it with the same finetune section");
  throw UsageError("checkpoint " + from + " holds a whole model, not adapters: start the finetune run from an " +
                   "exported Hub directory (model.init_from) instead");
}

// Resuming restores, besides the tensors, everything the next step depends
// on: the step (which also positions the LR schedule and the sampler, both
// pure functions of it), AdamW's step count, the loss scaler and the RNG.
// Returns the step to start from.
int64_t resume(Run& r) {
  const Config& cfg = r.cfg;
  const std::string from = resume_path(cfg.checkpoint, r.lead);
  if (!cfg.checkpoint.dir.empty() || !from.empty()) {  // only runs that checkpoint need a layout
    r.layout = r.dp().checkpoint_layout();
    r.layout.mesh = r.dims.describe();
    if (auto lora = lora_options(cfg, r.plan.model)) {  // adapters only (Note [PEFT adapter directories])
      r.layout = adapters_only(std::move(r.layout));
      const hub::AdapterSettings settings =
          hub::adapter_settings(r.model(), *lora, cfg.finetune.method, cfg.model.init_from, cfg.finetune.double_quant);
      r.finetune = hub::settings_to_json(settings).dump();
    }
  }
  if (!cfg.checkpoint.dir.empty())
    r.ckpt = std::make_unique<checkpoint::Checkpointer>(
        *r.world->group(),
        checkpoint::CheckpointOptions{cfg.checkpoint.dir, static_cast<int>(cfg.checkpoint.keep), cfg.checkpoint.async,
                                      r.plan.full_state_dict, tokenizer_assets(cfg.data.tokenizer)});
  if (from.empty()) return 0;
  const auto t_load = std::chrono::steady_clock::now();
  check_resumable(checkpoint::read_index(from), from, r);
  checkpoint::OptimizerMoments<optim::AdamW> moments(*r.opt);
  const checkpoint::Index index = checkpoint::load_checkpoint(from, r.layout, &moments);
  r.dp().after_load();
  if (r.scaler && !index.state.loss_scaler.empty())
    r.scaler->load_state(precision::LossScalerState::from_map(index.state.loss_scaler));
  checkpoint::set_cpu_rng_state(index.state.rng_cpu);
  if (r.lead)
    std::printf("scaletrain: resumed from %s (step %lld, saved by %s on %d ranks; loaded in %.3f s)\n", from.c_str(),
                static_cast<long long>(index.state.step), index.strategy.c_str(), index.world_size,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  // Note [FP8 scaling state]: the delayed scales go on where they were.
  const bool delayed = !r.fp8.empty() && cfg.precision.fp8_recipe == "delayed";
  if (delayed && !index.state.fp8_scaling.empty()) {
    try {
      precision::fp8_restore_scaling(r.fp8, index.state.fp8_scaling);
    } catch (const std::invalid_argument& e) {
      throw UsageError("checkpoint " + from + ": " + e.what());
    }
  } else if (r.lead && delayed) {
    std::printf("scaletrain: note: %s holds no FP8 scaling state (saved without delayed FP8 scaling): the scales "
                "start again from 1\n", from.c_str());
  } else if (r.lead && !index.state.fp8_scaling.empty()) {
    std::printf("scaletrain: note: the FP8 scaling state in %s is not used (this run has no delayed FP8 scaling)\n",
                from.c_str());
  }
  return index.state.step;
}

// Predicted next to measured memory (collective); `phase` is "setup" or "end".
void report_memory_now(Run& r, const char* phase) {
  r.mem.states = static_cast<double>(r.dp().model_state_bytes() + r.opt_bytes);
  r.mem.tensors = static_cast<double>(TensorBytes::current());
  report_memory(phase, r.plan.model, r.mem_layout, r.mem, *r.world->group(), r.lead, *r.sink);
}

// Note [Heartbeats]: under `scaletrain launch --heartbeat-timeout` the
// trainer beats on progress: while it sets up, and after every step. A rank
// blocked in a collective makes no progress either, but only because a peer
// does not come; so while this process waits in a collective, a small thread
// beats for it (comm::collectives_waiting()). A rank that was stopped (all its
// threads) or is stuck computing goes silent, and the launcher kills that one.
class CollectiveHeartbeat {
 public:
  CollectiveHeartbeat() {
    if (!std::getenv("SCALETRAIN_HEARTBEAT_FD")) return;
    thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stop_; }))
        if (comm::collectives_waiting() > 0) launch::heartbeat();
    });
  }
  ~CollectiveHeartbeat() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  CollectiveHeartbeat(const CollectiveHeartbeat&) = delete;
  CollectiveHeartbeat& operator=(const CollectiveHeartbeat&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// Where a non-finite gradient first shows on this rank, for the error that
// stops the run: the first parameter (in this rank's layout order) whose
// gradient holds a NaN or an infinity, and the element (in the flattened
// full parameter).
std::string first_nonfinite_grad(Run& r) {
  try {
    const checkpoint::Layout l = r.dp().checkpoint_layout();
    for (const auto& slot : l.slots) {
      const at::Tensor g = slot.tensor.grad();
      if (!g.defined()) continue;
      const at::Tensor flat = g.reshape({-1});
      for (const auto& p : slot.pieces) {
        const at::Tensor bad = flat.narrow(0, p.local_offset, p.numel).isfinite().logical_not().nonzero();
        if (bad.numel() > 0)
          return "; on rank " + std::to_string(r.world->rank()) + " the first parameter with a non-finite gradient is " +
                 p.name + " (element " + std::to_string(p.param_offset + bad[0][0].item<int64_t>()) + ")";
      }
    }
    return "; every gradient on rank " + std::to_string(r.world->rank()) + " is finite";
  } catch (const std::exception&) {
    return "";
  }
}

// The step's MoE statistics of every rank, summed over the job: each rank
// recorded its own layers' forwards on its own micro-batches, so the sums
// cover every layer and sequence once (any dp, ep or pp layout).
void moe_metrics(models::MoeContext& moe, comm::Group& world, StepMetrics& m) {
  const models::MoeStats s = moe.take();
  const int64_t experts = moe.experts;  // the same on every rank, whatever it recorded
  std::vector<double> v{s.aux_sum, s.z_sum, static_cast<double>(s.forwards), static_cast<double>(s.dropped)};
  for (int64_t j = 0; j < experts; ++j)
    v.push_back(j < static_cast<int64_t>(s.tokens_per_expert.size()) ? static_cast<double>(s.tokens_per_expert[j]) : 0.0);
  at::Tensor t = torch::tensor(v, torch::kDouble);
  world.all_reduce(t, comm::ReduceOp::Sum).wait();
  const double* a = t.data_ptr<double>();
  const double forwards = std::max(1.0, a[2]);
  m.moe_aux_loss = a[0] / forwards;
  m.moe_z_loss = a[1] / forwards;
  m.moe_dropped = std::llround(a[3]);
  m.moe_tokens_per_expert.clear();
  for (int64_t j = 0; j < experts; ++j) m.moe_tokens_per_expert.push_back(std::llround(a[4 + j]));
}

// Note [Training step]: forward and backward of every micro-batch (the
// strategy reduces gradients as it goes), the loss scaler's overflow check,
// clipping and the optimizer step unless the step overflowed, the mean loss.
StepMetrics train_step(Run& r, int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  trace::Span step_span("step", "step", step + 1);
  const int64_t B = r.plan.micro_batch, T = r.plan.model.block_size, accum = r.plan.accum;
  const int dp_rank = r.mesh->coord().dp(r.dims);
  DataParallel& dp = r.dp();
  dp.reset_stats();
  const double loss_scale = r.scaler ? r.scaler->scale() : 1.0;
  auto batch = [&](int64_t k) {
    trace::Span span("data", "load micro-batch", k);
    auto idx = r.sampler->indices(step, dp_rank, r.dims.dp(), static_cast<int>(k), static_cast<int>(B));
    // Token ids are read into host memory (page-locked on a GPU), then copied to the device.
    const auto host = torch::TensorOptions().dtype(torch::kLong).pinned_memory(r.plan.cuda);
    std::pair<at::Tensor, at::Tensor> xy{torch::empty({B, T}, host), torch::empty({B, T}, host)};
    r.dataset.copy_batch(idx, xy.first.data_ptr<int64_t>(), xy.second.data_ptr<int64_t>());
    if (r.plan.cuda) xy = {xy.first.to(r.plan.device, /*non_blocking=*/true), xy.second.to(r.plan.device, true)};
    return xy;
  };
  // Packed documents: where micro-batch k's documents are (Note [Packed documents]).
  auto layout = [&](int64_t k) -> std::shared_ptr<const models::SequenceLayout> {
    if (r.cfg.data.pack != "documents") return nullptr;
    auto idx = r.sampler->indices(step, dp_rank, r.dims.dp(), static_cast<int>(k), static_cast<int>(B));
    auto l = std::make_shared<models::SequenceLayout>();
    l->segments = torch::empty({B, T}, torch::kLong);
    l->positions = r.cfg.data.position_reset ? torch::empty({B, T}, torch::kLong)
                                             : torch::arange(T, torch::kLong).expand({B, T}).contiguous();
    r.dataset.copy_layout(idx, l->segments.data_ptr<int64_t>(),
                          r.cfg.data.position_reset ? l->positions.data_ptr<int64_t>() : nullptr);
    if (r.plan.cuda) *l = {l->segments.to(r.plan.device), l->positions.to(r.plan.device)};
    return l;
  };
  // The layout stays set through each micro-batch's backward (which may
  // recompute blocks) and is cleared when the step ends, however it ends.
  struct ClearLayout {
    models::CausalLM& model;
    ~ClearLayout() { model.set_sequence_layout(nullptr); }
  } clear_layout{r.model()};
  int64_t global_targets = 0;
  const std::vector<double> weights = micro_weights(r.dataset, *r.sampler, step, r.mesh->coord().dp(r.dims),
                                                    r.dims.dp(), B, accum, r.cfg.data.loss_on, &global_targets);
  for (auto& l : r.fp8) l->set_loss_multiplier(loss_scale / static_cast<double>(accum));
  // Note [Auxiliary losses] (models/moe.h): their gradient takes the main loss's multiplier.
  const std::shared_ptr<models::MoeContext> moe = r.model().moe();
  if (moe) {
    moe->multiplier = loss_scale / static_cast<double>(accum);
    moe->take();  // what forwards outside training steps recorded
  }
  double loss_sum = 0;
  if (dp.runs_whole_steps()) {  // a pipeline: every micro-batch of the step at once
    std::vector<at::Tensor> xs, ys;
    for (int64_t k = 0; k < accum; ++k) {
      auto [x, y] = batch(k);
      xs.push_back(x);
      ys.push_back(y);
    }
    loss_sum = dp.step(xs, ys, weights, loss_scale, r.plan.policy);
  } else {
    for (int64_t k = 0; k < accum; ++k) {
      auto [inputs, targets] = batch(k);
      std::shared_ptr<const models::SequenceLayout> lay = layout(k);
      double weight = weights[static_cast<size_t>(k)];
      if (r.dims.cp > 1) {  // Note [Context-parallel batches]
        keep_context_part(inputs, targets, lay, r.mesh->coord().cp, r.dims.cp);
        weight = context_weight(targets, global_targets, r.dims.dp(), r.dims.cp);
      }
      r.model().set_sequence_layout(lay);
      const double multiplier = loss_scale * weight;
      for (auto& l : r.fp8) l->set_loss_multiplier(multiplier);
      // What this forward leaves for its backward, counted from before the
      // strategy's forward (which may gather units it keeps until backward).
      const int64_t before_forward = TensorBytes::current();
      loss_sum += dp.forward_backward(
                      [&] {
                        precision::AutocastGuard autocast(r.plan.policy, r.plan.device.type());
                        at::Tensor loss = r.model().loss(inputs, targets) * multiplier;
                        r.mem.activations =
                            std::max(r.mem.activations, static_cast<double>(TensorBytes::current() - before_forward));
                        return loss;
                      },
                      k, accum) /
                  loss_scale;
    }
  }
  // The step's FP8 amaxes, agreed over the ranks that see parts of this
  // batch or pieces of these layers (Note [FP8 linears]).
  precision::fp8_end_step(r.fp8, {&r.mesh->dp_cp(), &r.mesh->tp()});
  bool skipped = false;
  if (r.scaler) {
    std::vector<at::Tensor> grads;
    for (auto& p : r.params) grads.push_back(p.grad());
    skipped = r.scaler->unscale_and_check(grads, dp.grad_groups());
    r.scaler->update(skipped);
  }
  StepMetrics m;
  m.step = step + 1;
  // The global mean loss (one scalar all-reduce), known before the update:
  // a loss that is not finite stops the run with the parameters of the last
  // good step (unless the loss scaler skipped this step: an fp16 overflow it handles).
  auto l = torch::full({1}, loss_sum, torch::kDouble);
  r.mesh->dp_cp().all_reduce(l, comm::ReduceOp::Avg).wait();  // Note [Context-parallel batches]
  m.loss = l.item<double>();
  if (!skipped && !std::isfinite(m.loss))
    throw std::runtime_error("step " + std::to_string(m.step) + ": the loss is " + std::to_string(m.loss) +
                             ", not finite; stopped before the optimizer step (the parameters are step " +
                             std::to_string(step) + "'s; a lower train.lr or train.grad_clip may help)" +
                             first_nonfinite_grad(r));
  m.lr = optim::lr_at(step, r.cfg.train.lr, r.sched);
  if (!skipped) {
    trace::Span span("optimizer", "clip and optimizer step");
    m.grad_norm = dp.clip_grad_norm(r.cfg.train.grad_clip);
    if (!std::isfinite(m.grad_norm))
      throw std::runtime_error("step " + std::to_string(m.step) + ": the gradient norm is " +
                               std::to_string(m.grad_norm) + ", not finite (the loss was " + std::to_string(m.loss) +
                               "); stopped before the optimizer step (the parameters are step " +
                               std::to_string(step) + "'s)" + first_nonfinite_grad(r));
    r.opt->step(m.lr);
    dp.after_step();
  }
  dp.zero_grad();
  m.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  m.tokens_per_s = static_cast<double>(r.cfg.train.global_batch * T) / (m.step_ms / 1000.0);
  m.mfu = m.tokens_per_s / r.world->size() * r.flops_per_token / r.peak_flops;
  m.peak_rss_mb = std::max(r.lifetime_rss_peak_mb, peak_rss_mb());
  if (const DeviceMemory dm = device_memory(r.plan.device); dm.available) {
    m.device_max_allocated_mb = dm.max_allocated_mb;
    m.device_max_reserved_mb = dm.max_reserved_mb;
  }
  m.comm_wait_ms = dp.comm_wait_ms();
  if (moe) moe_metrics(*moe, *r.world->group(), m);
  m.loss_scale = loss_scale;
  m.skipped_steps = r.scaler ? r.scaler->skipped_steps() : 0;
  return m;
}

void save_checkpoint(Run& r, int64_t done) {
  trace::Span span("checkpoint", "save checkpoint", done);
  checkpoint::SaveState st{
      {done, r.opt->steps(), r.scaler ? r.scaler->state().to_map() : std::map<std::string, double>{},
       checkpoint::cpu_rng_state(),
       // Note [FP8 scaling state]: agreed over the whole job (pipeline stages hold different layers).
       precision::fp8_scaling_state(r.fp8, {r.world->group().get()})},
      model_shape(r.plan.model)};
  st.model.finetune = r.finetune;
  const checkpoint::OptimizerMoments<optim::AdamW> moments(*r.opt);
  r.ckpt->save(r.layout, &moments, st);
  if (r.lead)
    std::printf("scaletrain: checkpoint %s %s (training stalled %.3f s)\n",
                r.cfg.checkpoint.async ? "started" : "saved", checkpoint::step_dir(r.cfg.checkpoint.dir, done).c_str(),
                r.ckpt->last_stall_s());
}

// The model's local attention for a scope (Note [Split attention]).
struct UnsplitAttention {
  explicit UnsplitAttention(models::CausalLM& m) : model(m), saved(m.split_attention()) {
    model.set_split_attention(nullptr);
  }
  ~UnsplitAttention() { model.set_split_attention(saved); }
  UnsplitAttention(const UnsplitAttention&) = delete;
  UnsplitAttention& operator=(const UnsplitAttention&) = delete;
  models::CausalLM& model;
  models::SplitAttention saved;
};

// Collective: sharded strategies gather every unit; data-parallel rank 0
// samples (with its tensor-parallel peers, which compute with it, and under
// expert parallelism the rest of its ep group, which hold the other experts:
// each samples the same prompt with the same seed, so all route and draw
// alike), rank 0 prints.
void print_sample(Run& r, data::Tokenizer& tok, const std::string& prompt_text) {
  const Config& cfg = r.cfg;
  r.dp().with_full_parameters([&] {
    if (r.mesh->coord().dp(r.dims) >= r.mesh->ep_size() || r.mesh->coord().pp != 0 || r.mesh->coord().cp != 0)
      return;
    // cp rank 0 samples alone, on whole sequences: its attention is the local one meanwhile.
    UnsplitAttention local(r.model());
    r.model().eval();
    auto ids = tok.encode(prompt_text);
    std::vector<int64_t> ids64(ids.begin(), ids.end());
    auto prompt = torch::tensor(ids64, torch::kLong).view({1, -1}).to(r.plan.device);
    torch::manual_seed(cfg.train.seed);
    at::Tensor out = r.model().generate(prompt, cfg.train.sample_tokens, 0.8, 40).to(at::kCPU);  // host: ids read one by one
    std::vector<uint32_t> gen;
    for (int64_t i = 0; i < out.size(1); ++i) gen.push_back(static_cast<uint32_t>(out[0][i].item<int64_t>()));
    if (!r.lead) return;
    std::printf("sample: %s\n", tok.decode(gen).c_str());
    std::fflush(stdout);
  });
}

}  // namespace

// A restarted attempt adds to the metrics of the attempts before it, after
// a record that says which attempt this is, where it went on from and why.
std::unique_ptr<MetricsSink> open_metrics(const Config& cfg, bool lead, int64_t start) {
  const int attempt = restart_count();
  auto sink = std::make_unique<MetricsSink>(lead ? cfg.metrics.path : "", cfg.train.steps,
                                            cfg.metrics.progress && lead, /*append=*/attempt > 0);
  if (attempt > 0) {
    const char* reason = std::getenv("SCALETRAIN_RESTART_REASON");
    sink->write_record(nlohmann::json{{"record", "restart"},
                                      {"attempt", attempt},
                                      {"resumed_from_step", start},
                                      {"reason", reason ? reason : ""}}
                           .dump());
  }
  return sink;
}

TrainResult run_training(const Config& cfg) {
  // Everything that can be rejected without peers is checked first (one
  // plan, every problem at once), so bad input fails fast and identically on
  // every rank.
  TensorBytes::install();  // before any tensor of the run exists (Note [What is measured])
  const comm::WorldInfo info = comm::world_info_from_env();
  const Plan plan = make_plan(cfg, info.world_size, info.local_rank);
  const std::unique_ptr<data::SampleSource> samples = open_dataset(cfg, plan);
  data::SampleSource& dataset = *samples;
  const std::string data_name = cfg.data.mixture.empty() ? "token file " + cfg.data.path : "data.mixture";
  if (dataset.vocab() > static_cast<uint32_t>(plan.model.vocab_size))
    throw UsageError(data_name + " has vocabulary " + std::to_string(dataset.vocab()) +
                     " but the model's is " + std::to_string(plan.model.vocab_size));
  // The sample's tokenizer must be the one that wrote the token file.
  data::Tokenizer tokenizer(cfg.data.tokenizer);
  if (!cfg.data.tokenizer.empty() && tokenizer.vocab_size() != dataset.vocab())
    throw UsageError("data.tokenizer " + cfg.data.tokenizer + " has vocabulary " +
                     std::to_string(tokenizer.vocab_size()) + " but " + data_name + " has " +
                     std::to_string(dataset.vocab()) + " (prepare it with --tokenizer " + cfg.data.tokenizer + ")");
  // Before any work, so a sample_chat without a template fails in milliseconds.
  const std::string sample_prompt = cfg.train.sample_tokens > 0 ? sample_prompt_text(cfg) : "";

  Run r{cfg, plan, dataset, plan.dims};
  CollectiveHeartbeat collective_heartbeat;
  launch::heartbeat();  // the launcher's watchdog (--heartbeat-timeout) is armed from here
  setup(r, info);
  launch::heartbeat();
  print_start(r, info);
  const int64_t start = resume(r);
  launch::heartbeat();
  const int64_t stop = cfg.train.stop_at > 0 ? cfg.train.stop_at : cfg.train.steps;
  r.sink = open_metrics(cfg, r.lead, start);
  r.mem_layout = run_layout(cfg, plan, r.world->size(), r.mesh->dp_shard_cp().size(), plan.accum,
                            r.world->backend() == comm::BackendKind::Gloo);
  r.mem.rss_baseline_mb = r.rss_before_setup;
  r.mem.rss_peak_mb = current_rss_mb();
  report_memory_now(r, "setup");
  // From here on the peaks are the training steps' (the setup peak was logged above).
  r.lifetime_rss_peak_mb = peak_rss_mb();
  release_free_heap();
  reset_rss_peak();
  reset_device_peaks(plan.device);
  TensorBytes::reset_peak();

  // Note [Tracing] (util/trace.h), Note [Communication profile] (comm/group.h).
  StepTracer tracer(cfg.metrics, *r.world, r.dp().describe());
  if (tracer.active() && r.lead && start >= cfg.metrics.trace_steps[1])
    std::printf("scaletrain: note: metrics.trace_steps %lld-%lld were done before the resumed step %lld: nothing to "
                "trace\n",
                static_cast<long long>(cfg.metrics.trace_steps[0]), static_cast<long long>(cfg.metrics.trace_steps[1]),
                static_cast<long long>(start + 1));
  comm::reset_comm_profile();
  std::vector<double> bubbles;
  std::optional<double> expected_bubble;

  TrainResult result;
  std::vector<double> throughput;
  r.model().train();
  for (int64_t step = start; step < stop; ++step) {
    tracer.begin_step(step + 1);
    const StepMetrics m = train_step(r, step);
    if (const auto b = r.dp().pipeline_bubble()) {
      bubbles.push_back(b->measured);
      expected_bubble = b->expected;
    }
    launch::heartbeat();
    result.losses.push_back(m.loss);
    if (step > start) throughput.push_back(m.tokens_per_s);
    if (r.lead) r.sink->write(m, m.step % cfg.metrics.log_every == 0 || m.step == cfg.train.steps);
    const bool save_due =
        cfg.checkpoint.every > 0 ? m.step % cfg.checkpoint.every == 0 || m.step == stop : m.step == stop;
    if (r.ckpt && save_due) {
      save_checkpoint(r, m.step);
      launch::heartbeat();
    }
    tracer.end_step(m.step);
  }
  if (r.ckpt) r.ckpt->finish();  // commits an asynchronous save (collective)
  tracer.finish();
  if (bubbles.size() > 1) bubbles.erase(bubbles.begin());  // the first step warms up
  report_comm_summary(*r.world, stop - start, bubbles, expected_bubble, r.lead, *r.sink);

  r.mem.tensor_peak = static_cast<double>(TensorBytes::peak());
  r.mem.rss_peak_mb = rss_peak_mb();
  r.mem.rss_file_growth_mb = rss_file_mb() - r.rss_file_before_setup;
  r.mem.heap_free_mb = heap_free_mb();
  report_memory_now(r, "end");
  if (r.lead) {
    std::printf("scaletrain: model states at the end %.1f MiB/rank (params+grads %.1f, optimizer %.1f)\n",
                (r.dp().model_state_bytes() + r.opt_bytes) / 1048576.0, r.dp().model_state_bytes() / 1048576.0,
                r.opt_bytes / 1048576.0);
    std::fflush(stdout);
  }
  if (!throughput.empty()) {
    std::sort(throughput.begin(), throughput.end());
    result.tokens_per_s = throughput[throughput.size() / 2];
  }
  if (cfg.train.sample_tokens > 0) print_sample(r, tokenizer, sample_prompt);
  r.world->group()->barrier().wait();
  return result;
}

}  // namespace scaletrain::train

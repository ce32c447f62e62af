// Building a run (run_internal.h): joining the job, the world and the mesh,
// the model wrapped by its strategy (parallelize), the optimizer, the loss
// scaler and the sampler; and the lines the lead rank prints at the start.
#include "scaletrain/train/run_internal.h"

#include <malloc.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/checkpoint.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/observe/memory.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/plan/device.h"
#include "scaletrain/train/module_trainer.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/recipe.h"

namespace scaletrain::train::detail {
namespace {

// ", fp8 linears (hybrid, delayed scaling over 1024 steps, margin 0), O1;
// gradients travel as FP8 E5M2" or "".
std::string fp8_description(const config::Config& c, const Plan& plan) {
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
  if (const auto wire = plan.engines.ddp.fp8_comm)
    out += std::string("; gradients travel as FP8 ") + (*wire == precision::Fp8Format::E5M2 ? "E5M2" : "E4M3");
  return out;
}

}  // namespace

// Threads per rank: what the launcher decided (SCALETRAIN_THREADS or
// OMP_NUM_THREADS), else libtorch's default.
void set_threads() {
  for (const char* var : {"SCALETRAIN_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(var)) {
      int n = std::atoi(v);
      if (n > 0) {
        observe::set_compute_threads(n);
        return;
      }
    }
  }
}

// Joins the job and builds the mesh, the model, its strategy and the optimizer.
void setup(Run& r, const comm::WorldInfo& info) {
  const config::Config& cfg = r.cfg;
  set_threads();
  // Note [One device per rank]: the device is current before anything is
  // allocated or NCCL starts, and the backend follows the device unless forced.
  use_device(r.plan.device);
  comm::WorldOptions wo;
  wo.backend = comm::parse_backend(cfg.parallel.backend);
  // CUDA tensors: auto is NCCL where this build has it (comm/world.h), Gloo otherwise.
  if (wo.backend == comm::Backend::Auto && !r.plan.cuda) wo.backend = comm::Backend::Gloo;
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.parallel.timeout_s * 1000));
  wo.debug_collectives = cfg.parallel.debug_collectives;
  r.world = comm::World::init(info, wo);
  std::string settings;  // Note [Same on every rank] (comm/world.cpp)
  for (const std::string& key : config::config_keys()) settings += key + "=" + config::config_value(cfg, key) + "\n";
  r.world->check_same_everywhere("resolved config", settings);
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
  r.rss_before_setup = observe::current_rss_mb();
  r.rss_file_before_setup = observe::rss_file_mb();
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  r.par = parallelize(r.plan, *r.world, *r.mesh);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  r.setup_peak_mb = observe::peak_rss_mb() - r.rss_before_setup;
  r.model().set_activation_checkpointing(models::parse_activation_checkpointing(cfg.model.activation_checkpointing));
  if (cfg.precision.fp8) r.fp8 = models::use_fp8(r.model(), precision::fp8_linear_options(cfg.precision));

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
  r.sched = schedule_options(cfg.train);
  if (r.plan.policy.loss_scaling)
    r.scaler = std::make_unique<precision::LossScaler>(precision::loss_scaler_options(cfg.precision));
  data::SamplerOptions so;
  so.seed = cfg.train.seed;
  so.global_batch = cfg.train.global_batch;
  r.sampler = std::make_unique<data::DistributedSampler>(r.dataset.num_samples(), so);
  // A GPU's peak is measured there in bf16; metrics.peak_flops gives the data-sheet figure instead.
  r.peak_flops = cfg.metrics.peak_flops > 0 ? cfg.metrics.peak_flops
                 : r.plan.cuda              ? observe::measure_device_gemm_flops()
                                            : observe::measure_gemm_flops();
  r.flops_per_token =
      r.model().step_flops_per_token(r.plan.model.block_size);  // once: which weights train does not change
}

void print_start(Run& r, const comm::WorldInfo& info) {
  if (!r.lead) return;
  const config::Config& cfg = r.cfg;
  std::printf(
      "scaletrain: %s, %lld parameters, world %d (%s), mesh %s, %s%s\n", cfg.model.preset.c_str(),
      static_cast<long long>(r.model().num_parameters()), r.world->size(), info.source.c_str(),
      (r.dims.describe() + (r.dims.cp > 1 ? " (" + cfg.parallel.cp_mode + " attention)" : "")).c_str(),
      ((r.world->backend() == comm::BackendKind::Nccl ? "nccl" : "gloo") + std::string(" on ") + r.plan.device.str())
          .c_str(),
      r.world->debug_collectives() && r.world->size() > 1
          ? "; every collective's fingerprint compared across ranks first (debug_collectives)"
          : "");
  if (const auto& lora = r.plan.engines.start.lora) {
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
  if (torch::get_num_threads() > 1 && observe::blas_threading() == "pthreads")
    std::printf(
        "scaletrain: notice: the BLAS is OpenBLAS's pthreads build, whose threads contend with libtorch's: "
        "install libopenblas0-openmp and select it as libblas.so.3 for threads that pay "
        "(docs/kernels.md, \"Threads\")\n");
  std::printf("scaletrain: data: %s; loss on %s tokens\n", r.dataset.describe().c_str(), cfg.data.loss_on.c_str());
  std::printf(
      "scaletrain: strategy %s; precision: %s; model states %.1f MiB/rank (params+grads %.1f, "
      "optimizer %.1f); setup peak +%.1f MiB RSS\n",
      r.dp().describe().c_str(), (r.plan.policy.describe() + fp8_description(cfg, r.plan)).c_str(),
      (r.dp().model_state_bytes() + r.opt_bytes) / 1048576.0, r.dp().model_state_bytes() / 1048576.0,
      r.opt_bytes / 1048576.0, r.setup_peak_mb);
  // Accepted settings that work differently here, once: from config files
  // (DeepSpeed, Accelerate) and from the plan.
  for (const auto& n : cfg.notices) std::printf("scaletrain: note: %s\n", n.c_str());
  for (const auto& n : r.plan.notices) std::printf("scaletrain: note: %s\n", n.c_str());
  std::fflush(stdout);
}

}  // namespace scaletrain::train::detail

#include "scaletrain/train/trainer.h"

#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/pipeline/schedule.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/memory_report.h"
#include "scaletrain/train/metrics.h"
#include "scaletrain/train/model_config.h"
#include "scaletrain/train/strategy.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

// The preset with model.* over it, or model.init_from's dimensions (train/model_config.h).
models::GPTConfig model_config(const ModelOptions& m) { return resolve_model_config(m); }

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

// Pipeline keys, and the schedule's shape, before any peer is contacted.
void check_pipeline(const Config& c, const models::GPTConfig& m, int dp) {
  const auto& p = c.parallel;
  if (p.pp < 1) throw UsageError("parallel.pp must be at least 1, got " + std::to_string(p.pp));
  if (p.pp == 1) {
    if (p.virtual_stages != 1 || p.microbatches != 0)
      throw UsageError("parallel.virtual_stages and parallel.microbatches apply to pipelines (parallel.pp > 1)");
    return;
  }
  if (c.train.sample_tokens > 0)
    throw UsageError("sampling a pipeline-parallel model is not available; set train.sample_tokens=0");
  if (p.tp > 1 && p.strategy != "ddp")
    throw UsageError("parallel.tp=" + std::to_string(p.tp) + " with parallel.pp composes with strategy ddp only (got '" +
                     p.strategy + "')");
  if (p.microbatches < 0) throw UsageError("parallel.microbatches must be positive");
  if (p.microbatches > 0 && c.train.global_batch % (static_cast<int64_t>(p.microbatches) * dp) != 0)
    throw UsageError("train.global_batch=" + std::to_string(c.train.global_batch) + " is not divisible by " +
                     "parallel.microbatches=" + std::to_string(p.microbatches) + " x dp=" + std::to_string(dp));
  if (m.n_layer < static_cast<int64_t>(p.pp) * p.virtual_stages)
    throw UsageError("model.n_layer=" + std::to_string(m.n_layer) + " blocks cannot fill parallel.pp=" +
                     std::to_string(p.pp) + " x virtual_stages=" + std::to_string(p.virtual_stages) + " chunks");
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

// The checkpoint to resume from per checkpoint.resume, or "" for a fresh start.
std::string resume_path(const CheckpointingOptions& c) {
  if (c.resume == "never") return "";
  if (c.resume == "auto") return c.dir.empty() ? "" : checkpoint::newest_checkpoint(c.dir).value_or("");
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(c.resume) / "index.json")) return c.resume;         // a step directory
  if (auto newest = checkpoint::newest_checkpoint(c.resume)) return *newest;  // a root of step directories
  throw UsageError("checkpoint.resume=" + c.resume + " is not a complete checkpoint nor a directory holding one");
}

checkpoint::ModelShape model_shape(const models::GPTConfig& m) {
  return {m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.bias};
}

}  // namespace

TrainResult run_training(const Config& cfg) {
  // Everything that can be rejected without peers is checked first, so bad
  // input fails fast and identically on every rank.
  TensorBytes::install();  // before any tensor of the run exists (Note [What is measured])
  if (comm::world_info_from_env().rank == 0)  // accepted config keys without effect here, once
    for (const auto& n : cfg.notices) std::printf("scaletrain: note: %s\n", n.c_str());
  const models::GPTConfig mcfg = model_config(cfg.model);
  if (cfg.parallel.tp > 1) parallel::tensor::check_tensor_parallel(mcfg, cfg.parallel.tp);
  const bool cuda = false;  // the trainer computes on CPU (CUDA placement is not wired yet)
  const precision::PrecisionPolicy policy = precision::PrecisionPolicy::from_options(cfg.precision, cuda);
  check_strategy(cfg, cuda);
  if (policy.param != at::kFloat &&
      (cfg.parallel.strategy == "ddp" || cfg.parallel.fsdp.sharding_strategy == "NO_SHARD"))
    throw UsageError("precision.param_dtype=" + precision::dtype_name(policy.param) +
                     " needs fp32 master weights, which the sharded strategies keep (zero1-3, fsdp); ddp has none");
  if (policy.reduce == at::kHalf)
    throw UsageError("precision.reduce_dtype=fp16 needs CUDA (Gloo sums 16-bit payloads only as bf16 here)");
  if (cfg.data.path.empty()) throw UsageError("data.path is not set (a token file from `scaletrain prepare`)");
  data::TokenDataset dataset(cfg.data.path, data::DatasetOptions{mcfg.block_size});
  if (dataset.vocab() > static_cast<uint32_t>(mcfg.vocab_size))
    throw UsageError("token file " + cfg.data.path + " has vocabulary " + std::to_string(dataset.vocab()) +
                     " but the model's is " + std::to_string(mcfg.vocab_size));
  const comm::WorldInfo info = comm::world_info_from_env();
  comm::MeshDims dims{cfg.parallel.pp, cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp};
  dims = dims.resolved(info.world_size);
  data::SamplerOptions so;
  so.seed = cfg.train.seed;
  so.global_batch = cfg.train.global_batch;
  data::DistributedSampler sampler(dataset.num_samples(), so);
  check_pipeline(cfg, mcfg, dims.dp());
  // A pipeline's parallel.microbatches, when set, decides the micro-batch size.
  const int64_t B = cfg.parallel.pp > 1 && cfg.parallel.microbatches > 0
                        ? cfg.train.global_batch / (static_cast<int64_t>(cfg.parallel.microbatches) * dims.dp())
                        : cfg.train.micro_batch;
  sampler.validate_layout(dims.dp(), static_cast<int>(B));
  const int64_t accum = sampler.micro_batches_per_step(dims.dp(), static_cast<int>(B));
  if (cfg.parallel.pp > 1)
    parallel::pipeline::check_schedule({parallel::pipeline::parse_schedule(cfg.parallel.schedule), cfg.parallel.pp,
                                        static_cast<int>(accum), cfg.parallel.virtual_stages});

  set_threads();
  comm::WorldOptions wo;
  wo.backend = comm::parse_backend(cfg.parallel.backend);
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.parallel.timeout_s * 1000));
  auto world = comm::World::init(info, wo);
  comm::Mesh mesh(*world, dims);
  const bool lead = world->rank() == 0;

  // Setup memory: the peak resident set while the model is built and wrapped,
  // above what the process held before (an upper bound: an earlier peak counts).
  // Note [Setup memory and glibc]: glibc raises its mmap threshold to the
  // size of any large block freed (up to 32 MiB), after which tensors of that
  // size come from the heap and stay resident when freed: a model built and
  // sharded one tensor at a time would still leave its whole size in RSS.
  // During setup large blocks are mmap'd (returned to the OS on free); after
  // it the threshold is fixed where the dynamic rule would have taken it, so
  // per-step temporaries are reused without page faults.
  const double rss_before_setup = current_rss_mb(), rss_file_before_setup = rss_file_mb();
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  Parallelized par = parallelize(cfg, mcfg, *world, mesh, policy);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  const double setup_peak_mb = peak_rss_mb() - rss_before_setup;
  models::GPT model = par.model;
  model->set_activation_checkpointing(models::parse_activation_checkpointing(cfg.model.activation_checkpointing));
  DataParallel& dp = *par.dp;

  std::vector<at::Tensor> params = dp.optimizer_params();
  optim::AdamWOptions ao;
  ao.lr = cfg.train.lr;
  ao.beta1 = cfg.train.beta1;
  ao.beta2 = cfg.train.beta2;
  ao.eps = cfg.train.eps;
  ao.weight_decay = cfg.train.weight_decay;
  if (cfg.parallel.zero.offload_optimizer == "nvme") ao.state_dir = cfg.parallel.zero.offload_dir;
  optim::AdamW opt(params, dp.decay_numel(), ao);
  const optim::ScheduleOptions sched = schedule(cfg.train);
  std::unique_ptr<precision::LossScaler> scaler;
  if (policy.loss_scaling)
    scaler = std::make_unique<precision::LossScaler>(precision::loss_scaler_options(cfg.precision));
  int64_t opt_bytes = 0;
  for (size_t i = 0; i < opt.exp_avg().size(); ++i)
    opt_bytes += opt.exp_avg()[i].nbytes() + opt.exp_avg_sq()[i].nbytes();

  const double peak = cfg.metrics.peak_flops > 0 ? cfg.metrics.peak_flops : measure_gemm_flops();
  const double flops_per_token = model->flops_per_token(mcfg.block_size);
  if (lead) {
    std::printf("scaletrain: %s, %lld parameters, world %d (%s), mesh %s, %s\n", cfg.model.preset.c_str(),
                static_cast<long long>(model->num_parameters()), world->size(), info.source.c_str(),
                dims.describe().c_str(), world->backend() == comm::BackendKind::Nccl ? "nccl" : "gloo");
    std::printf(
        "scaletrain: %lld samples of %lld tokens; global batch %lld = micro %lld x accumulation %lld x dp %d; "
        "%d threads/rank; peak %.1f GFLOP/s/rank\n",
        static_cast<long long>(dataset.num_samples()), static_cast<long long>(mcfg.block_size),
        static_cast<long long>(cfg.train.global_batch), static_cast<long long>(B),
        static_cast<long long>(accum), dims.dp(), torch::get_num_threads(), peak / 1e9);
    std::printf(
        "scaletrain: strategy %s; precision: %s; model states %.1f MiB/rank (params+grads %.1f, "
        "optimizer %.1f); setup peak +%.1f MiB RSS\n",
        dp.describe().c_str(), policy.describe().c_str(), (dp.model_state_bytes() + opt_bytes) / 1048576.0,
        dp.model_state_bytes() / 1048576.0, opt_bytes / 1048576.0, setup_peak_mb);
    std::fflush(stdout);
  }
  // Resuming restores, besides the tensors, everything the next step depends
  // on: the step (which also positions the LR schedule and the sampler, both
  // pure functions of it), AdamW's step count, the loss scaler and the RNG.
  const std::string from = resume_path(cfg.checkpoint);
  checkpoint::Layout layout;
  if (!cfg.checkpoint.dir.empty() || !from.empty()) {  // only runs that checkpoint need a layout
    layout = dp.checkpoint_layout();
    layout.mesh = dims.describe();
  }
  int64_t start = 0;
  if (!from.empty()) {
    const auto t_load = std::chrono::steady_clock::now();
    const checkpoint::Index index = checkpoint::load_checkpoint(from, layout, &opt);
    dp.after_load();
    if (scaler && !index.state.loss_scaler.empty())
      scaler->load_state(precision::LossScalerState::from_map(index.state.loss_scaler));
    checkpoint::set_cpu_rng_state(index.state.rng_cpu);
    start = index.state.step;
    if (lead)
      std::printf("scaletrain: resumed from %s (step %lld, saved by %s on %d ranks; loaded in %.3f s)\n", from.c_str(),
                  static_cast<long long>(start), index.strategy.c_str(), index.world_size,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  }
  std::unique_ptr<checkpoint::Checkpointer> ckpt;
  if (!cfg.checkpoint.dir.empty())
    ckpt = std::make_unique<checkpoint::Checkpointer>(
        *world->group(),
        checkpoint::CheckpointOptions{cfg.checkpoint.dir, static_cast<int>(cfg.checkpoint.keep), cfg.checkpoint.async});
  const int64_t stop = cfg.train.stop_at > 0 ? cfg.train.stop_at : cfg.train.steps;
  auto save_due = [&](int64_t done) {
    return ckpt && ((cfg.checkpoint.every > 0 && done % cfg.checkpoint.every == 0) || done == stop);
  };

  MetricsSink sink(lead ? cfg.metrics.path : "", cfg.train.steps, cfg.metrics.progress && lead);

  // Predicted next to measured memory, after setup and at the end (collective).
  const estimate::Layout mem_layout = run_layout(cfg, mcfg, policy, world->size(), mesh.dp_shard().size(), B, accum,
                                                 world->backend() == comm::BackendKind::Gloo);
  MeasuredMemory mem;
  mem.rss_baseline_mb = rss_before_setup;
  mem.states = static_cast<double>(dp.model_state_bytes() + opt_bytes);
  mem.tensors = static_cast<double>(TensorBytes::current());
  mem.rss_peak_mb = current_rss_mb();
  report_memory("setup", mcfg, mem_layout, mem, *world->group(), lead, sink);
  // From here on the peaks are the training steps' (the setup peak was logged above).
  const double lifetime_rss_peak_mb = peak_rss_mb();
  reset_rss_peak();
  TensorBytes::reset_peak();

  const int64_t T = mcfg.block_size;
  auto inputs = torch::empty({B, T}, torch::kLong), targets = torch::empty({B, T}, torch::kLong);
  const int dp_rank = mesh.coord().dp(dims);
  TrainResult result;
  std::vector<double> throughput;
  model->train();
  for (int64_t step = start; step < stop; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    dp.reset_stats();
    double loss_sum = 0;
    const double loss_scale = scaler ? scaler->scale() : 1.0;
    if (dp.runs_whole_steps()) {  // a pipeline: every micro-batch of the step at once
      std::vector<at::Tensor> xs, ys;
      for (int64_t k = 0; k < accum; ++k) {
        auto idx = sampler.indices(step, dp_rank, dims.dp(), static_cast<int>(k), static_cast<int>(B));
        xs.push_back(torch::empty({B, T}, torch::kLong));
        ys.push_back(torch::empty({B, T}, torch::kLong));
        dataset.copy_batch(idx, xs.back().data_ptr<int64_t>(), ys.back().data_ptr<int64_t>());
      }
      loss_sum = dp.step(xs, ys, loss_scale, policy);
    }
    for (int64_t k = 0; k < accum && !dp.runs_whole_steps(); ++k) {
      auto idx = sampler.indices(step, dp_rank, dims.dp(), static_cast<int>(k), static_cast<int>(B));
      dataset.copy_batch(idx, inputs.data_ptr<int64_t>(), targets.data_ptr<int64_t>());
      // What this forward leaves for its backward, counted from before the
      // strategy's forward (which may gather units it keeps until backward).
      const int64_t before_forward = TensorBytes::current();
      loss_sum += dp.forward_backward(
                      [&] {
                        precision::AutocastGuard autocast(policy, at::kCPU);
                        at::Tensor loss = model->loss(inputs, targets) * (loss_scale / static_cast<double>(accum));
                        mem.activations =
                            std::max(mem.activations, static_cast<double>(TensorBytes::current() - before_forward));
                        return loss;
                      },
                      k, accum) /
                  loss_scale;
    }
    double norm = 0;
    bool skipped = false;
    if (scaler) {
      std::vector<at::Tensor> grads;
      for (auto& p : params) grads.push_back(p.grad());
      skipped = scaler->unscale_and_check(grads, dp.grad_groups());
      scaler->update(skipped);
    }
    const double lr = optim::lr_at(step, cfg.train.lr, sched);
    if (!skipped) {
      norm = dp.clip_grad_norm(cfg.train.grad_clip);
      opt.step(lr);
      dp.after_step();
    }
    dp.zero_grad();
    // Report the global mean loss (one scalar all-reduce).
    auto l = torch::full({1}, loss_sum, torch::kDouble);
    mesh.dp().all_reduce(l, comm::ReduceOp::Avg).wait();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    StepMetrics m;
    m.step = step + 1;
    m.loss = l.item<double>();
    m.lr = lr;
    m.step_ms = ms;
    m.tokens_per_s = static_cast<double>(cfg.train.global_batch * T) / (ms / 1000.0);
    m.mfu = m.tokens_per_s / world->size() * flops_per_token / peak;
    m.peak_rss_mb = std::max(lifetime_rss_peak_mb, peak_rss_mb());
    m.comm_wait_ms = dp.comm_wait_ms();
    m.grad_norm = norm;
    m.loss_scale = loss_scale;
    m.skipped_steps = scaler ? scaler->skipped_steps() : 0;
    result.losses.push_back(m.loss);
    if (step > start) throughput.push_back(m.tokens_per_s);
    if (lead) sink.write(m, (step + 1) % cfg.metrics.log_every == 0 || step + 1 == cfg.train.steps);
    if (save_due(step + 1)) {
      checkpoint::SaveState st{
          {step + 1, opt.steps(), scaler ? scaler->state().to_map() : std::map<std::string, double>{},
           checkpoint::cpu_rng_state()},
          model_shape(mcfg)};
      ckpt->save(layout, &opt, st);
      if (lead)
        std::printf("scaletrain: checkpoint %s %s (training stalled %.3f s)\n",
                    cfg.checkpoint.async ? "started" : "saved",
                    checkpoint::step_dir(cfg.checkpoint.dir, step + 1).c_str(), ckpt->last_stall_s());
    }
  }
  if (ckpt) ckpt->finish();  // commits an asynchronous save (collective)
  mem.states = static_cast<double>(dp.model_state_bytes() + opt_bytes);
  mem.tensors = static_cast<double>(TensorBytes::current());
  mem.tensor_peak = static_cast<double>(TensorBytes::peak());
  mem.rss_peak_mb = rss_peak_mb();
  mem.rss_file_growth_mb = rss_file_mb() - rss_file_before_setup;
  mem.heap_free_mb = heap_free_mb();
  report_memory("end", mcfg, mem_layout, mem, *world->group(), lead, sink);
  if (lead) {
    std::printf("scaletrain: model states at the end %.1f MiB/rank (params+grads %.1f, optimizer %.1f)\n",
                (dp.model_state_bytes() + opt_bytes) / 1048576.0, dp.model_state_bytes() / 1048576.0,
                opt_bytes / 1048576.0);
    std::fflush(stdout);
  }
  if (!throughput.empty()) {
    std::sort(throughput.begin(), throughput.end());
    result.tokens_per_s = throughput[throughput.size() / 2];
  }
  if (cfg.train.sample_tokens > 0) {
    // Collective: sharded strategies gather every unit; data-parallel rank 0
    // samples (with its tensor-parallel peers, which compute with it), rank 0 prints.
    dp.with_full_parameters([&] {
      if (mesh.coord().dp(dims) != 0 || mesh.coord().pp != 0) return;
      model->eval();
      data::ByteTokenizer tok;
      auto ids = tok.encode(cfg.train.sample_prompt.empty() ? "\n" : cfg.train.sample_prompt);
      std::vector<int64_t> ids64(ids.begin(), ids.end());
      auto prompt = torch::tensor(ids64, torch::kLong).view({1, -1});
      torch::manual_seed(cfg.train.seed);
      at::Tensor out = model->generate(prompt, cfg.train.sample_tokens, 0.8, 40);
      std::vector<uint16_t> gen;
      for (int64_t i = 0; i < out.size(1); ++i) gen.push_back(static_cast<uint16_t>(out[0][i].item<int64_t>()));
      if (!lead) return;
      std::printf("sample: %s\n", tok.decode(gen).c_str());
      std::fflush(stdout);
    });
  }
  world->group()->barrier().wait();
  return result;
}

}  // namespace scaletrain::train

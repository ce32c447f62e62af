#include "scaletrain/train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/train/metrics.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

models::GPTConfig model_config(const ModelOptions& m) {
  models::GPTConfig c = models::gpt_preset(m.preset);
  if (m.n_layer) c.n_layer = m.n_layer;
  if (m.n_head) c.n_head = m.n_head;
  if (m.n_embd) c.n_embd = m.n_embd;
  if (m.block_size) c.block_size = m.block_size;
  if (m.vocab_size) c.vocab_size = m.vocab_size;
  c.dropout = m.dropout;
  c.validate();
  return c;
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

void check_supported(const ParallelOptions& p) {
  if (p.strategy != "ddp")
    throw UsageError("parallel.strategy '" + p.strategy + "' is not available in this build (supported: ddp)");
  if (p.tp != 1 || p.pp != 1)
    throw UsageError("parallel.tp=" + std::to_string(p.tp) + " and parallel.pp=" + std::to_string(p.pp) +
                     ": tensor and pipeline parallelism are not available yet (both must be 1)");
}

}  // namespace

TrainResult run_training(const Config& cfg) {
  // Everything that can be rejected without peers is checked first, so bad
  // input fails fast and identically on every rank.
  check_supported(cfg.parallel);
  const models::GPTConfig mcfg = model_config(cfg.model);
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
  sampler.validate_layout(dims.dp(), static_cast<int>(cfg.train.micro_batch));
  const int64_t accum = sampler.micro_batches_per_step(dims.dp(), static_cast<int>(cfg.train.micro_batch));

  set_threads();
  comm::WorldOptions wo;
  wo.backend = comm::parse_backend(cfg.parallel.backend);
  wo.timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.parallel.timeout_s * 1000));
  auto world = comm::World::init(info, wo);
  comm::Mesh mesh(*world, dims);
  const bool lead = world->rank() == 0;

  torch::manual_seed(cfg.train.seed);
  auto model = models::GPT(mcfg);
  parallel::DDPOptions ddp_opts;
  ddp_opts.bucket_cap_bytes = static_cast<int64_t>(cfg.parallel.bucket_cap_mb * (1 << 20));
  ddp_opts.first_bucket_cap_bytes = static_cast<int64_t>(cfg.parallel.first_bucket_mb * (1 << 20));
  ddp_opts.find_unused_parameters = cfg.parallel.find_unused_parameters;
  ddp_opts.comm_dtype = cfg.parallel.comm_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  parallel::DistributedDataParallel ddp(model.ptr(), mesh.dp(), ddp_opts);

  std::vector<at::Tensor> params = model->parameters();
  optim::AdamWOptions ao;
  ao.lr = cfg.train.lr;
  ao.beta1 = cfg.train.beta1;
  ao.beta2 = cfg.train.beta2;
  ao.weight_decay = cfg.train.weight_decay;
  optim::AdamW opt(params, optim::decay_matrices(params), ao);
  optim::ScheduleOptions sched{cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio};

  const double peak = cfg.metrics.peak_flops > 0 ? cfg.metrics.peak_flops : measure_gemm_flops();
  const double flops_per_token = model->flops_per_token(mcfg.block_size);
  if (lead) {
    std::printf("scaletrain: %s, %lld parameters, world %d (%s), mesh %s, %s\n", cfg.model.preset.c_str(),
                static_cast<long long>(model->num_parameters()), world->size(), info.source.c_str(),
                dims.describe().c_str(), world->backend() == comm::BackendKind::Nccl ? "nccl" : "gloo");
    std::printf("scaletrain: %lld samples of %lld tokens; global batch %lld = micro %lld x accumulation %lld x dp %d; "
                "%d DDP buckets; %d threads/rank; peak %.1f GFLOP/s/rank\n",
                static_cast<long long>(dataset.num_samples()), static_cast<long long>(mcfg.block_size),
                static_cast<long long>(cfg.train.global_batch), static_cast<long long>(cfg.train.micro_batch),
                static_cast<long long>(accum), dims.dp(), ddp.num_buckets(), torch::get_num_threads(), peak / 1e9);
    std::fflush(stdout);
  }
  MetricsSink sink(lead ? cfg.metrics.path : "", cfg.train.steps, cfg.metrics.progress && lead);

  const int64_t B = cfg.train.micro_batch, T = mcfg.block_size;
  auto inputs = torch::empty({B, T}, torch::kLong), targets = torch::empty({B, T}, torch::kLong);
  const int dp_rank = mesh.coord().dp(dims);
  TrainResult result;
  std::vector<double> throughput;
  model->train();
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    ddp.reset_stats();
    double loss_sum = 0;
    for (int64_t k = 0; k < accum; ++k) {
      auto idx = sampler.indices(step, dp_rank, dims.dp(), static_cast<int>(k), static_cast<int>(B));
      dataset.copy_batch(idx, inputs.data_ptr<int64_t>(), targets.data_ptr<int64_t>());
      auto loss = model->loss(inputs, targets) / static_cast<double>(accum);
      if (k + 1 < accum) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();  // gradients are averaged across dp when this returns
      }
      loss_sum += loss.item<double>();
    }
    const double norm = optim::clip_grad_norm(params, cfg.train.grad_clip);
    const double lr = optim::lr_at(step, cfg.train.lr, sched);
    opt.step(lr);
    opt.zero_grad();
    // Report the global mean loss (one scalar all-reduce).
    auto l = torch::full({1}, loss_sum, torch::kDouble);
    mesh.dp().all_reduce(l, comm::ReduceOp::Avg).wait();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    StepMetrics m;
    m.step = step + 1;
    m.loss = l.item<double>();
    m.lr = lr;
    m.step_ms = ms;
    m.tokens_per_s = static_cast<double>(cfg.train.global_batch * T) / (ms / 1000.0);
    m.mfu = m.tokens_per_s / world->size() * flops_per_token / peak;
    m.peak_rss_mb = peak_rss_mb();
    m.comm_wait_ms = ddp.comm_wait_ms();
    m.grad_norm = norm;
    result.losses.push_back(m.loss);
    if (step > 0) throughput.push_back(m.tokens_per_s);
    if (lead) sink.write(m, (step + 1) % cfg.metrics.log_every == 0 || step + 1 == cfg.train.steps);
  }
  if (!throughput.empty()) {
    std::sort(throughput.begin(), throughput.end());
    result.tokens_per_s = throughput[throughput.size() / 2];
  }
  if (lead && cfg.train.sample_tokens > 0) {
    model->eval();
    data::ByteTokenizer tok;
    auto ids = tok.encode(cfg.train.sample_prompt.empty() ? "\n" : cfg.train.sample_prompt);
    std::vector<int64_t> ids64(ids.begin(), ids.end());
    auto prompt = torch::tensor(ids64, torch::kLong).view({1, -1});
    torch::manual_seed(cfg.train.seed);
    auto out = model->generate(prompt, cfg.train.sample_tokens, 0.8, 40);
    std::vector<uint16_t> gen;
    for (int64_t i = 0; i < out.size(1); ++i) gen.push_back(static_cast<uint16_t>(out[0][i].item<int64_t>()));
    std::printf("sample: %s\n", tok.decode(gen).c_str());
    std::fflush(stdout);
  }
  world->group()->barrier().wait();
  return result;
}

}  // namespace scaletrain::train

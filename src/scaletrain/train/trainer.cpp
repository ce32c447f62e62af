// Our families' runs (run_training): checks the input before any peer is
// joined, builds the run (run_setup.cpp), then hands it to the training loop
// every run takes (train/loop.h: Note [Training loop], Note [Training step])
// with what our families add around each step (token batches, MoE
// statistics, MFU, memory) and the end-of-run reports.
#include "scaletrain/train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/data/dataset.h"
#include "scaletrain/data/sampler.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/moe.h"
#include "scaletrain/models/spec_catalog.h"
#include "scaletrain/observe/memory.h"
#include "scaletrain/observe/metrics.h"
#include "scaletrain/observe/tracing.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/batches.h"
#include "scaletrain/train/loop.h"
#include "scaletrain/train/plan/device.h"
#include "scaletrain/train/plan/memory_layout.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/run_internal.h"
#include "scaletrain/train/recipe.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train {
namespace {

using detail::Run;

// Predicted next to measured memory (collective); `phase` is "setup" or "end".
void report_memory_now(Run& r, const char* phase) {
  r.mem.states = static_cast<double>(r.dp().model_state_bytes() + r.opt_bytes);
  r.mem.tensors = static_cast<double>(observe::TensorBytes::current());
  observe::report_memory(phase, models::estimator_spec(r.plan.model), r.mem_layout, r.mem, *r.world->group(), r.lead,
                         r.loop->metrics());
}

// The step's MoE statistics of every rank, summed over the job: each rank
// recorded its own layers' forwards on its own micro-batches, so the sums
// cover every layer and sequence once (any dp, ep or pp layout).
void moe_metrics(models::MoeContext& moe, comm::Group& world, observe::StepMetrics& m) {
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

// Micro-batch k of `step` on data-parallel rank `dp_rank`, on the run's device.
std::pair<at::Tensor, at::Tensor> micro_batch(Run& r, int64_t step, int dp_rank, int64_t k) {
  trace::Span span("data", "load micro-batch", k);
  const int64_t B = r.plan.micro_batch, T = r.plan.model.block_size;
  auto idx = r.sampler->indices(step, dp_rank, r.dims.dp(), static_cast<int>(k), static_cast<int>(B));
  // Token ids are read into host memory (page-locked on a GPU), then copied to the device.
  const auto host = torch::TensorOptions().dtype(torch::kLong).pinned_memory(r.plan.cuda);
  std::pair<at::Tensor, at::Tensor> xy{torch::empty({B, T}, host), torch::empty({B, T}, host)};
  r.dataset.copy_batch(idx, xy.first.data_ptr<int64_t>(), xy.second.data_ptr<int64_t>());
  if (r.plan.cuda) xy = {xy.first.to(r.plan.device, /*non_blocking=*/true), xy.second.to(r.plan.device, true)};
  return xy;
}

// Packed documents: where micro-batch k's documents are (Note [Packed documents]).
std::shared_ptr<const models::SequenceLayout> micro_layout(Run& r, int64_t step, int dp_rank, int64_t k) {
  if (r.cfg.data.pack != "documents") return nullptr;
  const int64_t B = r.plan.micro_batch, T = r.plan.model.block_size;
  auto idx = r.sampler->indices(step, dp_rank, r.dims.dp(), static_cast<int>(k), static_cast<int>(B));
  auto l = std::make_shared<models::SequenceLayout>();
  l->segments = torch::empty({B, T}, torch::kLong);
  l->positions = r.cfg.data.position_reset ? torch::empty({B, T}, torch::kLong)
                                           : torch::arange(T, torch::kLong).expand({B, T}).contiguous();
  r.dataset.copy_layout(idx, l->segments.data_ptr<int64_t>(),
                        r.cfg.data.position_reset ? l->positions.data_ptr<int64_t>() : nullptr);
  if (r.plan.cuda) *l = {l->segments.to(r.plan.device), l->positions.to(r.plan.device)};
  return l;
}

// The step's micro-batches (Note [Training step] in loop.cpp), micro-batch
// k weighted by weights[k]: this data-parallel rank's samples, their
// packed-document layouts, and under context parallelism this rank's part
// of each sequence. The step runs through the model, which the lambdas
// reach through `r` (they run before this step ends).
StepWork step_work(Run& r, int64_t step, int dp_rank, const std::vector<double>& weights, int64_t global_targets,
                   double loss_scale) {
  StepWork work;
  work.loss_scale = loss_scale;
  std::vector<std::shared_ptr<const models::SequenceLayout>> layouts;
  for (int64_t k = 0; k < r.plan.accum; ++k) {
    auto [inputs, targets] = micro_batch(r, step, dp_rank, k);
    std::shared_ptr<const models::SequenceLayout> lay = micro_layout(r, step, dp_rank, k);
    double weight = weights[static_cast<size_t>(k)];
    if (r.dims.cp > 1) {  // Note [Context-parallel batches]
      keep_context_part(inputs, targets, lay, r.mesh->coord().cp, r.dims.cp);
      weight = context_weight(targets, global_targets, r.dims.dp(), r.dims.cp);
    }
    work.inputs.push_back(inputs);
    work.targets.push_back(targets);
    work.weights.push_back(weight);
    layouts.push_back(lay);
  }
  Run* run = &r;
  work.autocast = [run](const std::function<at::Tensor()>& fn) {
    precision::AutocastGuard autocast(run->plan.policy, run->plan.device.type());
    return fn();
  };
  // What a forward leaves for its backward, counted from before the
  // strategy's forward (which may gather units it keeps until backward).
  auto before_forward = std::make_shared<int64_t>(0);
  work.prepare = [run, layouts, weights = work.weights, loss_scale, before_forward](int64_t k) {
    run->model().set_sequence_layout(layouts[static_cast<size_t>(k)]);
    for (auto& l : run->fp8) l->set_loss_multiplier(loss_scale * weights[static_cast<size_t>(k)]);
    *before_forward = observe::TensorBytes::current();
  };
  work.forward = [run, inputs = work.inputs, targets = work.targets, weights = work.weights, loss_scale,
                  autocast = work.autocast, before_forward](int64_t k) {
    const auto i = static_cast<size_t>(k);
    return autocast([&] {
      at::Tensor loss = run->model().loss(inputs[i], targets[i]) * (loss_scale * weights[i]);
      run->mem.activations =
          std::max(run->mem.activations, static_cast<double>(observe::TensorBytes::current() - *before_forward));
      return loss;
    });
  };
  return work;
}

// Note [Training step] (loop.cpp), with what our families add around it:
// the micro-batches' weights (masked targets, context parallelism), the
// sequence layout kept through each backward, the MoE losses' multiplier
// and statistics, throughput, MFU and memory.
StepHooks step_hooks(Run& r) {
  StepHooks h;
  h.build = [&r](int64_t step, double loss_scale) {
    const int dp_rank = r.mesh->coord().dp(r.dims);
    int64_t global_targets = 0;
    const std::vector<double> weights = micro_weights(r.dataset, *r.sampler, step, dp_rank, r.dims.dp(),
                                                      r.plan.micro_batch, r.plan.accum, r.cfg.data.loss_on,
                                                      &global_targets);
    // Note [Auxiliary losses] (models/moe.h): their gradient takes the main loss's multiplier.
    if (const auto moe = r.model().moe()) {
      moe->take();  // what forwards outside training steps recorded
      moe->multiplier = loss_scale / static_cast<double>(r.plan.accum);
    }
    return step_work(r, step, dp_rank, weights, global_targets, loss_scale);
  };
  h.finish = [&r](observe::StepMetrics& m) {
    // The layout stayed set through each micro-batch's backward (which may recompute blocks).
    r.model().set_sequence_layout(nullptr);
    m.tokens_per_s = m.samples_per_s * static_cast<double>(r.plan.model.block_size);
    m.mfu = m.tokens_per_s / r.world->size() * r.flops_per_token / r.peak_flops;
    m.peak_rss_mb = std::max(r.lifetime_rss_peak_mb, observe::peak_rss_mb());
    if (const DeviceMemory dm = device_memory(r.plan.device); dm.available) {
      m.device_max_allocated_mb = dm.max_allocated_mb;
      m.device_max_reserved_mb = dm.max_reserved_mb;
    }
    if (const auto moe = r.model().moe()) moe_metrics(*moe, *r.world->group(), m);
  };
  return h;
}

// What the step every run takes needs of this run (Note [Training step]).
StepParts step_parts(Run& r) {
  StepParts p;
  p.engine = &r.dp();
  p.params = r.params;
  p.global_batch = r.cfg.train.global_batch;
  p.batch_groups = {&r.mesh->dp_cp()};  // Note [Context-parallel batches]
  p.scaler = r.scaler.get();
  p.fp8 = r.fp8;
  // The step's FP8 amaxes, agreed over the ranks that see parts of this
  // batch or pieces of these layers (Note [FP8 linears]).
  p.fp8_groups = {&r.mesh->dp_cp(), &r.mesh->tp()};
  p.lr = [&r](int64_t step) { return optim::lr_at(step, r.cfg.train.lr, r.sched); };
  p.optimizer_step = [&r](double lr) { r.opt->step(lr); };
  p.grad_clip = r.cfg.train.grad_clip;
  p.rank = r.world->rank();
  return p;
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
  const config::Config& cfg = r.cfg;
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

// From here on the measured memory is the training steps': the memory
// estimator's layout of the run, predicted against measured memory after
// setup, then every peak reset.
void start_measuring(Run& r) {
  r.mem_layout = run_layout(r.cfg, r.plan, r.world->size(), r.mesh->dp_shard_cp().size(), r.plan.accum,
                            r.world->backend() == comm::BackendKind::Gloo);
  r.mem.rss_baseline_mb = r.rss_before_setup;
  r.mem.rss_peak_mb = observe::current_rss_mb();
  report_memory_now(r, "setup");
  // From here on the peaks are the training steps' (the setup peak was logged above).
  r.lifetime_rss_peak_mb = observe::peak_rss_mb();
  observe::release_free_heap();
  observe::reset_rss_peak();
  reset_device_peaks(r.plan.device);
  observe::TensorBytes::reset_peak();
}

// The end of the steps (`steps` of them in this attempt), after the loop's
// finish: the communication summary written, and memory measured against
// predicted at the end.
void finish_steps(Run& r, int64_t steps) {
  std::vector<double> bubbles = r.loop->bubbles();
  if (bubbles.size() > 1) bubbles.erase(bubbles.begin());  // the first step warms up
  observe::report_comm_summary(*r.world, steps, bubbles, r.loop->expected_bubble(), r.lead, r.loop->metrics());

  r.mem.tensor_peak = static_cast<double>(observe::TensorBytes::peak());
  r.mem.rss_peak_mb = observe::rss_peak_mb();
  r.mem.rss_file_growth_mb = observe::rss_file_mb() - r.rss_file_before_setup;
  r.mem.heap_free_mb = observe::heap_free_mb();
  report_memory_now(r, "end");
  if (r.lead) {
    std::printf("scaletrain: model states at the end %.1f MiB/rank (params+grads %.1f, optimizer %.1f)\n",
                (r.dp().model_state_bytes() + r.opt_bytes) / 1048576.0, r.dp().model_state_bytes() / 1048576.0,
                r.opt_bytes / 1048576.0);
    std::fflush(stdout);
  }
}

}  // namespace

TrainResult run_training(const config::Config& cfg) {
  // Everything that can be rejected without peers is checked first (one
  // plan, every problem at once), so bad input fails fast and identically on
  // every rank.
  observe::TensorBytes::install();  // before any tensor of the run exists (Note [What is measured])
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
  launch::follow_launcher();
  CollectiveHeartbeat collective_heartbeat;
  launch::heartbeat();  // the launcher's watchdog (--heartbeat-timeout) is armed from here
  detail::setup(r, info);
  r.loop = std::make_unique<TrainingLoop>(*r.world, step_parts(r), detail::loop_options(r));
  launch::heartbeat();
  detail::print_start(r, info);
  r.loop->start([&r] { return detail::run_checkpoint(r); });  // Note [Training loop]: resumes
  start_measuring(r);
  comm::reset_comm_profile();  // Note [Communication profile] (comm/group.h)

  TrainResult result;
  r.model().train();
  const std::vector<observe::StepMetrics> steps = r.loop->run(step_hooks(r));
  finish_steps(r, static_cast<int64_t>(steps.size()));
  std::vector<double> throughput;
  for (const auto& m : steps) {
    result.losses.push_back(m.loss);
    if (&m != &steps.front()) throughput.push_back(m.tokens_per_s);
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

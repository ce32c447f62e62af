#pragma once
// The training loops of the parity tests, for a model of any family (DESIGN:
// the invariant). A test builds the model (the same initial weights on every
// call: seed, then build) and these run it under one strategy on the global
// batches of reference.h, with AdamW and clipping at `clip`:
//   train_one_process      the single-process reference (whole batches)
//   train_sharded          ZeRO-1/2/3, FSDP strategies (fsdp_test.cpp)
//   train_tensor_parallel  TP (+ sequence parallel), optionally DDP over dp
//                          (tensor_parallel_test.cpp)
//   run_pipeline_case      PP with a schedule, composed with DDP, ZeRO-3 or
//                          TP, checked against the reference by name
//                          (pipeline_test.cpp)
// GPT-2 (the *_test.cpp above) and the Llama family (llama_parity_test.cpp)
// run the same loops; only the model differs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/pipeline/data_parallel.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"

namespace scaletrain::test {

// Builds the model the same way on every call (same seed, same dtype).
using ModelFactory = std::function<models::ModelPtr()>;

struct Trained {
  std::vector<at::Tensor> params;      // full, in named_parameters() order
  std::vector<double> norms;           // gradient norm before clipping, per step
  std::vector<int64_t> bytes_reduced;  // DDP's gradient bytes per step, when it ran
};

// The parameters that train (frozen ones are left out of the optimizer).
inline std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// One process, the whole global batch per step.
inline Trained train_one_process(const models::ModelPtr& model, const std::vector<Batch>& data, double clip,
                                 double lr) {
  auto params = trainable_parameters(*model);
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  Trained out;
  for (auto& b : data) {
    model->loss(b.x, b.y).backward();
    out.norms.push_back(optim::clip_grad_norm(params, clip));
    opt.step(lr);
    opt.zero_grad();
  }
  out.params = model->parameters();
  return out;
}

// The sharded engine (ZeRO-1/2/3, FSDP) over the world group, or HYBRID_SHARD
// over a mesh's shard x replicate groups. Each rank takes its contiguous
// share of every global batch (the batch size must divide by dp x accum).
struct ShardedRun {
  parallel::fsdp::ShardedOptions options;
  int accum = 1;
  bool no_sync = true;           // accumulate locally, reduce once per step
  comm::Mesh* hybrid = nullptr;  // HYBRID_SHARD over this mesh's shard x replicate
  // Filled in: model-state bytes per rank at the end of a step, and the
  // engine's gradient norm before clipping, per step.
  int64_t state_bytes = 0, grad_bytes = 0;
  std::vector<double> norms;
  int64_t grad_bytes_reduced = 0;  // over all steps: gradient bytes handed to reduce-scatter
};

// The full parameters after training `model` (built on every rank alike).
inline std::vector<at::Tensor> train_sharded(const models::ModelPtr& model, const std::vector<Batch>& data,
                                             ShardedRun& run, double clip, double lr) {
  using parallel::fsdp::ShardedDataParallel;
  run.norms.clear();  // a run may be repeated with other options
  comm::Group& shard = run.hybrid ? run.hybrid->dp_shard() : *world().group();
  comm::Group* replicate = run.hybrid ? &run.hybrid->dp_replicate() : nullptr;
  ShardedDataParallel engine(model, *model, world(), shard, replicate, run.options);
  optim::AdamW opt(engine.shards(), engine.shard_decay_numel(), {});
  const int dp = world().size();
  const int dp_rank = run.hybrid ? run.hybrid->coord().dp(run.hybrid->dims()) : world().rank();
  const int64_t global = data.at(0).x.size(0), local = global / dp, micro = local / run.accum;
  EXPECT_EQ(micro * run.accum * dp, global) << "the global batch must divide by dp x accumulation";
  for (auto& b : data) {
    for (int k = 0; k < run.accum; ++k) {
      const int64_t start = dp_rank * local + k * micro;
      auto x = b.x.narrow(0, start, micro), y = b.y.narrow(0, start, micro);
      auto loss = engine.forward([&] { return model->loss(x, y); }) / run.accum;
      if (k + 1 < run.accum && run.no_sync) {
        auto guard = engine.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    run.norms.push_back(engine.clip_grad_norm(clip));
    opt.step(lr);
    engine.after_step();
    engine.zero_grad();
  }
  int64_t opt_bytes = 0;
  for (size_t i = 0; i < opt.exp_avg().size(); ++i)
    opt_bytes += opt.exp_avg()[i].nbytes() + opt.exp_avg_sq()[i].nbytes();
  run.grad_bytes = engine.grad_bytes();
  run.grad_bytes_reduced = engine.stats().grad_bytes_reduced;
  run.state_bytes = engine.param_bytes() + run.grad_bytes + opt_bytes;
  return engine.full_parameters();
}

// Tensor parallelism over `tpg` (nullptr: none), composed with DDP over `dp`
// (nullptr: none; each dp rank takes its share of the batch). Returns the full
// parameters (gathered over tp) and the global norms.
inline Trained train_tensor_parallel(const models::ModelPtr& model, const std::vector<Batch>& data,
                                     comm::Group* tpg, comm::Group* dp, bool sequence_parallel, double clip,
                                     double lr) {
  namespace tp = parallel::tensor;
  tp::TensorParallelPlan plan;
  if (tpg) {
    tp::TensorParallelOptions o;
    o.sequence_parallel = sequence_parallel;
    plan = tp::parallelize_tensor(*model, *tpg, o);
  }
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  if (dp) ddp = std::make_unique<parallel::DistributedDataParallel>(model, *dp);
  auto params = trainable_parameters(*model);
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  Trained out;
  const int64_t global = data.at(0).x.size(0);
  for (auto& b : data) {
    const int64_t n = dp ? global / dp->size() : global, start = dp ? dp->rank() * n : 0;
    if (ddp) ddp->reset_stats();
    model->loss(b.x.narrow(0, start, n), b.y.narrow(0, start, n)).backward();
    if (ddp) out.bytes_reduced.push_back(ddp->bytes_reduced());
    out.norms.push_back(tpg ? tp::clip_grad_norm(tp::grad_norm_params(*model, plan), clip, *tpg)
                            : optim::clip_grad_norm(params, clip));
    opt.step(lr);
    opt.zero_grad();
  }
  out.params = tpg ? tp::gather_full_parameters(*model, plan) : model->parameters();
  return out;
}

// Pipeline parallelism against the reference, by parameter name: every rank
// trains the reference locally on whole global batches and the pipeline on
// its share, for 5 AdamW steps (lr 1e-2) clipped at 0.25 so that clipping
// acts; each rank's stage parameters, gathered over tp and dp where split,
// must equal the reference's of the same name to 1e-5 relative per tensor.
namespace pipeline_parity {

namespace pl = parallel::pipeline;

enum class Dp { None, Ddp, Zero3 };

constexpr int kSteps = 5;
constexpr int64_t kMicro = 2;
constexpr double kMaxNorm = 0.25, kTol = 1e-5;

struct Case {
  pl::Schedule schedule;
  int m;       // micro-batches per step (per data-parallel replica)
  int v = 1;   // virtual stages
  int pp = 0;  // 0: the world
  int dp = 1;
  int tp = 1;
  Dp mode = Dp::None;
  double max_norm = kMaxNorm;  // clipping threshold: it must act in most steps
};

inline std::string describe(const Case& c) {
  return pl::to_string(c.schedule) + " pp=" + std::to_string(c.pp) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v) + " dp=" + std::to_string(c.dp) + " tp=" + std::to_string(c.tp) +
         (c.mode == Dp::Zero3 ? " zero3" : c.mode == Dp::Ddp ? " ddp" : "");
}

inline optim::AdamWOptions adam() {
  optim::AdamWOptions o;
  o.lr = 1e-2;
  return o;
}

// The reference: one process, whole global batches, named final parameters.
inline std::map<std::string, at::Tensor> reference(const ModelFactory& make, const std::vector<Batch>& data,
                                                   double max_norm) {
  auto model = make();
  std::vector<at::Tensor> params = trainable_parameters(*model);
  optim::AdamW opt(params, optim::decay_matrices(params), adam());
  for (const Batch& b : data) {
    model->zero_grad();
    model->loss(b.x, b.y).backward();
    optim::clip_grad_norm(params, max_norm);
    opt.step(adam().lr);
  }
  std::map<std::string, at::Tensor> out;
  for (auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// `label` names the model in the printed line.
inline void run_case(const ModelFactory& make, const Case& c0, int64_t seq, int64_t vocab,
                     const std::string& label = "") {
  Case c = c0;
  const int world_size = world().size();
  if (c.pp == 0) c.pp = world_size / (c.dp * c.tp);
  SCOPED_TRACE(label + describe(c));
  comm::Mesh mesh(world(), comm::MeshDims{c.pp, 1, c.dp, c.tp});
  const int64_t global = static_cast<int64_t>(c.dp) * c.m * kMicro;
  const auto data = make_batches(kSteps, global, seq, vocab, 99);
  const auto ref = reference(make, data, c.max_norm);

  auto model = make();
  std::optional<parallel::tensor::TensorParallelPlan> plan;
  if (c.tp > 1) plan = parallel::tensor::parallelize_tensor(*model, mesh.tp());
  pl::PipelineOptions po;
  po.schedule = c.schedule;
  po.microbatches = c.m;
  po.virtual_stages = c.v;
  po.micro_batch = kMicro;
  pl::Pipeline pipe(model, mesh.pp(), &mesh.dp(), po, world().group().get());

  std::vector<std::shared_ptr<pl::ShardedRunner>> sharded;
  if (c.mode == Dp::Ddp) {
    std::vector<std::shared_ptr<pl::ChunkRunner>> rs;
    for (const auto& ch : pipe.chunks())
      rs.push_back(std::make_shared<pl::DdpRunner>(ch, mesh.dp(), parallel::DDPOptions{}));
    pipe.set_runners(rs);
  } else if (c.mode == Dp::Zero3) {
    std::vector<std::shared_ptr<pl::ChunkRunner>> rs;
    for (const auto& ch : pipe.chunks()) {
      parallel::fsdp::ShardedOptions so;
      so.sharding = parallel::fsdp::Sharding::Zero3;
      sharded.push_back(std::make_shared<pl::ShardedRunner>(ch, world(), mesh.dp(), nullptr, so));
      rs.push_back(sharded.back());
    }
    pipe.set_runners(rs);
  }

  // What the optimizer updates, and how each enters the global norm.
  std::vector<at::Tensor> params, counted, shared;
  std::vector<int64_t> decay;
  if (c.mode == Dp::Zero3) {
    for (auto& r : sharded) {
      for (auto& s : r->engine().shards()) params.push_back(s);
      for (auto d : r->engine().shard_decay_numel()) decay.push_back(d);
    }
    counted = params;  // shards partition each stage's gradient over dp
  } else {
    for (const auto& ch : pipe.chunks())
      for (auto& item : ch->named_parameters()) {
        const at::Tensor& p = item.value();
        if (!p.requires_grad()) continue;  // frozen (adapters train)
        params.push_back(p);
        decay.push_back(p.dim() >= 2 ? p.numel() : 0);
        bool split = false;
        if (plan)
          for (auto& l : plan->params)
            if (l.name == item.key()) split = l.sharded();
        (plan && !split ? shared : counted).push_back(p);
      }
  }
  std::vector<comm::Group*> norm_groups{&mesh.pp()};
  if (c.tp > 1) norm_groups.push_back(&mesh.tp());
  if (c.mode == Dp::Zero3) norm_groups.push_back(&mesh.dp());
  optim::AdamW opt(params, decay, adam());

  const int d = mesh.coord().dp(mesh.dims());
  int clipped = 0;
  for (const Batch& b : data) {
    std::vector<at::Tensor> xs, ys;
    for (int k = 0; k < c.m; ++k) {
      const int64_t at = (static_cast<int64_t>(d) * c.m + k) * kMicro;
      xs.push_back(b.x.narrow(0, at, kMicro).contiguous());
      ys.push_back(b.y.narrow(0, at, kMicro).contiguous());
    }
    const double loss = pipe.step(xs, ys);
    EXPECT_TRUE(std::isfinite(loss));
    const double norm = pl::clip_grad_norm(counted, shared, c.tp, norm_groups, c.max_norm);
    clipped += norm > c.max_norm;
    opt.step(adam().lr);
    for (auto& r : sharded) r->engine().after_step();
    for (auto& p : params) p.mutable_grad().reset();
    for (auto& r : sharded) r->engine().zero_grad();
    pipe.zero_grad();
  }

  EXPECT_GE(clipped, 3) << "clipping must act for the test to cover it";
  // This stage's final parameters, whole, against the reference's.
  std::vector<at::Tensor> mine, theirs;
  for (size_t j = 0; j < pipe.chunks().size(); ++j) {
    const auto& ch = pipe.chunks()[j];
    auto named = ch->named_parameters();
    std::vector<at::Tensor> values;
    if (c.mode == Dp::Zero3) values = sharded[j]->engine().full_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      at::Tensor v = c.mode == Dp::Zero3 ? values[i] : named[i].value().detach();
      if (plan)
        for (auto& l : plan->params)
          if (l.name == named[i].key() && l.sharded()) v = parallel::tensor::gather_parameter(v, l, mesh.tp());
      ASSERT_TRUE(ref.count(named[i].key())) << named[i].key();
      mine.push_back(v);
      theirs.push_back(ref.at(named[i].key()));
    }
  }
  ASSERT_FALSE(mine.empty());
  const double diff = relative_diff(mine, theirs, /*per_tensor=*/true);
  if (world().rank() == 0 || mesh.coord().pp == c.pp - 1)
    std::printf("[pipeline] %s%s stage %d: max relative difference %.2e over %zu tensors\n", label.c_str(),
                describe(c).c_str(), mesh.coord().pp, diff, mine.size());
  EXPECT_LE(diff, kTol);
}

}  // namespace pipeline_parity

}  // namespace scaletrain::test

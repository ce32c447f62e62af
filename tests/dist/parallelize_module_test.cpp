// parallelize_module on modules that are not ours: a TensorParallelLinear
// (one colwise Linear, its output gathered by the user), MLP blocks with a
// residual (colwise -> rowwise, found by a pattern), a colwise Embedding
// feeding a rowwise Linear, and sequence parallelism (a norm on each rank's
// part of the sequence, the MLP between the user's gather and
// reduce-scatter), against one process in float64 (1e-10) over
// several Adam steps; on 4 ranks also DDP, and fully_shard (2-D), over dp x
// tensor parallelism over tp. The modules' forward is theirs (Note [Tensor parallelism without
// forward hooks]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/tensor/parallelize_module.h"
#include "scaletrain/parallel/tensor/tp_comm.h"
#include "scaletrain/util/error.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace parallelize_module_test {

using parallel::tensor::colwise;
using parallel::tensor::colwise_from_sequence;
using parallel::tensor::ModulePlan;
using parallel::tensor::rowwise;
using parallel::tensor::rowwise_to_sequence;
using parallel::tensor::sequence_parallel;

// One weight split over its outputs; the user gathers the output when tp is given.
struct TpLinearImpl : torch::nn::Module {
  TpLinearImpl() { fc = register_module("fc", torch::nn::Linear(12, 8)); }
  at::Tensor forward(const at::Tensor& x, comm::Group* tp) {
    auto y = fc(x);
    return tp ? parallel::tensor::gather_from_tp_region(y, *tp, -1) : y;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TpLinear);

// A transformer's MLP with its residual: h is read by fc1 and by the add.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
  }
  at::Tensor forward(const at::Tensor& h) { return h + fc2(torch::gelu(fc1(h))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MlpBlock);

struct MlpNetImpl : torch::nn::Module {
  MlpNetImpl() {
    in = register_module("in", torch::nn::Linear(10, 16));
    blocks = register_module("blocks", torch::nn::ModuleList(MlpBlock(), MlpBlock()));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  at::Tensor forward(const at::Tensor& x, comm::Group*) {
    auto h = torch::tanh(in(x));
    for (auto& b : *blocks) h = b->as<MlpBlockImpl>()->forward(h);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(MlpNet);

// A colwise Embedding's feature slice read by a rowwise Linear.
struct EmbedNetImpl : torch::nn::Module {
  EmbedNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(20, 16));
    fc = register_module("fc", torch::nn::Linear(16, 8));
    head = register_module("head", torch::nn::Linear(8, 5));
  }
  at::Tensor forward(const at::Tensor& ids, comm::Group*) { return head(torch::relu(fc(emb(ids)))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr}, head{nullptr};
};
TORCH_MODULE(EmbedNet);

// Sequence parallelism as a user writes it: between the stem and the head
// each rank holds its part of the sequence; the norm runs on it, the MLP's
// linears between the gather and the reduce-scatter.
struct SeqNetImpl : torch::nn::Module {
  SeqNetImpl() {
    in = register_module("in", torch::nn::Linear(10, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  at::Tensor forward(const at::Tensor& x, comm::Group* tp) {
    namespace tpc = parallel::tensor;
    auto h = torch::tanh(in(x));
    if (tp) h = tpc::scatter_to_tp_region(h, *tp, 1);  // [B, T/tp, 16]
    auto a = norm(h);
    if (tp) a = tpc::gather_from_sequence(a, *tp, 1);
    a = fc2(torch::gelu(fc1(a)));
    h = h + (tp ? tpc::reduce_scatter_to_sequence(a, *tp, 1) : a);
    if (tp) h = tpc::gather_from_tp_region(h, *tp, 1);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(SeqNet);

struct Case {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&, comm::Group*)> forward;
  std::function<at::Tensor(int step)> input;  // the global batch's inputs
  int64_t outputs;
  ModulePlan plan;
};

constexpr int64_t kBatch = 8, kSeq = 3;
constexpr int kSteps = 4;

template <typename M>
Case make_case(std::string name, std::function<at::Tensor(int)> input, int64_t outputs, ModulePlan plan) {
  return {name,
          [] {
            torch::manual_seed(5);
            auto m = M();
            m->to(at::kDouble);
            return std::static_pointer_cast<torch::nn::Module>(m.ptr());
          },
          [](torch::nn::Module& m, const at::Tensor& x, comm::Group* tp) {
            return dynamic_cast<typename M::ContainedType&>(m).forward(x, tp);
          },
          std::move(input), outputs, std::move(plan)};
}

std::function<at::Tensor(int)> normal(std::vector<int64_t> shape) {
  return [shape](int step) { return at::randn(shape, at::detail::createCPUGenerator(70 + step), at::kDouble); };
}

std::vector<Case> cases() {
  return {
      make_case<TpLinear>("TensorParallelLinear", normal({kBatch, 12}), 8, {{"fc", colwise}}),
      make_case<MlpNet>("mlp", normal({kBatch, kSeq, 10}), 5, {{"blocks.*.fc1", colwise}, {"blocks.*.fc2", rowwise}}),
      make_case<EmbedNet>(
          "embedding",
          [](int step) {
            return at::randint(20, {kBatch, kSeq}, at::detail::createCPUGenerator(70 + step), at::kLong);
          },
          5, {{"emb", colwise}, {"fc", rowwise}}),
      make_case<SeqNet>("sequence parallel", normal({kBatch, 4, 10}), 5,
                        {{"norm", sequence_parallel}, {"fc1", colwise_from_sequence}, {"fc2", rowwise_to_sequence}})};
}

at::Tensor target(const Case& c, const at::Tensor& x, int step) {
  auto shape = x.sizes().vec();  // ids [B, T] give [B, T, outputs]; features replace their last dimension
  if (x.scalar_type() == at::kLong)
    shape.push_back(c.outputs);
  else
    shape.back() = c.outputs;
  return at::randn(shape, at::detail::createCPUGenerator(90 + step), at::kDouble);
}

struct Run {
  std::vector<at::Tensor> params;
  std::vector<double> norms;  // the gradient norm of each step, before clipping
};

// One process on the whole batch; `clip` > 0 clips the global norm.
Run train_alone(const Case& c, double clip) {
  auto m = c.make();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  Run r;
  for (int s = 0; s < kSteps; ++s) {
    auto x = c.input(s);
    opt.zero_grad();
    torch::mse_loss(c.forward(*m, x, nullptr), target(c, x, s)).backward();
    r.norms.push_back(torch::nn::utils::clip_grad_norm_(m->parameters(), clip > 0 ? clip : 1e300));
    opt.step();
  }
  r.params = m->parameters();
  return r;
}

// Tensor parallelism over `tp`; with `dp`, DDP over it and 1/dp of the batch.
Run train_parallel(const Case& c, comm::Group& tp, comm::Group* dp, double clip) {
  auto m = c.make();
  auto tpm = parallel::tensor::parallelize_module(m, tp, c.plan);
  std::unique_ptr<parallel::DistributedDataParallel> ddp;
  if (dp) ddp = std::make_unique<parallel::DistributedDataParallel>(m, *dp);
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  const auto norm_params = parallel::tensor::grad_norm_params(*m, tpm->plan());
  const int parts = dp ? dp->size() : 1, part = dp ? dp->rank() : 0;
  Run r;
  for (int s = 0; s < kSteps; ++s) {
    auto x = c.input(s);
    auto y = target(c, x, s);
    const int64_t n = kBatch / parts;
    opt.zero_grad();
    auto out = c.forward(*m, x.narrow(0, part * n, n), &tp);
    torch::mse_loss(out, y.narrow(0, part * n, n)).backward();
    r.norms.push_back(parallel::tensor::clip_grad_norm(norm_params, clip, tp));
    opt.step();
  }
  tpm->check();
  r.params = parallel::tensor::gather_full_parameters(*m, tpm->plan());
  return r;
}

// 2-D: tensor parallelism over the mesh's tp, fully_shard over its dp with
// one unit per Linear, 1/dp of the batch (Note [Tensor parallelism under
// fully_shard]).
Run train_fully_sharded(const Case& c, comm::Mesh& mesh, parallel::fsdp::Sharding sharding, double clip) {
  namespace fsdp = parallel::fsdp;
  auto m = c.make();
  auto tpm = parallel::tensor::parallelize_module(m, mesh.tp(), c.plan);
  fsdp::ModuleUnits units;
  units.types = {"LinearImpl"};
  fsdp::ShardedOptions options;
  options.sharding = sharding;
  auto engine = fsdp::fully_shard(m, world(), mesh.dp(), units, options);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
  const fsdp::NormSplit split{&mesh.tp(), [&](const std::string& n) { return tpm->plan().layout(n).sharded(); }};
  const int64_t n = kBatch / mesh.dp().size(), from = mesh.dp().rank() * n;
  Run r;
  for (int s = 0; s < kSteps; ++s) {
    auto x = c.input(s);
    auto y = target(c, x, s);
    engine->zero_grad();
    torch::mse_loss(c.forward(*m, x.narrow(0, from, n), &mesh.tp()), y.narrow(0, from, n)).backward();
    r.norms.push_back(engine->clip_grad_norm(clip, split));
    opt.step();
    engine->after_step();
  }
  tpm->check();
  const std::vector<at::Tensor> local = engine->full_parameters();  // whole over dp, split over tp
  for (size_t i = 0; i < local.size(); ++i)
    r.params.push_back(parallel::tensor::gather_parameter(local[i], tpm->plan().params[i], mesh.tp()));
  return r;
}

void expect_parity_of(const Case& c, const std::string& what, const std::function<Run(double clip)>& train) {
  for (double clip : {0.0, 0.05}) {
    const Run want = train_alone(c, clip), got = train(clip);
    ASSERT_EQ(got.params.size(), want.params.size()) << c.name << " " << what;
    EXPECT_LE(relative_diff(got.params, want.params, /*per_tensor=*/true), 1e-10) << c.name << " " << what;
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(got.norms[s], want.norms[s], 1e-10 * want.norms[s]) << c.name << " " << what << " step " << s;
    if (clip > 0) EXPECT_GT(want.norms[0], clip) << c.name << ": clipping must act for the test to mean anything";
    auto init = c.make()->parameters();
    for (size_t i = 0; i < got.params.size(); ++i)
      EXPECT_GT((got.params[i] - init[i]).abs().max().item<double>(), 1e-4) << c.name << ": tensor " << i;
  }
}

void expect_parity(const Case& c, comm::Group& tp, comm::Group* dp, const std::string& what) {
  expect_parity_of(c, what, [&](double clip) { return train_parallel(c, tp, dp, clip); });
}

// Every rank in one tp group; on 4 ranks also DDP over dp 2 x tp 2.
TEST(ParallelizeModule, UserModulesMatchOneProcess) {
  for (const Case& c : cases()) expect_parity(c, *world().group(), nullptr, "tp " + std::to_string(world().size()));
  if (world().size() != 4) return;
  static comm::Mesh mesh(world(), comm::MeshDims{1, 1, 2, 2});
  for (const Case& c : cases()) expect_parity(c, mesh.tp(), &mesh.dp(), "dp 2 x tp 2");
}

// fully_shard over dp 2 of a module split over tp 2, ZeRO-2 and FULL_SHARD.
TEST(ParallelizeModule, FullyShardOverTensorParallelMatchesOneProcess) {
  if (world().size() != 4) GTEST_SKIP() << "needs dp 2 x tp 2";
  static comm::Mesh mesh(world(), comm::MeshDims{1, 1, 2, 2});
  for (auto sharding : {parallel::fsdp::Sharding::Zero2, parallel::fsdp::Sharding::FullShard})
    for (const Case& c : cases())
      expect_parity_of(c, "fully_shard " + parallel::fsdp::to_string(sharding) + " over dp 2 x tp 2",
                       [&](double clip) { return train_fully_sharded(c, mesh, sharding, clip); });
}

// The layouts the plan reports are what gather_full_parameters and
// checkpoints rely on: split dimensions as planned, the rest replicated.
TEST(ParallelizeModule, PlanReportsEveryParameter) {
  auto m = MlpNet();
  m->to(at::kDouble);
  auto tpm = parallel::tensor::parallelize_module(m.ptr(), *world().group(), cases()[1].plan);
  const auto& plan = tpm->plan();
  ASSERT_EQ(plan.params.size(), m->parameters().size());
  const int tp = world().size();
  EXPECT_EQ(plan.layout("blocks.0.fc1.weight").dim, 0);
  EXPECT_EQ(plan.layout("blocks.1.fc1.bias").dim, 0);
  EXPECT_EQ(plan.layout("blocks.0.fc2.weight").dim, 1);
  EXPECT_FALSE(plan.layout("blocks.0.fc2.bias").sharded());
  EXPECT_FALSE(plan.layout("head.weight").sharded());
  EXPECT_EQ(m->blocks[0]->as<MlpBlockImpl>()->fc1->weight.size(0), 32 / tp);
  EXPECT_EQ(m->blocks[1]->as<MlpBlockImpl>()->fc2->weight.size(1), 32 / tp);
}

void expect_refused(const std::shared_ptr<torch::nn::Module>& m, const ModulePlan& plan, const std::string& part) {
  try {
    parallel::tensor::parallelize_module(m, *world().group(), plan);
    ADD_FAILURE() << "accepted a plan that should name '" << part << "'";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
  }
}

TEST(ParallelizeModule, BadPlansNameTheModuleAndTheProblem) {
  auto toy = Toy().ptr();  // net1: Linear(10, 10), net2: Linear(10, 5)
  expect_refused(toy, {{"net3", colwise}}, "'net3' names no submodule");
  expect_refused(toy, {{"net2", colwise}}, "its 5 output features are not divisible");
  expect_refused(MlpBlock().ptr(), {{"fc1", colwise}, {"fc*", rowwise}}, "'fc1' is matched by both 'fc1' and 'fc*'");
  expect_refused(Net().ptr(), {{"conv1", colwise}}, "'conv1' is a torch::nn::Conv2dImpl");
  expect_refused(EmbedNet().ptr(), {{"emb", rowwise}}, "'emb' is an Embedding: rowwise");
  auto with_max_norm = std::make_shared<torch::nn::Module>();
  with_max_norm->register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(8, 16).max_norm(1.0)));
  expect_refused(with_max_norm, {{"emb", colwise}}, "'emb' is an Embedding with max_norm");
  auto no_params = std::make_shared<torch::nn::Module>();
  no_params->register_module("act", torch::nn::ReLU());
  expect_refused(no_params, {{"act", sequence_parallel}}, "'act' has no parameters");
  auto both = MlpNet().ptr();
  expect_refused(both, {{"blocks.0", sequence_parallel}, {"blocks.0.fc1", colwise}},
                 "'blocks.0.fc1.weight' is split by its own style and cannot also be sequence_parallel");
  EXPECT_EQ(both->named_parameters()["blocks.0.fc1.weight"].size(0), 32) << "a refused plan split a weight";
  // Nothing was split by the refused plans.
  EXPECT_EQ(toy->named_parameters()["net1.weight"].size(1), 10);
  auto twice = MlpBlock().ptr();
  auto first = parallel::tensor::parallelize_module(twice, *world().group(), {{"fc1", colwise}});
  expect_refused(twice, {{"fc1", colwise}}, "'fc1' is already tensor-parallel");
}

// An attention written with its whole head count: after q is split colwise,
// view({B, T, heads, head_dim}) asks each rank for tp times its elements.
// libtorch throws its own error; the line before it names the layer and the
// fix (Note [A head count that tensor parallelism split]).
struct FixedHeadsImpl : torch::nn::Module {
  FixedHeadsImpl() { q = register_module("q", torch::nn::Linear(16, 16)); }
  at::Tensor forward(const at::Tensor& x) { return q(x).view({x.size(0), x.size(1), 4, 4}); }
  torch::nn::Linear q{nullptr};
};
TORCH_MODULE(FixedHeads);

TEST(ParallelizeModule, AHeadCountTheSplitBreaksNamesTheLayer) {
  if (world().size() < 2) GTEST_SKIP() << "needs tp >= 2";
  auto attn = std::make_shared<torch::nn::Module>();
  auto heads = attn->register_module("attn", FixedHeads());
  auto tp = parallel::tensor::parallelize_module(attn, *world().group(), {{"attn.q", colwise}});
  testing::internal::CaptureStderr();
  EXPECT_THROW(heads->forward(torch::randn({2, 3, 16})), std::exception);  // libtorch's own
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("'attn.q' is colwise over tp=" + std::to_string(world().size()) + ", so each rank holds " +
                     std::to_string(16 / world().size()) + " of its 16 output features, but the forward reshapes "
                     "that output to [2, 3, 4, 4]"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("n_head / " + std::to_string(world().size()) + " heads on each rank"), std::string::npos) << err;
}

}  // namespace parallelize_module_test
}  // namespace scaletrain::test

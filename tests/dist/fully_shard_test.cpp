// fully_shard on modules that are not ours: the ToyModel, the MNIST Net of
// pytorch/examples, a small ResNet with BatchNorm and an LSTM language
// model (weights read at every time step), under every sharding strategy,
// against one process (float64, 1e-10). The modules' forward is theirs:
// units are gathered when operators read them (Note [Gather on use]).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/util/error.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace {

using parallel::fsdp::ModuleUnits;
using parallel::fsdp::ShardedOptions;
using parallel::fsdp::Sharding;

struct Case {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)> forward;
  std::vector<int64_t> input;  // one sample's shape; {-T}: T token ids
  int64_t classes;
  ModuleUnits units;
};

template <typename M>
Case make_case(std::string name, std::vector<int64_t> input, int64_t classes, ModuleUnits units) {
  return {name,
          [] {
            torch::manual_seed(3);
            auto m = M();
            m->to(at::kDouble);
            return std::static_pointer_cast<torch::nn::Module>(m.ptr());
          },
          [](torch::nn::Module& m, const at::Tensor& x) { return dynamic_cast<typename M::ContainedType&>(m).forward(x); },
          input, classes, units};
}

std::vector<Case> cases() {
  ModuleUnits toy, net, resnet, lstm;
  toy.names = {"net1", "net2"};
  net.types = {"torch::nn::Conv2dImpl", "LinearImpl"};
  resnet.types = {"BasicBlockImpl"};
  lstm.names = {"embed", "lstm", "head"};
  return {make_case<Toy>("toy", {10}, 5, toy), make_case<Net>("mnist", {1, 28, 28}, 10, net),
          make_case<ResNet>("resnet", {3, 8, 8}, 10, resnet), make_case<LstmLm>("lstm", {-5}, 12, lstm)};
}

constexpr int64_t kBatch = 24;  // divisible by 1..4 ranks
constexpr int kSteps = 4;

std::pair<at::Tensor, at::Tensor> batch(const Case& c, int step) {
  auto g = at::detail::createCPUGenerator(50 + step);
  std::vector<int64_t> shape{kBatch};
  if (c.input.size() == 1 && c.input[0] < 0) {  // {-T}: T token ids below `classes`
    auto ids = at::randint(c.classes, {kBatch, -c.input[0]}, g, at::kLong).to(at::kDouble);
    return {ids, at::randint(c.classes, {kBatch}, g, at::kLong)};
  }
  shape.insert(shape.end(), c.input.begin(), c.input.end());
  return {at::randn(shape, g, at::kDouble), at::randint(c.classes, {kBatch}, g, at::kLong)};
}

// One process. BatchNorm normalizes over each rank's samples, so the
// reference runs the same `parts` slices one after the other and averages
// their losses: the single-process form of what data parallelism computes.
std::vector<at::Tensor> train_alone(const Case& c, int parts) {
  auto m = c.make();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(c, s);
    opt.zero_grad();
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (int r = 0; r < parts; ++r) {
      const int64_t n = kBatch / parts;
      loss = loss + torch::nll_loss(c.forward(*m, x.narrow(0, r * n, n)), y.narrow(0, r * n, n)) / parts;
    }
    loss.backward();
    opt.step();
  }
  return m->parameters();
}

std::vector<at::Tensor> train_sharded(const Case& c, ShardedOptions o, comm::Mesh* hybrid = nullptr) {
  auto m = c.make();
  comm::Group& shard = hybrid ? hybrid->dp_shard() : *world().group();
  auto engine = parallel::fsdp::fully_shard(m, world(), shard, c.units, o, hybrid ? &hybrid->dp_replicate() : nullptr);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
  const int64_t n = kBatch / world().size();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(c, s);
    engine->zero_grad();
    auto out = c.forward(*m, x.narrow(0, world().rank() * n, n));  // the module's own forward
    torch::nll_loss(out, y.narrow(0, world().rank() * n, n)).backward();
    opt.step();
    engine->after_step();
  }
  return engine->full_parameters();
}

void expect_parity(const Case& c, const ShardedOptions& o, const std::string& what, comm::Mesh* hybrid = nullptr) {
  const bool batchnorm = c.name == "resnet";
  auto want = train_alone(c, batchnorm ? world().size() : 1);
  auto got = train_sharded(c, o, hybrid);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(relative_diff(got, want, /*per_tensor=*/true), 1e-10) << c.name << " " << what;
  auto init = c.make()->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_GT((got[i] - init[i]).abs().max().item<double>(), 1e-4) << c.name << " " << what << ": tensor " << i;
}

TEST(FullyShard, UserModulesMatchOneProcessUnderEveryStrategy) {
  for (const Case& c : cases())
    for (Sharding s : {Sharding::Zero1, Sharding::Zero2, Sharding::Zero3, Sharding::FullShard, Sharding::ShardGradOp}) {
      ShardedOptions o;
      o.sharding = s;
      expect_parity(c, o, parallel::fsdp::to_string(s));
    }
}

TEST(FullyShard, PrefetchingAndHybridShardMatch) {
  ShardedOptions o;
  o.sharding = Sharding::FullShard;
  o.forward_prefetch = true;
  o.backward_prefetch = parallel::fsdp::BackwardPrefetch::Post;
  for (const Case& c : cases()) expect_parity(c, o, "FULL_SHARD with prefetch");
  if (world().size() != 4) return;
  static comm::Mesh mesh(world(), comm::MeshDims{1, 2, 2, 1});
  o = {};
  o.sharding = Sharding::HybridShard;
  for (const Case& c : cases()) expect_parity(c, o, "HYBRID_SHARD 2x2", &mesh);
}

// Gradient accumulation under no_sync and global-norm clipping, on the Net:
// two micro-batches per rank and step, the norm clipped to below its value.
TEST(FullyShard, NoSyncAccumulationAndClippingMatch) {
  const Case c = cases()[1];
  for (Sharding s : {Sharding::Zero2, Sharding::FullShard}) {
    auto m = c.make();
    ShardedOptions o;
    o.sharding = s;
    auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
    torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
    auto ref = c.make();
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
    const int64_t n = kBatch / world().size(), micro = n / 2;
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(c, step);
      engine->zero_grad();
      for (int k = 0; k < 2; ++k) {
        const int64_t first = world().rank() * n + k * micro;
        auto loss = torch::nll_loss(c.forward(*m, x.narrow(0, first, micro)), y.narrow(0, first, micro)) / 2;
        if (k == 0) {
          auto guard = engine->no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      const double norm = engine->clip_grad_norm(0.05);
      opt.step();
      engine->after_step();
      ref_opt.zero_grad();
      torch::nll_loss(c.forward(*ref, x), y).backward();
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
      ref_opt.step();
      EXPECT_NEAR(norm, ref_norm, 1e-10 * ref_norm) << parallel::fsdp::to_string(s) << " step " << step;
      EXPECT_GT(ref_norm, 0.05) << "clipping must act for the test to mean anything";
    }
    EXPECT_LE(relative_diff(engine->full_parameters(), ref->parameters(), true), 1e-10) << parallel::fsdp::to_string(s);
  }
}

TEST(FullyShard, UnitsAreFreedBetweenUses) {
  const Case c = cases()[2];  // the ResNet: two block units and the root
  auto m = c.make();
  ShardedOptions o;
  o.sharding = Sharding::FullShard;
  for (auto& b : m->buffers()) b.fill_(world().rank() + 1);  // differ per rank
  auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
  EXPECT_EQ(engine->num_units(), 3);
  for (auto& b : m->buffers()) EXPECT_EQ(b.max().item<double>(), 1.0) << "buffers start as rank 0's";
  auto [x, y] = batch(c, 0);
  engine->reset_stats();
  torch::nll_loss(c.forward(*m, x.narrow(0, 0, 4)), y.narrow(0, 0, 4)).backward();
  // The root once (until backward ends); both blocks in forward; in backward
  // block 1 again (block 2, the last forward used, was never freed).
  EXPECT_EQ(engine->stats().all_gathers, 4);
  // After backward only the shards are held.
  int64_t shard_bytes = 0;
  for (auto& s : engine->shards()) shard_bytes += s.nbytes();
  EXPECT_EQ(engine->param_bytes(), shard_bytes);
}

// Note [Step protocol]: the mistakes that would otherwise train wrongly in
// silence are exceptions that say what to do.
TEST(FullyShard, StepProtocolMistakesAreLoud) {
  const Case c = cases()[0];
  auto [x, y] = batch(c, 0);
  const int64_t n = kBatch / world().size();
  auto backward = [&](torch::nn::Module& m) {
    torch::nll_loss(torch::log_softmax(c.forward(m, x.narrow(0, world().rank() * n, n)), 1),
                    y.narrow(0, world().rank() * n, n))
        .backward();
  };
  auto expect_usage_error = [](const std::function<void()>& f, const std::string& part, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << what << ": no error";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << what << ": " << e.what();
    }
  };
  for (Sharding s : {Sharding::Zero2, Sharding::FullShard}) {
    ShardedOptions o;
    o.sharding = s;
    const std::string name = parallel::fsdp::to_string(s);
    {  // the optimizer over the module's parameters: it steps nothing the engine keeps
      auto m = c.make();
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
      backward(*m);
      opt.step();
      expect_usage_error([&] { engine->after_step(); }, "build the optimizer over engine->shards()",
                         name + " optimizer over parameters");
    }
    for (bool via_backward : {false, true}) {  // a step without after_step()
      auto m = c.make();
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
      backward(*m);
      opt.step();
      if (via_backward) {
        opt.zero_grad();
        expect_usage_error([&] { backward(*m); }, "after_step() was not called", name + " next backward");
      } else {
        expect_usage_error([&] { engine->zero_grad(); }, "after_step() was not called", name + " zero_grad");
      }
    }
    {  // a skipped step (both skipped) is not a mistake
      auto m = c.make();
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
      backward(*m);
      EXPECT_NO_THROW(engine->zero_grad()) << name;
      backward(*m);
      opt.step();
      EXPECT_NO_THROW(engine->after_step()) << name;
      EXPECT_NO_THROW(engine->zero_grad()) << name;
    }
  }
}

TEST(FullyShard, WrapPoliciesNameWhatIsWrong) {
  auto m = Toy();
  auto expect_error = [&](ModuleUnits u, const std::string& part) {
    try {
      parallel::fsdp::select_units(*m, u);
      ADD_FAILURE() << "accepted a policy that should name '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  ModuleUnits u;
  u.names = {"net3"};
  expect_error(u, "no submodule 'net3'");
  u = {};
  u.types = {"Conv2dImpl"};
  expect_error(u, "no submodule is of type 'Conv2dImpl'");
  u = {};
  u.min_num_params = 1000000;
  expect_error(u, "chose no submodule");
  // A module wrapped twice.
  u = {};
  u.names = {"net1"};
  auto engine = parallel::fsdp::fully_shard(m.ptr(), world(), *world().group(), u);
  try {
    parallel::fsdp::fully_shard(m.ptr(), world(), *world().group(), u);
    ADD_FAILURE() << "a module wrapped twice was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("wrapped twice"), std::string::npos) << e.what();
  }
  auto r = ResNet();
  u = {};
  u.names = {"layer1", "layer1.0"};
  try {
    parallel::fsdp::select_units(*r, u);
    ADD_FAILURE() << "nested units accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'layer1.0' lies inside 'layer1'"), std::string::npos) << e.what();
  }
  u = {};
  u.min_num_params = 1000;  // each BasicBlock holds 1,184 (a conv 576); the stem 224, fc 90
  EXPECT_EQ(parallel::fsdp::select_units(*r, u), (std::vector<std::string>{"layer1.0", "layer1.1"}));
}

}  // namespace
}  // namespace scaletrain::test

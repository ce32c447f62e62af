// fully_shard on modules that are not ours: the ToyModel, the MNIST Net of
// pytorch/examples, a small ResNet with BatchNorm and an LSTM language
// model (weights read at every time step), under every sharding strategy,
// against one process (float64, 1e-10); with offloaded shards (float64) and
// with bf16 weights and fp32 masters (Note [bf16 user modules]). The
// modules' forward is theirs: units are gathered when operators read them
// (Note [Gather on use]). Misuse is named: a forward on another thread, a
// unit that took no part in a step, the step protocol.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <thread>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/util/error.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace fully_shard_test {

using parallel::fsdp::ModuleUnits;
using parallel::fsdp::ShardedDataParallel;
using parallel::fsdp::ShardedOptions;
using parallel::fsdp::Sharding;
using Inspect = std::function<void(ShardedDataParallel&)>;  // runs while the engine lives

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
  return {
      name,
      [] {
        torch::manual_seed(3);
        auto m = M();
        m->to(at::kDouble);
        return std::static_pointer_cast<torch::nn::Module>(m.ptr());
      },
      [](torch::nn::Module& m, const at::Tensor& x) { return dynamic_cast<typename M::ContainedType&>(m).forward(x); },
      input,
      classes,
      units};
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

// FSDP2's habit (Note [Nested fully_shard]): each unit's submodule under
// fully_shard first, then the module with no units of its own; the
// submodules' engines live on, emptied, until the end.
std::vector<std::unique_ptr<ShardedDataParallel>> shard_units_first(const Case& c, torch::nn::Module& m,
                                                                   comm::Group& shard, const ShardedOptions& o,
                                                                   comm::Group* replicate) {
  std::vector<std::unique_ptr<ShardedDataParallel>> blocks;
  auto modules = m.named_modules();
  for (const std::string& name : parallel::fsdp::select_units(m, c.units))
    blocks.push_back(parallel::fsdp::fully_shard(modules[name], world(), shard, {}, o, replicate));
  return blocks;
}

std::vector<at::Tensor> train_sharded(const Case& c, ShardedOptions o, comm::Mesh* hybrid = nullptr,
                                      const Inspect& inspect = {}, bool nested = false) {
  auto m = c.make();
  comm::Group& shard = hybrid ? hybrid->dp_shard() : *world().group();
  comm::Group* replicate = hybrid ? &hybrid->dp_replicate() : nullptr;
  auto blocks = nested ? shard_units_first(c, *m, shard, o, replicate)
                       : std::vector<std::unique_ptr<ShardedDataParallel>>{};
  auto engine = parallel::fsdp::fully_shard(m, world(), shard, nested ? ModuleUnits{} : c.units, o, replicate);
  if (nested) {
    std::vector<std::string> want{engine->unit_names().front()};
    for (const std::string& n : parallel::fsdp::select_units(*c.make(), c.units)) want.push_back(n);
    EXPECT_EQ(engine->unit_names(), want) << c.name;
  }
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
  if (inspect) inspect(*engine);
  return engine->full_parameters();
}

void expect_parity(const Case& c, const ShardedOptions& o, const std::string& what, comm::Mesh* hybrid = nullptr,
                   const Inspect& inspect = {}, bool nested = false) {
  const bool batchnorm = c.name == "resnet";
  auto want = train_alone(c, batchnorm ? world().size() : 1);
  auto got = train_sharded(c, o, hybrid, inspect, nested);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(relative_diff(got, want, /*per_tensor=*/true), 1e-10) << c.name << " " << what;
  auto init = c.make()->parameters();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_GT((got[i] - init[i]).abs().max().item<double>(), 1e-4) << c.name << " " << what << ": tensor " << i;
}

void expect_usage_error(const std::function<void()>& f, const std::vector<std::string>& parts,
                        const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const UsageError& e) {
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << what << ": " << e.what();
  }
}

TEST(FullyShard, UserModulesMatchOneProcessUnderEveryStrategy) {
  for (const Case& c : cases())
    for (Sharding s : {Sharding::Zero1, Sharding::Zero2, Sharding::Zero3, Sharding::FullShard, Sharding::ShardGradOp}) {
      ShardedOptions o;
      o.sharding = s;
      expect_parity(c, o, parallel::fsdp::to_string(s));
    }
}

// FSDP2's habit composes into one engine whose units are the submodules
// sharded first, matching one process as the one-call form does.
TEST(FullyShard, NestedCallsComposeIntoOneEngine) {
  for (const Case& c : cases())
    for (Sharding s : {Sharding::Zero2, Sharding::FullShard}) {
      ShardedOptions o;
      o.sharding = s;
      expect_parity(c, o, "nested " + parallel::fsdp::to_string(s), nullptr, {}, /*nested=*/true);
    }
}

// What cannot compose is named: other options, a submodule's engine with
// units of its own; an engine taken in says so when called.
TEST(FullyShard, NestedCallsThatCannotComposeAreNamed) {
  auto expect_invalid = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error naming '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const Case resnet = cases()[2];
  auto m = resnet.make();
  auto modules = m->named_modules();
  ShardedOptions grad_op;
  grad_op.sharding = Sharding::ShardGradOp;
  auto first = parallel::fsdp::fully_shard(modules["layer1.0"], world(), *world().group(), {}, grad_op);
  expect_invalid([&] { parallel::fsdp::fully_shard(m, world(), *world().group(), {}); },
                 "submodule 'layer1.0' is under fully_shard already, with other options (sharding SHARD_GRAD_OP and "
                 "FULL_SHARD)");
  first.reset();
  auto m2 = resnet.make();
  ModuleUnits convs;
  convs.types = {"Conv2dImpl"};
  auto with_units = parallel::fsdp::fully_shard(m2->named_modules()["layer1.1"], world(), *world().group(), convs);
  expect_invalid([&] { parallel::fsdp::fully_shard(m2, world(), *world().group(), {}); },
                 "submodule 'layer1.1' is under fully_shard already, with units of its own (conv1, ...), and units "
                 "do not nest");
  auto m3 = resnet.make();
  auto block = parallel::fsdp::fully_shard(m3->named_modules()["layer1.0"], world(), *world().group(), {});
  auto root = parallel::fsdp::fully_shard(m3, world(), *world().group(), {});
  expect_usage_error([&] { block->shards(); }, {"the engine of submodule 'layer1.0' was taken in by fully_shard"},
                     "an absorbed engine");
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
      expect_usage_error([&] { engine->after_step(); }, {"build the optimizer over engine->shards()"},
                         name + " optimizer over parameters");
    }
    {  // Note [Spent gradients]: Adam built before fully_shard, libtorch's zero_grad, no after_step()
      auto m = c.make();
      torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.1));
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      opt.zero_grad();
      backward(*m);
      opt.step();  // noted: it read the gradient of net1.weight, which the module no longer gets
      opt.zero_grad();
      expect_usage_error([&] { backward(*m); },
                         {"the gradient of parameter 'net1.weight' was read through the module",
                          "build the optimizer over engine->shards()"},
                         name + " optimizer built before fully_shard");
    }
    for (bool via_backward : {false, true}) {  // a step without after_step()
      auto m = c.make();
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
      backward(*m);
      opt.step();
      if (via_backward) {
        opt.zero_grad();
        expect_usage_error([&] { backward(*m); }, {"after_step() was not called"}, name + " next backward");
      } else {
        expect_usage_error([&] { engine->zero_grad(); }, {"after_step() was not called"}, name + " zero_grad");
      }
    }
    {  // a skipped step (both skipped) is not a mistake, nor the module's zero_grad()
      auto m = c.make();
      auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
      torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
      backward(*m);
      m->zero_grad();  // the module's own zero_grad only clears: not a read
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
  // Across engines (issue 58): DDP over a sharded module, fully_shard over one under DDP.
  try {
    parallel::DistributedDataParallel ddp(m.ptr(), *world().group());
    ADD_FAILURE() << "DDP over a sharded module was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is already sharded by fully_shard (the module is wrapped twice)"),
              std::string::npos)
        << e.what();
  }
  {
    auto plain = std::make_shared<torch::nn::LinearImpl>(4, 4);
    parallel::DistributedDataParallel ddp(plain, *world().group());
    try {
      parallel::fsdp::fully_shard(plain, world(), *world().group(), ModuleUnits{});
      ADD_FAILURE() << "fully_shard over a module under DDP was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("parameter 'weight' is already in a live DDP (the module is wrapped twice)"),
                std::string::npos)
          << e.what();
    }
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

// Note [Gather on use], the thread rule: a forward on a thread that did not
// call fully_shard is named by the engine's next call, once.
TEST(FullyShard, ForwardOnAnotherThreadIsNamed) {
  const Case toy = cases()[0];  // units net1 and net2
  auto [x, y] = batch(toy, 0);
  const int64_t n = kBatch / world().size();
  const at::Tensor xs = x.narrow(0, world().rank() * n, n), ys = y.narrow(0, world().rank() * n, n);
  for (Sharding s : {Sharding::Zero2, Sharding::FullShard}) {
    const std::string name = parallel::fsdp::to_string(s);
    auto m = toy.make();
    ShardedOptions o;
    o.sharding = s;
    auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), toy.units, o);
    torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
    std::string failed;  // what the forward on the other thread threw
    std::thread other([&] {
      try {
        toy.forward(*m, xs);
      } catch (const std::exception& e) {
        failed = e.what();
      }
    });
    other.join();
    // ZeRO-2 keeps whole parameters, so that forward ran (on values that go
    // stale after a step); FULL_SHARD's are freed, so libtorch refused it.
    EXPECT_EQ(failed.empty(), s == Sharding::Zero2) << name << ": " << failed;
    expect_usage_error([&] { engine->zero_grad(); },
                       {"parameter 'net1.weight' of unit 'net1'",
                        "run the module's forward and backward on the thread that called fully_shard"},
                       name);
    EXPECT_NO_THROW({  // reported once; the engine's own thread trains on
      engine->zero_grad();
      torch::nll_loss(toy.forward(*m, xs), ys).backward();
      opt.step();
      engine->after_step();
    }) << name;
  }
  // Intra-op workers running parts of the engine's own operators are not another thread.
  const Case resnet = cases()[2];
  auto m = resnet.make();
  auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), resnet.units);
  torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.1));
  auto [rx, ry] = batch(resnet, 0);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_NO_THROW({
    torch::nll_loss(resnet.forward(*m, rx.narrow(0, world().rank() * n, n)), ry.narrow(0, world().rank() * n, n))
        .backward();
    opt.step();
    engine->after_step();
    engine->zero_grad();
  });
  at::set_num_threads(threads);
}

// Note [Units that took no part]: the head forward skips (units body, head, aux).
Case two_heads() {
  ModuleUnits u;
  u.names = {"body", "head", "aux"};
  return make_case<TwoHeads>("two_heads", {10}, 5, u);
}
TwoHeadsImpl& heads(torch::nn::Module& m) { return dynamic_cast<TwoHeadsImpl&>(m); }

TEST(FullyShard, UnitThatTookNoPartIsLoud) {
  const Case c = two_heads();
  auto [x, y] = batch(c, 0);
  const int64_t n = kBatch / world().size(), first = world().rank() * n, half = n / 2;
  auto loss = [&](torch::nn::Module& m, int64_t from, int64_t count) {
    return torch::nll_loss(c.forward(m, x.narrow(0, from, count)), y.narrow(0, from, count));
  };
  for (Sharding s : {Sharding::Zero1, Sharding::Zero2, Sharding::FullShard}) {
    const std::string name = parallel::fsdp::to_string(s);
    auto m = c.make();
    ShardedOptions o;
    o.sharding = s;
    auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
    torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
    heads(*m).use_aux = false;
    const std::vector<std::string> said{"unit 'aux' took no part in this step", "allow_unused_units"};
    expect_usage_error([&] { loss(*m, first, n).backward(); }, said, name + " backward");
    opt.step();
    expect_usage_error([&] { engine->after_step(); }, said, name + " after_step");
    EXPECT_NO_THROW(engine->zero_grad()) << name << ": zero_grad discards the step's gradients";
    // Gradients count over the step: a micro-batch under no_sync used the head.
    heads(*m).use_aux = true;
    {
      auto guard = engine->no_sync();
      loss(*m, first, half).backward();
    }
    heads(*m).use_aux = false;
    EXPECT_NO_THROW(loss(*m, first + half, n - half).backward()) << name << ": micro-batches";
  }
}

// The head runs at steps 1 and 3 only. One process, a parameter without a
// gradient either stepped with zeros (libtorch's zero_grad() leaves zeros
// once it had one) or skipped by Adam (no gradient at all).
bool aux_runs(int step) { return step % 2 == 1; }
std::vector<at::Tensor> train_two_heads_alone(const Case& c, bool zeros) {
  auto m = c.make();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(c, s);
    heads(*m).use_aux = aux_runs(s);
    for (auto& p : m->parameters()) p.mutable_grad().reset();
    torch::nll_loss(c.forward(*m, x), y).backward();
    for (auto& p : m->parameters())
      if (zeros && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    opt.step();
  }
  return m->parameters();
}

TEST(FullyShard, AllowedUnusedUnitsStepWithZeroGradients) {
  const Case c = two_heads();
  const auto zeros = train_two_heads_alone(c, true), skipped = train_two_heads_alone(c, false);
  ASSERT_GT(relative_diff(zeros, skipped, /*per_tensor=*/true), 1e-3) << "the two conventions must differ";
  const int64_t n = kBatch / world().size();
  for (Sharding s : {Sharding::Zero2, Sharding::FullShard}) {
    auto m = c.make();
    ShardedOptions o;
    o.sharding = s;
    o.allow_unused_units = true;
    auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
    torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(c, step);
      heads(*m).use_aux = aux_runs(step);
      engine->zero_grad();
      torch::nll_loss(c.forward(*m, x.narrow(0, world().rank() * n, n)), y.narrow(0, world().rank() * n, n)).backward();
      opt.step();
      engine->after_step();
    }
    EXPECT_LE(relative_diff(engine->full_parameters(), zeros, /*per_tensor=*/true), 1e-10)
        << parallel::fsdp::to_string(s);
  }
}

// Note [Offloaded shards] on user modules: optimizer offload and parameter
// offload against one process (float64), the shards and their gradients
// from the offload allocator.
TEST(FullyShard, OffloadedShardsMatchOneProcess) {
  struct Run {
    Sharding sharding;
    bool params;
  };
  for (const Case& c : {cases()[0], cases()[2]})  // the ToyModel, the ResNet with BatchNorm
    for (Run run : {Run{Sharding::Zero1, false}, Run{Sharding::Zero2, false}, Run{Sharding::FullShard, false},
                    Run{Sharding::Zero3, true}, Run{Sharding::FullShard, true}, Run{Sharding::ShardGradOp, true}}) {
      auto allocs = std::make_shared<std::atomic<int>>(0);
      ShardedOptions o;
      o.sharding = run.sharding;
      o.offload_params = run.params;
      o.offload_alloc = [allocs](int64_t numel, at::ScalarType dtype, bool) {
        ++*allocs;
        return at::empty({numel}, at::TensorOptions().dtype(dtype));
      };
      const std::string what =
          parallel::fsdp::to_string(run.sharding) + (run.params ? " parameter" : " optimizer") + " offload";
      expect_parity(c, o, what, nullptr, [&](ShardedDataParallel& e) {
        int64_t shard_bytes = 0;
        for (const auto& t : e.shards()) shard_bytes += static_cast<int64_t>(t.nbytes());
        EXPECT_GT(allocs->load(), 0) << c.name << " " << what;
        EXPECT_EQ(e.offloaded_bytes(), 2 * shard_bytes) << c.name << " " << what << ": shards and gradients offloaded";
      });
    }
}

// Note [bf16 user modules]: bf16 weights, fp32 masters stepped by Adam, the
// gradients reduced in fp32 or bf16. Each rank's bf16 gradient of its slice
// is the same computation in one process (same operators, same values), so
// the reference forms exactly those, sums them in fp32 in rank order and
// averages them as the reduce does (rounding the mean to bf16 for a bf16
// reduce). What remains is fp32 summation order and Adam on flat shards:
// the fp32 bound, 1e-5 relative, holds where comparing with one process on
// the whole batch needs the median bounds of Note [bf16 parity bounds].
struct Bf16Mode {
  Sharding sharding;
  at::ScalarType reduce;
  bool offload = false;  // parameter offload
};

std::vector<at::Tensor> train_bf16_alone(const Case& c, at::ScalarType reduce) {
  auto m = c.make();
  m->to(at::kBFloat16);
  auto params = m->parameters();
  std::vector<at::Tensor> master;
  for (auto& p : params) master.push_back(p.detach().to(at::kFloat).clone());
  torch::optim::Adam opt(master, torch::optim::AdamOptions(1e-2));
  const int ranks = world().size();
  const int64_t n = kBatch / ranks;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(c, s);
    std::vector<at::Tensor> sum(params.size());
    for (int r = 0; r < ranks; ++r) {
      for (auto& p : params) p.mutable_grad().reset();
      torch::nll_loss(c.forward(*m, x.narrow(0, r * n, n).to(at::kBFloat16)), y.narrow(0, r * n, n)).backward();
      for (size_t i = 0; i < params.size(); ++i)
        sum[i] = r == 0 ? params[i].grad().to(at::kFloat) : sum[i].add_(params[i].grad().to(at::kFloat));
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      sum[i].div_(ranks);
      master[i].mutable_grad() = reduce == at::kBFloat16 ? sum[i].to(at::kBFloat16).to(at::kFloat) : sum[i];
    }
    opt.step();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(master[i]);
  }
  return master;
}

// The fp32 masters whole: every rank fills its pieces, a sum assembles them.
std::vector<at::Tensor> whole_masters(const ShardedDataParallel& e, const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> full;
  for (const auto& item : m.named_parameters()) full[item.key()] = at::zeros({item.value().numel()}, at::kFloat);
  for (const auto& view : e.shard_views())
    for (const auto& piece : view.pieces)
      full[piece.name]
          .narrow(0, piece.param_offset, piece.numel)
          .copy_(view.shard.narrow(0, piece.shard_offset, piece.numel));
  std::vector<at::Tensor> out;
  for (const auto& item : m.named_parameters()) {
    world().group()->all_reduce(full[item.key()]).wait();
    out.push_back(full[item.key()].view(item.value().sizes()));
  }
  return out;
}

std::vector<at::Tensor> train_bf16_sharded(const Case& c, const Bf16Mode& mode, const std::string& what) {
  auto m = c.make();
  m->to(at::kBFloat16);
  ShardedOptions o;
  o.sharding = mode.sharding;
  o.master_dtype = at::kFloat;
  o.reduce_dtype = mode.reduce;
  if (mode.offload) {
    o.offload_params = true;
    o.offload_alloc = [](int64_t numel, at::ScalarType dtype, bool) { return at::empty({numel}, dtype); };
  }
  auto engine = parallel::fsdp::fully_shard(m, world(), *world().group(), c.units, o);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
  const int64_t n = kBatch / world().size();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(c, s);
    engine->zero_grad();
    auto out = c.forward(*m, x.narrow(0, world().rank() * n, n).to(at::kBFloat16));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16) << what;
    torch::nll_loss(out, y.narrow(0, world().rank() * n, n)).backward();
    opt.step();
    engine->after_step();
  }
  for (const auto& t : engine->shards()) EXPECT_EQ(t.scalar_type(), at::kFloat) << what << ": fp32 masters";
  if (mode.offload) EXPECT_GT(engine->offloaded_bytes(), 0) << what;
  return whole_masters(*engine, *m);
}

TEST(FullyShard, Bf16WeightsWithFp32MastersMatchOneProcess) {
  const std::vector<Bf16Mode> modes{{Sharding::Zero1, at::kFloat},          {Sharding::Zero2, at::kFloat},
                                    {Sharding::Zero2, at::kBFloat16},       {Sharding::FullShard, at::kFloat},
                                    {Sharding::FullShard, at::kBFloat16},   {Sharding::ShardGradOp, at::kFloat},
                                    {Sharding::FullShard, at::kFloat, true}};
  for (const Case& c : {cases()[0], cases()[2]}) {  // the ToyModel, the ResNet with BatchNorm
    std::map<at::ScalarType, std::vector<at::Tensor>> want;
    for (at::ScalarType reduce : {at::kFloat, at::kBFloat16}) want[reduce] = train_bf16_alone(c, reduce);
    EXPECT_GT(relative_diff(want[at::kFloat], want[at::kBFloat16], false), 1e-5)
        << c.name << ": a bf16 reduce must round differently, or the test cannot tell the modes apart";
    auto init = c.make()->parameters();
    for (const Bf16Mode& mode : modes) {
      const std::string what = c.name + " " + parallel::fsdp::to_string(mode.sharding) + " bf16 weights, " +
                               (mode.reduce == at::kFloat ? "fp32" : "bf16") + " reduce" +
                               (mode.offload ? ", parameter offload" : "");
      const auto got = train_bf16_sharded(c, mode, what);
      EXPECT_LE(relative_diff(got, want[mode.reduce], /*per_tensor=*/false), 1e-5) << what;
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_GT((got[i] - init[i].to(at::kFloat)).abs().max().item<double>(), 1e-3) << what << ": tensor " << i;
    }
  }
}

}  // namespace fully_shard_test
}  // namespace scaletrain::test

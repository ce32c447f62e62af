// fully_shard's full state dict on user modules (run with the FullyShard
// entries): it equals the plain module's named parameters and buffers; one
// loaded into the shards comes back out whole and is what the module then
// computes with, under ZeRO-2 (weights kept whole) and FULL_SHARD (gathered
// on use); a dict that does not fit is named before anything is written; and
// parameters on two devices are named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "dist_env.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace fully_shard_state_test {

using parallel::fsdp::ModuleUnits;
using parallel::fsdp::Sharding;
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

ResNet make_resnet() {
  torch::manual_seed(9);
  ResNet m;
  m->to(at::kDouble);
  return m;
}

ModuleUnits blocks() {
  ModuleUnits u;
  u.types = {"BasicBlockImpl"};
  return u;
}

// Every entry of `want` equal in `got`, and nothing else there.
void expect_same(const StateDict& got, const StateDict& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& item : want) {
    const at::Tensor* t = got.find(item.key());
    ASSERT_NE(t, nullptr) << what << ": no " << item.key();
    EXPECT_TRUE(t->equal(item.value())) << what << ": " << item.key();
  }
}

StateDict plain_state(torch::nn::Module& m) {
  StateDict out;
  for (const auto& item : m.named_parameters()) out.insert(item.key(), item.value().detach().clone());
  for (const auto& item : m.named_buffers()) out.insert(item.key(), item.value().detach().clone());
  return out;
}

TEST(FullyShardState, FullStateDictRoundTripsIntoWhatTheModuleComputes) {
  // Another model's weights, and running statistics that are not the initial ones.
  StateDict other;
  {
    torch::manual_seed(21);
    ResNet donor;
    donor->to(at::kDouble);
    donor->forward(at::randn({4, 3, 8, 8}, at::kDouble));  // moves the running statistics
    other = plain_state(*donor);
  }
  const at::Tensor x = at::randn({3, 3, 8, 8}, at::detail::createCPUGenerator(5), at::kDouble);
  for (Sharding sharding : {Sharding::Zero2, Sharding::FullShard}) {
    const std::string what = parallel::fsdp::to_string(sharding);
    ResNet m = make_resnet();
    const StateDict initial = plain_state(*m);
    parallel::fsdp::ShardedOptions o;
    o.sharding = sharding;
    auto engine = parallel::fsdp::fully_shard(m.ptr(), world(), *world().group(), blocks(), o);
    expect_same(engine->full_state_dict(), initial, what + ", before loading");
    engine->load_full_state_dict(other);
    expect_same(engine->full_state_dict(), other, what + ", after loading");
    // The module computes with what was loaded (evaluation: the running statistics too).
    ResNet reference = make_resnet();
    {
      torch::NoGradGuard no_grad;
      for (auto& item : reference->named_parameters()) item.value().copy_(other[item.key()]);
      for (auto& item : reference->named_buffers()) item.value().copy_(other[item.key()]);
    }
    reference->eval();
    m->eval();
    torch::NoGradGuard no_grad;
    EXPECT_LE((m->forward(x) - reference->forward(x)).abs().max().item<double>(), 1e-12) << what;
  }
}

TEST(FullyShardState, LoadNamesWhatDoesNotFit) {
  ResNet m = make_resnet();
  auto engine = parallel::fsdp::fully_shard(m.ptr(), world(), *world().group(), blocks());
  const StateDict good = engine->full_state_dict();
  auto expect_refused = [&](const StateDict& bad, const std::string& part) {
    try {
      engine->load_full_state_dict(bad);
      ADD_FAILURE() << "accepted; expected an error naming '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
    expect_same(engine->full_state_dict(), good, part + ": nothing written");
  };
  StateDict missing;
  for (const auto& item : good)
    if (item.key() != "fc.bias") missing.insert(item.key(), item.value() + 1);
  expect_refused(missing, "no tensor for 'fc.bias'");
  StateDict unknown = good;
  unknown.insert("fc.scale", at::ones({1}, at::kDouble));
  expect_refused(unknown, "the module has no 'fc.scale'");
  StateDict reshaped;
  for (const auto& item : good)
    reshaped.insert(item.key(), item.key() == "fc.weight" ? item.value().t().contiguous() + 1 : item.value() + 1);
  expect_refused(reshaped, "'fc.weight' has shape [8, 10], the module's is [10, 8]");
}

TEST(FullyShardState, ParametersOnTwoDevicesAreNamed) {
  auto m = std::make_shared<torch::nn::Module>();
  m->register_module("net1", torch::nn::Linear(4, 4));
  auto net2 = m->register_module("net2", std::make_shared<torch::nn::Module>());
  net2->register_parameter("weight", torch::empty({4, 4}, torch::TensorOptions().device(torch::kMeta)));
  ModuleUnits u;
  u.names = {"net1", "net2"};
  try {
    parallel::fsdp::fully_shard(m, world(), *world().group(), u);
    ADD_FAILURE() << "parameters on cpu and meta were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find("parameters on different devices: 'net1.weight' on cpu, 'net2.weight' on meta"),
        std::string::npos)
        << e.what();
  }
}

}  // namespace fully_shard_state_test
}  // namespace scaletrain::test

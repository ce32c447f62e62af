// SyncBatchNorm (parallel/ddp/sync_batchnorm.h) against one process on the
// whole batch: a GAN of two modules with BatchNorm and two optimizers under
// DDP, images through the layer alone, and the misuses it names.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>

#include "dist_env.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/ddp/sync_batchnorm.h"
#include "scaletrain/parallel/fsdp/fsdp.h"

namespace scaletrain::test {
namespace sync_batchnorm_test {

constexpr int64_t kBatch = 12;  // the whole batch; 2, 3 and 4 ranks divide it

at::Tensor whole(int64_t seed, std::vector<int64_t> shape) {
  return at::randn(shape, at::detail::createCPUGenerator(seed), at::kDouble);
}
at::Tensor my_part(const at::Tensor& t) {
  const int64_t b = t.size(0) / world().size();
  return t.narrow(0, world().rank() * b, b);
}

using Net = std::shared_ptr<torch::nn::SequentialImpl>;

// Generator and discriminator with BatchNorm, BN torch::nn::BatchNorm1d (the
// reference) or SyncBatchNorm. The Linear before each BN has no bias: BN
// removes it, its gradient is zero, and Adam would turn the rounding noise
// of that zero into steps of the learning rate's size.
template <class BN>
Net generator() {
  auto g = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(torch::nn::LinearOptions(4, 8).bias(false)),
                                                       BN(8), torch::nn::ReLU(), torch::nn::Linear(8, 6));
  g->to(at::kDouble);
  return g;
}
template <class BN>
Net discriminator() {
  auto d = std::make_shared<torch::nn::SequentialImpl>(
      torch::nn::Linear(6, 8), torch::nn::LeakyReLU(), torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false)),
      BN(8), torch::nn::LeakyReLU(), torch::nn::Linear(8, 1));
  d->to(at::kDouble);
  return d;
}

at::Tensor bce(const at::Tensor& logits, double target) {
  return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
}

// Three GAN steps (discriminator, then generator) on `part` of each step's
// whole batch; returns every parameter and buffer of both, by name.
std::map<std::string, at::Tensor> train_gan(Net g, Net d, const std::function<at::Tensor(const at::Tensor&)>& part) {
  torch::optim::Adam g_opt(g->parameters(), torch::optim::AdamOptions(1e-2).betas({0.5, 0.999}));
  torch::optim::Adam d_opt(d->parameters(), torch::optim::AdamOptions(1e-2).betas({0.5, 0.999}));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor real = part(whole(10 + step, {kBatch, 6}) * 2 + 1);
    const at::Tensor z = part(whole(20 + step, {kBatch, 4}));
    d_opt.zero_grad();
    (bce(d->forward(real), 1.0) + bce(d->forward(g->forward(z).detach()), 0.0)).backward();
    d_opt.step();
    g_opt.zero_grad();
    bce(d->forward(g->forward(z)), 1.0).backward();
    g_opt.step();
  }
  std::map<std::string, at::Tensor> out;
  for (auto* m : {&g, &d}) {
    const std::string prefix = m == &g ? "g." : "d.";
    for (auto& p : (*m)->named_parameters()) out[prefix + p.key()] = p.value().detach().clone();
    for (auto& b : (*m)->named_buffers()) out[prefix + b.key()] = b.value().clone();
  }
  return out;
}

double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (auto& [name, t] : a) {
    EXPECT_EQ(b.count(name), 1u) << name;
    if (b.count(name) == 1)
      worst = std::max(worst, (t.to(at::kDouble) - b.at(name).to(at::kDouble)).abs().max().item<double>());
  }
  return worst;
}

std::map<std::string, at::Tensor> one_process() {
  torch::manual_seed(3);
  auto g = generator<torch::nn::BatchNorm1d>();
  auto d = discriminator<torch::nn::BatchNorm1d>();
  return train_gan(g, d, [](const at::Tensor& t) { return t; });
}

// Each rank trains on its part of the batch; SyncBatchNorm makes the run the
// one process's on the whole batch, parameters and running statistics alike.
TEST(SyncBatchNormDDP, AGanMatchesOneProcessOnTheWholeBatch) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const auto reference = one_process();
  torch::manual_seed(3);
  auto g = generator<parallel::SyncBatchNorm>();
  auto d = discriminator<parallel::SyncBatchNorm>();
  auto& group = *world().group();
  EXPECT_EQ(parallel::convert_sync_batchnorm(*g, group) + parallel::convert_sync_batchnorm(*d, group), 2);
  parallel::DistributedDataParallel g_ddp(g, group), d_ddp(d, group);
  const double diff = max_difference(train_gan(g, d, my_part), reference);
  EXPECT_LT(diff, 1e-10) << "largest difference from one process on the whole batch";
}

// The same run with plain BatchNorm normalizes each rank's part alone: far
// from the whole batch's run (what the test above would see without sync).
TEST(SyncBatchNormDDP, PlainBatchNormDoesNotMatch) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  const auto reference = one_process();
  torch::manual_seed(3);
  auto g = generator<torch::nn::BatchNorm1d>();
  auto d = discriminator<torch::nn::BatchNorm1d>();
  parallel::DistributedDataParallel g_ddp(g, *world().group()), d_ddp(d, *world().group());
  EXPECT_GT(max_difference(train_gan(g, d, my_part), reference), 1e-4);
}

// [N, C, H, W] through the layer alone: output, input gradient, parameter
// gradients (summed over ranks) and running statistics against F::batch_norm
// on the whole batch; then evaluation uses the running statistics.
TEST(SyncBatchNormDDP, ImagesMatchTheWholeBatch) {
  const at::Tensor x = whole(5, {kBatch, 3, 4, 4}) * 3 - 1;
  const at::Tensor w = whole(6, {kBatch, 3, 4, 4});  // weights the loss
  torch::nn::BatchNorm2d ref(torch::nn::BatchNormOptions(3).momentum(0.3));
  ref->to(at::kDouble);
  parallel::SyncBatchNorm bn(torch::nn::BatchNormOptions(3).momentum(0.3));
  bn->to(at::kDouble);
  for (auto* m : std::vector<torch::nn::Module*>{ref.get(), bn.get()}) {
    torch::NoGradGuard no_grad;
    m->named_parameters()["weight"].copy_(whole(7, {3}));
    m->named_parameters()["bias"].copy_(whole(8, {3}));
  }
  parallel::convert_sync_batchnorm(*bn, *world().group());
  const at::Tensor rx = x.clone().requires_grad_(true);
  const at::Tensor ry = ref(rx);
  (ry * w).sum().backward();
  const at::Tensor mx = my_part(x).clone().requires_grad_(true);
  const at::Tensor my = bn(mx);
  (my * my_part(w)).sum().backward();
  EXPECT_LT((my - my_part(ry)).abs().max().item<double>(), 1e-12);
  EXPECT_LT((mx.grad() - my_part(rx.grad())).abs().max().item<double>(), 1e-12);
  for (const char* name : {"weight", "bias"}) {
    at::Tensor g = bn->named_parameters()[name].grad().clone();
    world().group()->all_reduce(g).wait();
    EXPECT_LT((g - ref->named_parameters()[name].grad()).abs().max().item<double>(), 1e-12) << name;
  }
  for (const char* name : {"running_mean", "running_var", "num_batches_tracked"})
    EXPECT_LT((bn->named_buffers()[name].to(at::kDouble) - ref->named_buffers()[name].to(at::kDouble))
                  .abs()
                  .max()
                  .item<double>(),
              1e-12)
        << name;
  bn->eval();
  ref->eval();
  EXPECT_LT((bn(my_part(x)) - my_part(ref(x))).abs().max().item<double>(), 1e-12);
}

// A plain BatchNorm cannot be converted from outside, and an engine refuses
// a SyncBatchNorm bound to no group: both named.
TEST(SyncBatchNormDDP, PlainOrUnboundLayersAreNamed) {
  auto expect_named = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error naming '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto plain = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Conv2d(3, 4, 3), torch::nn::BatchNorm2d(4));
  expect_named([&] { parallel::convert_sync_batchnorm(*plain, *world().group()); },
               "'1' is a torch::nn::BatchNorm2dImpl, which a C++ module calls through its own field");
  auto unbound = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(4, 4), parallel::SyncBatchNorm(4));
  expect_named([&] { parallel::DistributedDataParallel ddp(unbound, *world().group()); },
               "DDP: SyncBatchNorm '1' is bound to no group: call convert_sync_batchnorm(module, group) first");
  expect_named([&] { parallel::fsdp::fully_shard(unbound, world(), *world().group(), {}); },
               "fully_shard: SyncBatchNorm '1' is bound to no group");
  expect_named([&] { parallel::SyncBatchNorm(4)(torch::ones({4})); }, "at least 2 dimensions, got 1");
}

}  // namespace sync_batchnorm_test
}  // namespace scaletrain::test

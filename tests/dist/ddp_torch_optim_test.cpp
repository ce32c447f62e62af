// DDP with libtorch's own optimizers on a user module (the ToyModel every DDP
// tutorial starts from): torch::optim::SGD and Adam, their zero_grad(), and
// gradient accumulation under no_sync, against one process on the full batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "user_modules.h"

namespace scaletrain::test {
namespace ddp_torch_optim_test {

using ToyModel = Toy;

constexpr int64_t kBatch = 24;  // divisible by 2..4 ranks x 1..2 micro-batches
constexpr int kSteps = 4;

ToyModel make_model() {
  torch::manual_seed(7);
  ToyModel m;
  m->to(at::kDouble);
  return m;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(ToyModel& m, bool adam) {
  if (adam) return std::make_unique<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto g = at::detail::createCPUGenerator(100 + step);
  return {at::randn({kBatch, 10}, g, at::kDouble), at::randn({kBatch, 5}, g, at::kDouble)};
}

std::vector<at::Tensor> train_one_process(bool adam) {
  ToyModel m = make_model();
  auto opt = make_optimizer(m, adam);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt->zero_grad();
    torch::mse_loss(m(x), y).backward();
    opt->step();
  }
  return m->parameters();
}

// `accum` micro-batches per step, the first ones under no_sync.
std::vector<at::Tensor> train_ddp(bool adam, bool as_view, int accum, bool engine_zero = true) {
  ToyModel m = make_model();
  parallel::DDPOptions o;
  o.gradient_as_bucket_view = as_view;
  parallel::DistributedDataParallel ddp(m.ptr(), *world().group(), o);
  auto opt = make_optimizer(m, adam);
  const int64_t local = kBatch / world().size(), micro = local / accum;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    if (as_view && engine_zero) {
      ddp.zero_grad();
    } else {
      opt->zero_grad();
    }
    for (int k = 0; k < accum; ++k) {
      const int64_t start = world().rank() * local + k * micro;
      auto loss = torch::mse_loss(m(x.narrow(0, start, micro)), y.narrow(0, start, micro)) / accum;
      if (k + 1 < accum) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt->step();
  }
  return m->parameters();
}

TEST(DDPTorchOptim, SgdAndAdamMatchOneProcessWithTheirOwnZeroGrad) {
  for (bool adam : {false, true}) {
    auto ref = train_one_process(adam);
    for (int accum : {1, 2}) {
      auto got = train_ddp(adam, /*as_view=*/false, accum);
      EXPECT_LE(relative_diff(got, ref, true), 1e-10) << (adam ? "Adam" : "SGD") << " accumulation " << accum;
      // Every tensor moved, or the comparison would be empty.
      auto init = make_model()->parameters();
      for (size_t i = 0; i < got.size(); ++i)
        EXPECT_GT((got[i] - init[i]).abs().max().item<double>(), 1e-3) << "tensor " << i << " did not move";
    }
  }
}

// Under gradient_as_bucket_view each .grad is its place in a bucket; both
// the engine's zero_grad() and libtorch's own (which detach_()es every
// .grad, and refused a view with a message about Python's optimizer.py)
// clear it, and training matches one process.
TEST(DDPTorchOptim, BucketViewsZeroThroughEitherZeroGrad) {
  for (bool adam : {false, true}) {
    auto ref = train_one_process(adam);
    EXPECT_LE(relative_diff(train_ddp(adam, /*as_view=*/true, 2), ref, true), 1e-10);
    EXPECT_LE(relative_diff(train_ddp(adam, /*as_view=*/true, 2, /*engine_zero=*/false), ref, true), 1e-10)
        << (adam ? "Adam" : "SGD") << " with its own zero_grad()";
  }
}

}  // namespace ddp_torch_optim_test
}  // namespace scaletrain::test

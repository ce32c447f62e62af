// The ToyModel of every DDP tutorial (Linear(10,10) -> ReLU -> Linear(10,5))
// under scaletrain's DDP, with torch::optim::SGD and gradient accumulation:
// the first micro-batches of a step run under no_sync, the last one reduces.
//
//   scaletrain launch --nproc-per-node 2 -- ./toy_ddp
//
// Every rank also trains the same model alone on the whole batch (float64),
// and the program exits 1 unless both end with the same weights (1e-10).
#include <torch/torch.h>

#include <cstdio>

#include "scaletrain/scaletrain.h"

struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(ToyModel);

namespace {

constexpr int64_t kBatch = 32;     // global batch: every rank's micro-batches together
constexpr int kAccumulation = 2;   // micro-batches per step on each rank
constexpr int kSteps = 5;

ToyModel make_model() {
  torch::manual_seed(0);  // every rank starts the same (DDP broadcasts rank 0's anyway)
  ToyModel model;
  model->to(torch::kDouble);
  return model;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kBatch, 10}, torch::kDouble), torch::randn({kBatch, 5}, torch::kDouble)};
}

// One process, the whole batch: what DDP must reproduce.
std::vector<torch::Tensor> train_alone() {
  ToyModel model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    torch::mse_loss(model(x), y).backward();
    opt.step();
  }
  return model->parameters();
}

}  // namespace

int main() {
  auto world = scaletrain::comm::World::init();  // RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher
  ToyModel model = make_model();
  scaletrain::parallel::DistributedDataParallel ddp(model.ptr(), *world->group());
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  const int64_t local = kBatch / world->size(), micro = local / kAccumulation;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    for (int k = 0; k < kAccumulation; ++k) {
      const int64_t first = world->rank() * local + k * micro;
      auto loss = torch::mse_loss(model(x.narrow(0, first, micro)), y.narrow(0, first, micro)) / kAccumulation;
      if (k + 1 < kAccumulation) {
        auto no_sync = ddp.no_sync();  // accumulate locally, communicate nothing
        loss.backward();
      } else {
        loss.backward();  // all-reduces the accumulated gradients, bucket by bucket
      }
    }
    opt.step();
  }

  const auto got = model->parameters(), want = train_alone();
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>());
  std::printf("rank %d of %d: %d steps, max relative difference from one process %.3g\n", world->rank(),
              world->size(), kSteps, worst);
  return worst <= 1e-10 ? 0 : 1;
}

// The ToyModel of every DDP tutorial (Linear(10,10) -> ReLU -> Linear(10,5))
// under scaletrain's DDP, with torch::optim::SGD and gradient accumulation:
// the first micro-batches of a step run under no_sync, the last one reduces.
//
//   scaletrain launch --nproc-per-node 2 -- ./toy_ddp             (float64)
//   scaletrain launch --nproc-per-node 2 -- ./toy_ddp --float32   (float32)
//
// Every rank also trains the same model alone on the whole batch, and the
// program exits 1 unless both end with the same weights: to 1e-10 in float64,
// to 1e-5 in float32.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
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

constexpr int64_t kBatch = 32;    // global batch: every rank's micro-batches together
constexpr int kAccumulation = 2;  // micro-batches per step on each rank
constexpr int kSteps = 5;

ToyModel make_model(torch::Dtype dtype) {
  torch::manual_seed(0);  // every rank starts the same (DDP broadcasts rank 0's anyway)
  ToyModel model;
  model->to(dtype);
  return model;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int step, torch::Dtype dtype) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kBatch, 10}, dtype), torch::randn({kBatch, 5}, dtype)};
}

// One process, the whole batch: what DDP must reproduce.
std::vector<torch::Tensor> train_alone(torch::Dtype dtype) {
  ToyModel model = make_model(dtype);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    opt.zero_grad();
    torch::mse_loss(model(x), y).backward();
    opt.step();
  }
  return model->parameters();
}

}  // namespace

int main(int argc, char** argv) {
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  auto world = scaletrain::comm::World::init();  // RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher
  ToyModel model = make_model(precision.dtype);
  scaletrain::parallel::DistributedDataParallel ddp(model.ptr(), *world->group());
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  const int64_t local = kBatch / world->size(), micro = local / kAccumulation;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, precision.dtype);
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

  const double worst = max_relative_difference(model->parameters(), train_alone(precision.dtype));
  std::printf("rank %d of %d, %s: %d steps, max relative difference from one process %.3g\n", world->rank(),
              world->size(), precision.name, kSteps, worst);
  return worst <= precision.tolerance ? 0 : 1;
}

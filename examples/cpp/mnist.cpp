// The Net of pytorch/examples cpp/mnist (two convolutions, dropout, two
// linears) with torch::optim::SGD, on synthetic MNIST-shaped data (no
// dataset is downloaded here): under DDP, then under ZeRO-3 (fully_shard,
// one unit per layer: each layer's weights live on one rank in pieces and
// are gathered only while that layer runs).
//
//   scaletrain launch --nproc-per-node 2 -- ./mnist             (float64)
//   scaletrain launch --nproc-per-node 2 -- ./mnist --float32   (float32)
//
// Parity: every rank also trains the Net alone on the whole batch, and the
// program exits 1 unless both end with the same weights: to 1e-10 in
// float64, to 1e-5 in float32. Dropout draws its masks from each process's
// own generator, so the parity run keeps dropout off (eval(), which changes
// nothing else in this Net); a second run with dropout on checks that the
// loss goes down.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
#include "scaletrain/scaletrain.h"

struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

namespace {

constexpr int64_t kBatch = 64;  // global batch
constexpr int kSteps = 6;

Net make_net(torch::Dtype dtype, bool dropout) {
  torch::manual_seed(1);
  Net net;
  net->to(dtype);
  dropout ? net->train() : net->eval();
  return net;
}

// A fixed synthetic set: 28x28 images whose label is a function of the
// pixels (which quadrant is brightest, plus a parity bit), so it can be learnt.
// Drawn in float64 in either precision: float32 trains on the same images,
// rounded, and the random generator is left in the same state for dropout.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step, torch::Dtype dtype) {
  torch::manual_seed(500 + step);
  auto images = torch::rand({kBatch, 1, 28, 28}, torch::kDouble);
  auto quadrants = images.view({kBatch, 1, 2, 14, 2, 14}).sum({1, 3, 5}).view({kBatch, 4});
  auto labels = quadrants.argmax(1) * 2 + (images.view({kBatch, -1}).select(1, 0) > 0.5).to(torch::kLong);
  return {((images - 0.1307) / 0.3081).to(dtype), labels};
}

// Trains `net` on this rank's part of each global batch (all of it on one
// rank); returns the first and the last step's loss on that part. Under DDP
// the gradients are averaged over the ranks in backward.
std::pair<double, double> train(Net& net, torch::Dtype dtype, int rank, int size) {
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.5));
  const int64_t local = kBatch / size;
  double first = 0, last = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    opt.zero_grad();
    auto loss = torch::nll_loss(net->forward(x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local));
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

// The same loop under ZeRO-3: the optimizer holds this rank's shards, and
// after_step() follows each optimizer step. Returns the whole parameters.
std::vector<torch::Tensor> train_zero3(scaletrain::comm::World& world, Net& net, torch::Dtype dtype) {
  scaletrain::parallel::fsdp::ModuleUnits units;
  units.types = {"Conv2dImpl", "LinearImpl"};  // every layer is a unit
  scaletrain::parallel::fsdp::ShardedOptions options;
  options.sharding = scaletrain::parallel::fsdp::Sharding::Zero3;
  auto engine = scaletrain::parallel::fsdp::fully_shard(net.ptr(), world, *world.group(), units, options);
  torch::optim::SGD opt(engine->shards(), torch::optim::SGDOptions(0.05).momentum(0.5));
  const int64_t local = kBatch / world.size();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    engine->zero_grad();
    const int64_t first = world.rank() * local;
    torch::nll_loss(net->forward(x.narrow(0, first, local)), y.narrow(0, first, local)).backward();
    opt.step();
    engine->after_step();
  }
  return engine->full_parameters();
}

}  // namespace

int main(int argc, char** argv) {
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  const torch::Dtype dtype = precision.dtype;
  auto world = scaletrain::comm::World::init();
  const int rank = world->rank(), size = world->size();

  Net alone = make_net(dtype, /*dropout=*/false);
  train(alone, dtype, 0, 1);

  Net net = make_net(dtype, false);
  {
    scaletrain::parallel::DistributedDataParallel ddp(net.ptr(), *world->group());
    train(net, dtype, rank, size);
  }
  const double ddp_diff = max_relative_difference(net->parameters(), alone->parameters());

  Net sharded = make_net(dtype, false);
  const double zero3_diff = max_relative_difference(train_zero3(*world, sharded, dtype), alone->parameters());

  Net dropped = make_net(dtype, /*dropout=*/true);
  scaletrain::parallel::DistributedDataParallel ddp(dropped.ptr(), *world->group());
  const auto [first, last] = train(dropped, dtype, rank, size);

  std::printf(
      "rank %d of %d, %s: max relative difference from one process: DDP %.3g, ZeRO-3 %.3g; "
      "with dropout, loss %.4f -> %.4f\n",
      rank, size, precision.name, ddp_diff, zero3_diff, first, last);
  const double tolerance = precision.tolerance;
  return ddp_diff <= tolerance && zero3_diff <= tolerance && last < first ? 0 : 1;
}

// A small ResNet (residual blocks with BatchNorm) under fully_shard, one unit
// per residual block, first FULL_SHARD over every rank, then HYBRID_SHARD:
// shards within groups of ranks, replicas across them (as on several nodes).
// The model's forward is its own: fully_shard gathers each block when its
// first operator reads it and frees it after.
//
//   scaletrain launch --nproc-per-node 2 -- ./resnet_fsdp     (any even count)
//   scaletrain launch --nproc-per-node 2 -- ./resnet_fsdp --float32
//
// BatchNorm normalizes over each rank's samples, so the single-process
// reference runs the same per-rank slices one after another and averages
// their losses. The program exits 1 unless the weights agree: to 1e-10 in
// float64 (the default), to 1e-5 in float32.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
#include "scaletrain/scaletrain.h"

namespace fsdp = scaletrain::parallel::fsdp;

struct BasicBlockImpl : torch::nn::Module {
  explicit BasicBlockImpl(int64_t channels) {
    auto conv = [&] { return torch::nn::Conv2dOptions(channels, channels, 3).padding(1).bias(false); };
    conv1 = register_module("conv1", torch::nn::Conv2d(conv()));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(channels));
    conv2 = register_module("conv2", torch::nn::Conv2d(conv()));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(channels));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn2(conv2(torch::relu(bn1(conv1(x))))) + x); }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : torch::nn::Module {
  ResNetImpl() {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)));
    blocks = register_module("blocks", torch::nn::Sequential(BasicBlock(16), BasicBlock(16), BasicBlock(16)));
    fc = register_module("fc", torch::nn::Linear(16, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = blocks->forward(torch::relu(stem(x)));
    return torch::log_softmax(fc(h.mean({2, 3})), 1);
  }
  torch::nn::Conv2d stem{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

namespace {

constexpr int64_t kBatch = 16;
constexpr int kSteps = 4;

ResNet make_resnet(torch::Dtype dtype) {
  torch::manual_seed(0);
  ResNet net;
  net->to(dtype);
  return net;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int step, torch::Dtype dtype) {
  torch::manual_seed(700 + step);
  return {torch::randn({kBatch, 3, 12, 12}, dtype), torch::randint(10, {kBatch}, torch::kLong)};
}

std::vector<torch::Tensor> train_alone(int parts, torch::Dtype dtype) {
  ResNet net = make_resnet(dtype);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  const int64_t n = kBatch / parts;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    opt.zero_grad();
    auto loss = torch::zeros({}, dtype);
    for (int r = 0; r < parts; ++r)
      loss = loss + torch::nll_loss(net(x.narrow(0, r * n, n)), y.narrow(0, r * n, n)) / parts;
    loss.backward();
    opt.step();
  }
  return net->parameters();
}

// Trains under fully_shard; `dp_rank` of `dp` picks this rank's slice.
double train_sharded(scaletrain::comm::World& world, fsdp::Sharding sharding, scaletrain::comm::Group& shard,
                     scaletrain::comm::Group* replicate, int dp_rank, int dp, torch::Dtype dtype) {
  ResNet net = make_resnet(dtype);
  fsdp::ModuleUnits units;
  units.types = {"BasicBlockImpl"};  // one unit per residual block; stem and fc form the root
  fsdp::ShardedOptions options;
  options.sharding = sharding;
  auto engine = fsdp::fully_shard(net.ptr(), world, shard, units, options, replicate);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));  // the shards, not net->parameters()

  const int64_t n = kBatch / dp;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    engine->zero_grad();
    auto loss = torch::nll_loss(net(x.narrow(0, dp_rank * n, n)), y.narrow(0, dp_rank * n, n));
    loss.backward();  // each block's gradients are reduce-scattered as they complete
    opt.step();       // this rank's shards only
    engine->after_step();
  }
  const auto got = engine->full_parameters(), init = make_resnet(dtype)->parameters();
  // Every tensor must have moved, or equal weights would prove nothing.
  for (size_t i = 0; i < got.size(); ++i)
    if ((got[i] - init[i]).abs().max().item<double>() <= 1e-4) return 1.0;
  return max_relative_difference(got, train_alone(dp, dtype));
}

}  // namespace

int main(int argc, char** argv) {
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  auto world = scaletrain::comm::World::init();
  const int size = world->size();
  if (size % 2 != 0) {
    std::fprintf(stderr, "resnet_fsdp: needs an even number of processes (HYBRID_SHARD over 2 replicas)\n");
    return 2;
  }
  const double full =
      train_sharded(*world, fsdp::Sharding::FullShard, *world->group(), nullptr, world->rank(), size, precision.dtype);
  // Two replicas of size/2 shards each: a mesh of dp_replicate 2 x dp_shard size/2.
  scaletrain::comm::Mesh mesh(*world, scaletrain::comm::MeshDims{1, 2, size / 2, 1});
  const double hybrid = train_sharded(*world, fsdp::Sharding::HybridShard, mesh.dp_shard(), &mesh.dp_replicate(),
                                      mesh.coord().dp(mesh.dims()), size, precision.dtype);
  std::printf("rank %d of %d, %s: max relative difference from one process: FULL_SHARD %.3g, HYBRID_SHARD %.3g\n",
              world->rank(), size, precision.name, full, hybrid);
  return full <= precision.tolerance && hybrid <= precision.tolerance ? 0 : 1;
}

// A small ResNet (residual blocks with BatchNorm) under fully_shard, one unit
// per residual block, first FULL_SHARD over every rank, then HYBRID_SHARD:
// shards within groups of ranks, replicas across them (as on several nodes).
// The model's forward is its own: fully_shard gathers each block when its
// first operator reads it and frees it after.
//
//   scaletrain launch --nproc-per-node 2 -- ./resnet_fsdp     (any even count)
//
// BatchNorm normalizes over each rank's samples, so the single-process
// reference runs the same per-rank slices one after another and averages
// their losses. The program exits 1 unless the weights agree (1e-10).
#include <torch/torch.h>

#include <cstdio>

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
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(bn2(conv2(torch::relu(bn1(conv1(x))))) + x);
  }
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

ResNet make_resnet() {
  torch::manual_seed(0);
  ResNet net;
  net->to(torch::kDouble);
  return net;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  torch::manual_seed(700 + step);
  return {torch::randn({kBatch, 3, 12, 12}, torch::kDouble), torch::randint(10, {kBatch}, torch::kLong)};
}

std::vector<torch::Tensor> train_alone(int parts) {
  ResNet net = make_resnet();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  const int64_t n = kBatch / parts;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    opt.zero_grad();
    auto loss = torch::zeros({}, torch::kDouble);
    for (int r = 0; r < parts; ++r)
      loss = loss + torch::nll_loss(net(x.narrow(0, r * n, n)), y.narrow(0, r * n, n)) / parts;
    loss.backward();
    opt.step();
  }
  return net->parameters();
}

// Trains under fully_shard; `dp_rank` of `dp` picks this rank's slice.
double train_sharded(scaletrain::comm::World& world, fsdp::Sharding sharding, scaletrain::comm::Group& shard,
                     scaletrain::comm::Group* replicate, int dp_rank, int dp) {
  ResNet net = make_resnet();
  fsdp::ModuleUnits units;
  units.types = {"BasicBlockImpl"};  // one unit per residual block; stem and fc form the root
  fsdp::ShardedOptions options;
  options.sharding = sharding;
  auto engine = fsdp::fully_shard(net.ptr(), world, shard, units, options, replicate);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));  // the shards, not net->parameters()

  const int64_t n = kBatch / dp;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step);
    engine->zero_grad();
    auto loss = torch::nll_loss(net(x.narrow(0, dp_rank * n, n)), y.narrow(0, dp_rank * n, n));
    loss.backward();      // each block's gradients are reduce-scattered as they complete
    opt.step();           // this rank's shards only
    engine->after_step();
  }
  const auto got = engine->full_parameters(), want = train_alone(dp), init = make_resnet()->parameters();
  double worst = 0, least_moved = 1e9;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>());
    least_moved = std::min(least_moved, (got[i] - init[i]).abs().max().item<double>());
  }
  // Every tensor must have moved, or equal weights would prove nothing.
  return least_moved > 1e-4 ? worst : 1.0;
}

}  // namespace

int main() {
  auto world = scaletrain::comm::World::init();
  const int size = world->size();
  if (size % 2 != 0) {
    std::fprintf(stderr, "resnet_fsdp: needs an even number of processes (HYBRID_SHARD over 2 replicas)\n");
    return 2;
  }
  const double full = train_sharded(*world, fsdp::Sharding::FullShard, *world->group(), nullptr, world->rank(), size);
  // Two replicas of size/2 shards each: a mesh of dp_replicate 2 x dp_shard size/2.
  scaletrain::comm::Mesh mesh(*world, scaletrain::comm::MeshDims{1, 2, size / 2, 1});
  const double hybrid = train_sharded(*world, fsdp::Sharding::HybridShard, mesh.dp_shard(), &mesh.dp_replicate(),
                                      mesh.coord().dp(mesh.dims()), size);
  std::printf("rank %d of %d: max relative difference from one process: FULL_SHARD %.3g, HYBRID_SHARD %.3g\n",
              world->rank(), size, full, hybrid);
  return full <= 1e-10 && hybrid <= 1e-10 ? 0 : 1;
}

// A ResNet built as a torch::nn::Sequential, split in two (seq1 on rank 0,
// seq2 on rank 1): layer-wise model parallelism (one micro-batch at a time),
// then the same split as a 2-stage pipeline with 1F1B over 4 micro-batches.
// Between the stages travel 4-d feature maps; the stages are yours.
//
//   scaletrain launch --nproc-per-node 2 -- ./resnet_pipeline             (float64)
//   scaletrain launch --nproc-per-node 2 -- ./resnet_pipeline --float32   (float32)
//
// BatchNorm normalizes over each micro-batch, so the single-process reference
// runs the same micro-batches one after another and accumulates their
// gradients (loss / m each). The program exits 1 unless every stage's
// weights moved and equal the reference's: to 1e-10 in float64, to 1e-5 in
// float32.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
#include "scaletrain/parallel/pipeline/module_pipeline.h"
#include "scaletrain/scaletrain.h"

namespace pl = scaletrain::parallel::pipeline;

struct ResidualImpl : torch::nn::Module {
  explicit ResidualImpl(int64_t c) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(c));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x)) + x); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(Residual);

namespace {

constexpr int64_t kBatch = 16;
constexpr int kSteps = 3;

torch::nn::Sequential make_resnet(torch::Dtype dtype) {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).padding(1)), torch::nn::ReLU(),
                            Residual(16), Residual(16),  // seq1: these four
                            Residual(16), Residual(16), torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(),
                            torch::nn::Linear(16, 10));
  net->to(dtype);
  return net;
}

std::pair<torch::Tensor, torch::Tensor> global_batch(int step, torch::Dtype dtype) {
  torch::manual_seed(300 + step);
  return {torch::randn({kBatch, 3, 8, 8}, dtype), torch::randint(10, {kBatch}, torch::kLong)};
}

torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nll_loss(torch::log_softmax(out, 1), y);
}

// Returns the largest relative difference of this rank's stage from the
// reference, or 1 when a weight did not move.
double train(scaletrain::comm::World& world, pl::Schedule schedule, int microbatches, torch::Dtype dtype) {
  auto net = make_resnet(dtype);
  auto halves = pl::split(net, {4, 5});  // seq1, seq2
  pl::ModulePipelineOptions options;
  options.schedule = schedule;
  options.microbatches = microbatches;
  pl::ModulePipeline pipe({pl::stage(halves[static_cast<size_t>(world.rank())])}, *world.group(), options);
  torch::optim::SGD opt(pipe.parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    pipe.zero_grad();
    pipe.step(x, y, loss_fn);  // micro-batches flow rank 0 -> rank 1, gradients back
    opt.step();
  }

  auto ref = make_resnet(dtype), init = make_resnet(dtype);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = global_batch(step, dtype);
    ref_opt.zero_grad();
    auto xs = x.chunk(microbatches), ys = y.chunk(microbatches);
    for (int k = 0; k < microbatches; ++k) (loss_fn(ref->forward(xs[k]), ys[k]) / microbatches).backward();
    ref_opt.step();
  }
  const std::string mine = world.rank() == 0 ? "0123" : "45678";  // this rank's children
  auto want = ref->named_parameters(), start = init->named_parameters();
  std::vector<torch::Tensor> got_mine, want_mine;
  for (auto& item : net->named_parameters()) {
    if (mine.find(item.key()[0]) == std::string::npos) continue;
    const auto& w = want[item.key()];
    if ((w - start[item.key()]).abs().max().item<double>() < 1e-4) return 1.0;
    got_mine.push_back(item.value());
    want_mine.push_back(w);
  }
  return max_relative_difference(got_mine, want_mine);
}

}  // namespace

int main(int argc, char** argv) {
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  auto world = scaletrain::comm::World::init();
  if (world->size() != 2) {
    std::fprintf(stderr, "resnet_pipeline: runs on 2 processes (seq1 and seq2)\n");
    return 2;
  }
  const double layerwise = train(*world, pl::Schedule::OneFOneB, 1, precision.dtype);
  const double one_f_one_b = train(*world, pl::Schedule::OneFOneB, 4, precision.dtype);
  std::printf("rank %d (%s), %s: max relative difference from one process: layer-wise %.3g, 1F1B x4 %.3g\n",
              world->rank(), world->rank() == 0 ? "seq1" : "seq2", precision.name, layerwise, one_f_one_b);
  return layerwise <= precision.tolerance && one_f_one_b <= precision.tolerance ? 0 : 1;
}

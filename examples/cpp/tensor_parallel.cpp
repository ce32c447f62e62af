// Tensor parallelism on modules written the usual libtorch way, by a plan
// over their names:
//   - a TensorParallelLinear: one Linear whose output features are split
//     over the ranks (colwise), the full output gathered in forward;
//   - an MLP, Linear(10,32) -> ReLU -> Linear(32,5): the first Linear
//     colwise, the second rowwise, so the 32 hidden features never travel
//     (one all-reduce in forward, one in backward).
//
//   scaletrain launch --nproc-per-node 2 -- ./tensor_parallel             (float64)
//   scaletrain launch --nproc-per-node 2 -- ./tensor_parallel --float32   (float32)
//
// Every rank also trains both models alone and the program exits 1 unless
// the gathered weights equal the single-process ones: to 1e-10 in float64,
// to 1e-5 in float32.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
#include "scaletrain/scaletrain.h"

namespace tp = scaletrain::parallel::tensor;

struct TensorParallelLinearImpl : torch::nn::Module {
  TensorParallelLinearImpl() { fc = register_module("fc", torch::nn::Linear(16, 8)); }
  // Under the plan, fc(x) is this rank's 8/tp output features.
  torch::Tensor forward(const torch::Tensor& x, scaletrain::comm::Group* group) {
    auto y = fc(x);
    return group ? tp::gather_from_tp_region(y, *group, -1) : y;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TensorParallelLinear);

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 32));
    net2 = register_module("net2", torch::nn::Linear(32, 5));
  }
  torch::Tensor forward(const torch::Tensor& x, scaletrain::comm::Group*) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(Mlp);

namespace {

constexpr int kSteps = 5;

template <typename M>
M make_model(torch::Dtype dtype) {
  torch::manual_seed(0);  // every rank starts the same (rank 0's weights are broadcast anyway)
  M model;
  model->to(dtype);
  return model;
}

// Trains with Adam on the same batches everywhere; returns the full weights.
template <typename M>
std::vector<torch::Tensor> train(int64_t in, int64_t out, scaletrain::comm::Group* group, const tp::ModulePlan& plan,
                                 torch::Dtype dtype) {
  M model = make_model<M>(dtype);
  std::unique_ptr<tp::TensorParallelModule> parallel;
  if (group) parallel = tp::parallelize_module(model.ptr(), *group, plan);       // splits the weights in place
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));  // built after the split
  for (int step = 0; step < kSteps; ++step) {
    torch::manual_seed(100 + step);
    auto x = torch::randn({16, in}, dtype), y = torch::randn({16, out}, dtype);
    opt.zero_grad();
    torch::mse_loss(model->forward(x, group), y).backward();
    opt.step();
  }
  if (!parallel) return model->parameters();
  parallel->check();
  return tp::gather_full_parameters(*model, parallel->plan());
}

}  // namespace

int main(int argc, char** argv) {
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  const torch::Dtype dtype = precision.dtype;
  auto world = scaletrain::comm::World::init();  // RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher
  scaletrain::comm::Group* group = world->group().get();
  const double linear = max_relative_difference(train<TensorParallelLinear>(16, 8, group, {{"fc", tp::colwise}}, dtype),
                                                train<TensorParallelLinear>(16, 8, nullptr, {}, dtype));
  const double mlp =
      max_relative_difference(train<Mlp>(10, 5, group, {{"net1", tp::colwise}, {"net2", tp::rowwise}}, dtype),
                              train<Mlp>(10, 5, nullptr, {}, dtype));
  std::printf(
      "rank %d of %d, %s: %d steps, max relative difference from one process: TensorParallelLinear %.3g, "
      "MLP %.3g\n",
      world->rank(), world->size(), precision.name, kSteps, linear, mlp);
  return linear <= precision.tolerance && mlp <= precision.tolerance ? 0 : 1;
}

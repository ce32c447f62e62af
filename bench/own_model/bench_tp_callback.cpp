// What parallelize_module's operator callback (Note [Tensor parallelism
// without forward hooks]) costs work that runs while it is registered: the
// same MLP's forward + backward (4 residual blocks of Linear(256,1024) ->
// GELU -> Linear(1024,256), one process, one thread), measured
//   off     with no TensorParallelModule alive;
//   other   while one is alive for another module (every operator of the
//           program passes the callback, none is planned);
//   planned on a module whose Linears are planned colwise -> rowwise over a
//           group of one rank (the callback finds and handles every product;
//           the all-reduces of one rank return at once).
// The three run in rotating order, --reps times; prints one JSON line of
// medians. Run under `scaletrain launch --nproc-per-node 1`.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "scaletrain/scaletrain.h"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(256, 1024));
    b = register_module("b", torch::nn::Linear(1024, 256));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i = 0; i < 4; ++i) x = x + b(torch::gelu(a(x)));
    return x;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Mlp);

double step_ms(Mlp& m, const torch::Tensor& x) {
  const auto t0 = std::chrono::steady_clock::now();
  m->zero_grad();
  m(x).sum().backward();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  namespace tp = scaletrain::parallel::tensor;
  int64_t rows = 64;
  int reps = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--rows") rows = std::atoll(argv[i + 1]);
    if (k == "--reps") reps = std::atoi(argv[i + 1]);
  }
  torch::set_num_threads(1);
  auto world = scaletrain::comm::World::init();
  torch::manual_seed(0);
  Mlp model, planned_model, keeper;  // off and other time the same module
  const auto x = torch::randn({rows, 256});
  std::vector<double> off, other, planned;
  for (int w = 0; w < 5; ++w) step_ms(model, x), step_ms(planned_model, x);  // warm up
  for (int rep = 0; rep < reps; ++rep) {
    for (int k = 0; k < 3; ++k) {
      switch ((rep + k) % 3) {
        case 0:
          off.push_back(step_ms(model, x));
          break;
        case 1: {
          auto live = tp::parallelize_module(keeper.ptr(), *world->group(), {{"a", tp::colwise}});
          other.push_back(step_ms(model, x));
          break;
        }
        default: {
          auto live = tp::parallelize_module(planned_model.ptr(), *world->group(), {{"a", tp::colwise}, {"b", tp::rowwise}});
          planned.push_back(step_ms(planned_model, x));
        }
      }
    }
  }
  std::printf("{\"bench\": \"tp_callback\", \"rows\": %lld, \"reps\": %d, \"off_ms\": %.4f, \"other_ms\": %.4f, "
              "\"planned_ms\": %.4f, \"other_ratio\": %.4f, \"planned_ratio\": %.4f}\n",
              static_cast<long long>(rows), reps, median(off), median(other), median(planned),
              median(other) / median(off), median(planned) / median(off));
}

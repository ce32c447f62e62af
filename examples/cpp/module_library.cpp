// A module library: a classifier of yours that `scaletrain train` trains
// with the CLI's keys, without a main() of yours (scaletrain/train/module_task.h).
//
//   cmake --build ex --target module_library          # ex/libmodule_library.so
//   scaletrain launch --nproc-per-node 2 -- scaletrain train examples/cpp/module_library.yaml \
//       --model.library=ex/libmodule_library.so
//
// model.library_args picks the dtype: "float64" trains in double precision
// (the package test compares 1 and 2 processes to 1e-10 that way), anything
// else in float32.
#include <torch/torch.h>

#include <memory>
#include <string>

#include "scaletrain/train/module_task.h"

namespace {

// Two hidden layers with LayerNorm: a block the FSDP keys can make a unit of
// (parallel.fsdp.auto_wrap_policy: transformer, transformer_layer_cls: BlockImpl).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) {
    fc = register_module("fc", torch::nn::Linear(width, width));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::gelu(fc(norm(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Block);

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl() {
    embed = register_module("embed", torch::nn::Linear(16, 32));
    blocks = register_module("blocks", torch::nn::Sequential(Block(32), Block(32)));
    head = register_module("head", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(embed(x))); }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(Classifier);

scaletrain::train::ModuleTask make_task(const std::string& args) {
  const torch::Dtype dtype = args == "float64" ? torch::kDouble : torch::kFloat;
  torch::manual_seed(0);  // every rank builds the same weights and samples
  Classifier model;
  model->to(dtype);
  // 512 samples in 4 classes: the class is the quadrant of two projections.
  const torch::Tensor x = torch::randn({512, 16}, dtype);
  const torch::Tensor w = torch::randn({16, 2}, dtype);
  const torch::Tensor p = x.matmul(w);
  const torch::Tensor y = (p.select(1, 0) > 0).to(torch::kLong) * 2 + (p.select(1, 1) > 0).to(torch::kLong);

  scaletrain::train::ModuleTask task;
  task.module = model.ptr();
  task.loss = [](torch::nn::Module& m, const torch::Tensor& input, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(dynamic_cast<ClassifierImpl&>(m).forward(input), target);
  };
  task.data = std::make_shared<scaletrain::train::ModuleData>(x, y);
  task.units.types = {"BlockImpl"};  // under a sharded strategy, unless the config names units
  return task;
}

}  // namespace

SCALETRAIN_MODULE_TASK(make_task)

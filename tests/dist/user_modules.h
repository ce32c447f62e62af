#pragma once
// Modules that are not ours, as a libtorch user writes them: the ToyModel
// of every DDP tutorial, the MNIST Net of pytorch/examples (dropout left out:
// its masks are drawn per process), a small ResNet with BatchNorm, and an
// LSTM language model; and a classifier whose forward may skip a submodule.
#include <torch/torch.h>

namespace scaletrain::test {

struct ToyImpl : torch::nn::Module {
  ToyImpl() {
    net1 = register_module("net1", torch::nn::Linear(10, 10));
    net2 = register_module("net2", torch::nn::Linear(10, 5));
  }
  at::Tensor forward(const at::Tensor& x) { return net2(torch::relu(net1(x))); }
  torch::nn::Linear net1{nullptr}, net2{nullptr};
};
TORCH_MODULE(Toy);

// pytorch/examples cpp/mnist, dropout left out (masks are per process).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)));
    fc1 = register_module("fc1", torch::nn::Linear(320, 50));
    fc2 = register_module("fc2", torch::nn::Linear(50, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1(x), 2));
    x = torch::relu(torch::max_pool2d(conv2(x), 2));
    x = torch::relu(fc1(x.view({-1, 320})));
    return torch::log_softmax(fc2(x), 1);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

struct BasicBlockImpl : torch::nn::Module {
  explicit BasicBlockImpl(int64_t c) {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(c));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(c));
  }
  at::Tensor forward(const at::Tensor& x) { return torch::relu(bn2(conv2(torch::relu(bn1(conv1(x))))) + x); }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(BasicBlock);

struct ResNetImpl : torch::nn::Module {
  ResNetImpl() {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    layer1 = register_module("layer1", torch::nn::Sequential(BasicBlock(8), BasicBlock(8)));
    fc = register_module("fc", torch::nn::Linear(8, 10));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = layer1->forward(torch::relu(stem(x)));
    return torch::log_softmax(fc(h.mean({2, 3})), 1);
  }
  torch::nn::Conv2d stem{nullptr};
  torch::nn::Sequential layer1{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNet);

// A recurrent language model read at its last position: the LSTM's weights
// are used at every time step. Inputs are token ids [B, T] (as float64, the
// cases' common input type; cast back here).
struct LstmLmImpl : torch::nn::Module {
  LstmLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(12, 6));
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(6, 8).num_layers(2).batch_first(true)));
    head = register_module("head", torch::nn::Linear(8, 12));
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto h = std::get<0>(lstm(embed(ids.to(at::kLong))));
    return torch::log_softmax(head(h.select(1, -1)), 1);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LstmLm);

// A classifier with an auxiliary head that forward runs only while `use_aux`
// (a branch some steps take), for Note [Units that took no part].
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    body = register_module("body", torch::nn::Linear(10, 8));
    head = register_module("head", torch::nn::Linear(8, 5));
    aux = register_module("aux", torch::nn::Linear(8, 5));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(body(x));
    return torch::log_softmax(use_aux ? head(h) + aux(h) : head(h), 1);
  }
  torch::nn::Linear body{nullptr}, head{nullptr}, aux{nullptr};
  bool use_aux = true;
};
TORCH_MODULE(TwoHeads);

}  // namespace scaletrain::test

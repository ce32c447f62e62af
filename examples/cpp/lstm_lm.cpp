// A recurrent language model, Embedding -> 2-layer LSTM -> Linear, trained
// to predict the next token at every position: its LSTM weights are read at
// every time step of every sequence. Under DDP, then under ZeRO-2
// (fully_shard: each rank keeps the optimizer state and the reduced
// gradients of its part of the weights only).
//
//   scaletrain launch --nproc-per-node 2 -- ./lstm_lm             (float64)
//   scaletrain launch --nproc-per-node 2 -- ./lstm_lm --float32   (float32)
//
// Every rank also trains the model alone on the whole batch, and the program
// exits 1 unless both runs end with its weights: to 1e-10 in float64, to
// 1e-5 in float32.
#include <torch/torch.h>

#include <cstdio>

#include "parity.h"
#include "scaletrain/scaletrain.h"

constexpr int64_t kVocab = 40, kEmbed = 16, kHidden = 24, kSeq = 12;

struct LstmLmImpl : torch::nn::Module {
  LstmLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kEmbed));
    lstm = register_module("lstm",
                           torch::nn::LSTM(torch::nn::LSTMOptions(kEmbed, kHidden).num_layers(2).batch_first(true)));
    head = register_module("head", torch::nn::Linear(kHidden, kVocab));
  }
  // ids [B, T] -> log-probabilities of the next token [B, T, V]
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = std::get<0>(lstm(embed(ids)));
    return torch::log_softmax(head(h), -1);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LstmLm);

namespace {

constexpr int64_t kBatch = 16;  // global batch of sequences
constexpr int kSteps = 5;

LstmLm make_model(torch::Dtype dtype) {
  torch::manual_seed(2);
  LstmLm model;
  model->to(dtype);
  return model;
}

// Token streams with structure to learn: each sequence counts up from a
// random start with a random stride, modulo the vocabulary.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  torch::manual_seed(300 + step);
  auto start = torch::randint(kVocab, {kBatch, 1}, torch::kLong);
  auto stride = torch::randint(1, 4, {kBatch, 1}, torch::kLong);
  auto tokens = (start + stride * torch::arange(kSeq + 1, torch::kLong)) % kVocab;
  return {tokens.narrow(1, 0, kSeq), tokens.narrow(1, 1, kSeq)};
}

torch::Tensor loss_of(LstmLm& model, const torch::Tensor& ids, const torch::Tensor& next) {
  return torch::nll_loss(model->forward(ids).reshape({-1, kVocab}), next.reshape({-1}));
}

// `engine` null: plain (DDP already wraps the model, or one process).
// Returns the loss of the first and of the last step on this rank's part.
std::pair<double, double> train(LstmLm& model, torch::optim::Optimizer& opt, int rank, int size,
                                scaletrain::parallel::fsdp::ShardedDataParallel* engine) {
  const int64_t local = kBatch / size;
  double first = 0, last = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto [ids, next] = global_batch(step);
    engine ? engine->zero_grad() : opt.zero_grad();
    auto loss = loss_of(model, ids.narrow(0, rank * local, local), next.narrow(0, rank * local, local));
    loss.backward();
    opt.step();
    if (engine) engine->after_step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  return {first, last};
}

}  // namespace

int main(int argc, char** argv) {
  namespace fsdp = scaletrain::parallel::fsdp;
  // float64 (no argument) or float32 (--float32), and the tolerance that goes with it
  const Precision precision = precision_from_args(argc, argv);
  auto world = scaletrain::comm::World::init();  // RANK, WORLD_SIZE, MASTER_ADDR, ... from the launcher
  const int rank = world->rank(), size = world->size();

  LstmLm alone = make_model(precision.dtype);
  torch::optim::Adam alone_opt(alone->parameters(), torch::optim::AdamOptions(1e-2));
  const auto [first, last] = train(alone, alone_opt, 0, 1, nullptr);

  LstmLm replicated = make_model(precision.dtype);
  {
    scaletrain::parallel::DistributedDataParallel ddp(replicated.ptr(), *world->group());
    torch::optim::Adam opt(replicated->parameters(), torch::optim::AdamOptions(1e-2));
    train(replicated, opt, rank, size, nullptr);
  }
  const double ddp_diff = max_relative_difference(replicated->parameters(), alone->parameters());

  LstmLm sharded = make_model(precision.dtype);
  fsdp::ModuleUnits units;
  units.names = {"embed", "lstm", "head"};
  fsdp::ShardedOptions options;
  options.sharding = fsdp::Sharding::Zero2;
  auto engine = fsdp::fully_shard(sharded.ptr(), *world, *world->group(), units, options);
  torch::optim::Adam opt(engine->shards(), torch::optim::AdamOptions(1e-2));
  train(sharded, opt, rank, size, engine.get());
  const double zero2_diff = max_relative_difference(engine->full_parameters(), alone->parameters());

  std::printf(
      "rank %d of %d, %s: %d steps (loss %.3f -> %.3f alone), max relative difference from one process: "
      "DDP %.3g, ZeRO-2 %.3g\n",
      rank, size, precision.name, kSteps, first, last, ddp_diff, zero2_diff);
  const double tolerance = precision.tolerance;
  return ddp_diff <= tolerance && zero2_diff <= tolerance && last < first ? 0 : 1;
}

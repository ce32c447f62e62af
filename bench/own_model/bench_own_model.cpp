// What the generic path costs, in one of two measurements per run:
//
//   --mode net-ddp     the MNIST Net of pytorch/examples (fp32) under our DDP
//                      with torch::optim::SGD: step time, for the side-by-side
//                      with PyTorch's DDP (bench/own_model/torch_net_ddp.py);
//   --mode gpt-fsdp    a GPT under FULL_SHARD with AdamW over the shards,
//                      through --path zoo (the family's block runner) or
//                      --path generic (fully_shard over the same module, one
//                      unit per block, gathered on use: Note [Gather on use]):
//                      step time, peak RSS, and the engine's gather count.
//
// A step's time is the slowest rank's; the figure is the median of the timed
// steps. Rank 0 prints one JSON line (scripts/bench-own-model.sh reads it).
// Run: scaletrain launch --nproc-per-node 2 --threads 1 -- bench_own_model --mode net-ddp
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"
#include "scaletrain/parallel/fsdp/fsdp.h"

namespace {

using namespace scaletrain;
using Clock = std::chrono::steady_clock;

struct NetImpl : torch::nn::Module {  // pytorch/examples cpp/mnist
  NetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)));
    conv2_drop = register_module("conv2_drop", torch::nn::Dropout2d());
    fc1 = register_module("fc1", torch::nn::Linear(320, 50));
    fc2 = register_module("fc2", torch::nn::Linear(50, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = torch::relu(fc1->forward(x.view({-1, 320})));
    x = torch::dropout(x, 0.5, is_training());
    return torch::log_softmax(fc2->forward(x), 1);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout2d conv2_drop{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

struct Args {
  std::string mode = "net-ddp", path = "zoo", preset = "tiny";
  int64_t global_batch = 64, n_layer = 0, n_embd = 0, n_head = 0;
  int steps = 20, warmup = 3;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_own_model: %s needs a value\n", k.c_str());
      std::exit(2);
    }
    const std::string v = argv[++i];
    if (k == "--mode") a.mode = v;
    else if (k == "--path") a.path = v;
    else if (k == "--preset") a.preset = v;
    else if (k == "--global-batch") a.global_batch = std::stoll(v);
    else if (k == "--n-layer") a.n_layer = std::stoll(v);
    else if (k == "--n-embd") a.n_embd = std::stoll(v);
    else if (k == "--n-head") a.n_head = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else {
      std::fprintf(stderr, "usage: bench_own_model --mode net-ddp|gpt-fsdp [--path zoo|generic] [--preset P] "
                           "[--n-layer L] [--n-embd E] [--n-head H] [--global-batch B] [--steps S] [--warmup W]\n");
      std::exit(2);
    }
  }
  if ((a.mode != "net-ddp" && a.mode != "gpt-fsdp") || (a.path != "zoo" && a.path != "generic")) {
    std::fprintf(stderr, "bench_own_model: --mode net-ddp|gpt-fsdp, --path zoo|generic\n");
    std::exit(2);
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Times `step` (warmup untimed), each as the slowest rank's.
std::vector<double> time_steps(comm::Group& g, int warmup, int steps, const std::function<void(int)>& step) {
  std::vector<double> out;
  for (int s = 0; s < warmup + steps; ++s) {
    g.barrier().wait();
    const auto t0 = Clock::now();
    step(s);
    at::Tensor ms = at::tensor({std::chrono::duration<double, std::milli>(Clock::now() - t0).count()});
    g.all_reduce(ms, comm::ReduceOp::Max).wait();
    if (s >= warmup) out.push_back(ms.item<double>());
  }
  return out;
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

void net_ddp(const Args& a, comm::World& world) {
  comm::Group& g = *world.group();
  torch::manual_seed(1);
  Net net;
  parallel::DistributedDataParallel ddp(net.ptr(), g);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  const int64_t local = a.global_batch / world.size();
  auto x = torch::randn({local, 1, 28, 28}), y = torch::randint(10, {local}, torch::kLong);
  auto times = time_steps(g, a.warmup, a.steps, [&](int) {
    opt.zero_grad();
    torch::nll_loss(net->forward(x), y).backward();
    opt.step();
  });
  if (world.rank() == 0)
    std::printf("{\"impl\": \"scaletrain\", \"mode\": \"net-ddp\", \"ranks\": %d, \"global_batch\": %lld, "
                "\"median_ms\": %.3f, \"steps\": %zu}\n",
                world.size(), static_cast<long long>(a.global_batch), median(times), times.size());
}

void gpt_fsdp(const Args& a, comm::World& world) {
  comm::Group& g = *world.group();
  models::GPTConfig cfg = models::gpt_preset(a.preset);
  if (a.n_layer) cfg.n_layer = a.n_layer;
  if (a.n_embd) cfg.n_embd = a.n_embd;
  if (a.n_head) cfg.n_head = a.n_head;
  torch::manual_seed(2);
  auto model = models::GPT(cfg);
  parallel::fsdp::ShardedOptions o;
  o.sharding = parallel::fsdp::Sharding::FullShard;
  std::unique_ptr<parallel::fsdp::ShardedDataParallel> engine;
  if (a.path == "zoo") {
    engine = std::make_unique<parallel::fsdp::ShardedDataParallel>(model.ptr(), *model, world, g, nullptr, o);
  } else {
    parallel::fsdp::ModuleUnits units;
    for (int64_t i = 0; i < cfg.n_layer; ++i) units.names.push_back(model->block_prefix(i).substr(0, model->block_prefix(i).size() - 1));
    engine = parallel::fsdp::fully_shard(model.ptr(), world, g, units, o);
  }
  optim::AdamW opt(engine->shards(), engine->shard_decay_numel(), {});
  const int64_t local = a.global_batch / world.size();
  auto x = torch::randint(cfg.vocab_size, {local, cfg.block_size}, torch::kLong);
  auto y = torch::randint(cfg.vocab_size, {local, cfg.block_size}, torch::kLong);
  engine->reset_stats();
  auto times = time_steps(g, a.warmup, a.steps, [&](int) {
    engine->zero_grad();
    at::Tensor loss = a.path == "zoo" ? engine->forward([&] { return model->loss(x, y); }) : model->loss(x, y);
    loss.backward();
    opt.step(1e-4);
    engine->after_step();
  });
  const auto stats = engine->stats();
  if (world.rank() == 0)
    std::printf("{\"impl\": \"scaletrain\", \"mode\": \"gpt-fsdp\", \"path\": \"%s\", \"ranks\": %d, "
                "\"n_layer\": %lld, \"n_embd\": %lld, \"median_ms\": %.3f, \"peak_rss_mb\": %.1f, "
                "\"gathers_per_step\": %.1f, \"peak_gathered_numel\": %lld, \"steps\": %zu}\n",
                a.path.c_str(), world.size(), static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
                median(times), peak_rss_mb(), static_cast<double>(stats.all_gathers) / (a.warmup + a.steps),
                static_cast<long long>(stats.peak_gathered_numel), times.size());
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  auto world = comm::World::init();
  if (a.mode == "net-ddp") net_ddp(a, *world);
  else gpt_fsdp(a, *world);
  return 0;
}

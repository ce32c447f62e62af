#include "scaletrain/parallel/pipeline/stage.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "scaletrain/util/error.h"

namespace scaletrain::parallel::pipeline {

ChunkImpl::ChunkImpl(models::GPT gpt, ChunkSpec spec) : gpt_(std::move(gpt)), spec_(spec) {
  if (spec_.begin >= spec_.end || spec_.end > gpt_->num_blocks())
    throw std::invalid_argument("pipeline chunk " + std::to_string(spec_.index) + " has no blocks");
  if (spec_.first()) {
    register_module("wte", gpt_->wte);
    register_module("wpe", gpt_->wpe);
  }
  // Blocks under "h", named by their index in the whole model.
  auto h = register_module("h", std::make_shared<torch::nn::Module>());
  for (int64_t i = spec_.begin; i < spec_.end; ++i) h->register_module(std::to_string(i), gpt_->h[i]);
  if (spec_.last()) register_module("ln_f", gpt_->ln_f);
}

at::Tensor ChunkImpl::forward(const at::Tensor& input, const at::Tensor& targets) {
  at::Tensor x = spec_.first() ? gpt_->embed(input) : input;
  for (int64_t i = spec_.begin; i < spec_.end; ++i) {
    const models::BlockBody body = gpt_->block_body(i);  // checkpointed if the model says so
    x = runner_ ? runner_(i - spec_.begin, body, x) : body(x);
  }
  return spec_.last() ? gpt_->head_loss(x, targets) : x;
}

std::vector<std::pair<int64_t, int64_t>> balance_blocks(const std::vector<double>& costs, double first_extra,
                                                        double last_extra, int parts) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (parts < 1 || n < parts)
    throw UsageError("the model has " + std::to_string(n) + " blocks, fewer than the " + std::to_string(parts) +
                     " pipeline chunks (pp x virtual_stages) it must be cut into");
  std::vector<double> prefix(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) prefix[static_cast<size_t>(i + 1)] = prefix[static_cast<size_t>(i)] + costs[static_cast<size_t>(i)];
  auto cost = [&](int64_t b, int64_t e, int part) {
    double c = prefix[static_cast<size_t>(e)] - prefix[static_cast<size_t>(b)];
    if (part == 0) c += first_extra;
    if (part == parts - 1) c += last_extra;
    return c;
  };
  // best[k][e]: the smallest largest-run cost of cutting blocks [0, e) into k runs.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(parts + 1), std::vector<double>(static_cast<size_t>(n + 1), inf));
  std::vector<std::vector<int64_t>> cut(best.size(), std::vector<int64_t>(static_cast<size_t>(n + 1), 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k)
    for (int64_t e = k; e <= n; ++e)
      for (int64_t b = k - 1; b < e; ++b) {
        const double c = std::max(best[static_cast<size_t>(k - 1)][static_cast<size_t>(b)], cost(b, e, k - 1));
        if (c < best[static_cast<size_t>(k)][static_cast<size_t>(e)]) {
          best[static_cast<size_t>(k)][static_cast<size_t>(e)] = c;
          cut[static_cast<size_t>(k)][static_cast<size_t>(e)] = b;
        }
      }
  std::vector<std::pair<int64_t, int64_t>> runs(static_cast<size_t>(parts));
  for (int64_t k = parts, e = n; k > 0; --k) {
    const int64_t b = cut[static_cast<size_t>(k)][static_cast<size_t>(e)];
    runs[static_cast<size_t>(k - 1)] = {b, e};
    e = b;
  }
  return runs;
}

namespace {
double numel(const torch::nn::Module& m) {
  double n = 0;
  for (const auto& p : m.parameters()) n += static_cast<double>(p.numel());
  return n;
}
}  // namespace

BlockCosts parameter_costs(models::GPTImpl& gpt) {
  BlockCosts c;
  for (int64_t i = 0; i < gpt.num_blocks(); ++i) c.blocks.push_back(numel(*gpt.h[i]));
  c.first_extra = numel(*gpt.wte) + numel(*gpt.wpe);
  c.last_extra = numel(*gpt.ln_f) + numel(*gpt.wte);  // the head's copy of wte
  return c;
}

BlockCosts measured_costs(models::GPTImpl& gpt, int64_t batch, int repeats) {
  const auto& cfg = gpt.config();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  const at::Tensor idx = torch::randint(cfg.vocab_size, {batch, cfg.block_size}, gen, torch::kLong);
  const at::Tensor x0 = torch::randn({batch, cfg.block_size, cfg.n_embd}, gen).to(gpt.wte->weight.scalar_type());
  auto time = [&](const std::function<at::Tensor()>& fn) {
    std::vector<double> ms;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn().sum().backward();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  BlockCosts c;
  for (int64_t i = 0; i < gpt.num_blocks(); ++i) {
    auto* block = gpt.h[i]->as<models::Block>();
    c.blocks.push_back(time([&] { return block->forward(x0.detach().requires_grad_(true)); }));
  }
  c.first_extra = time([&] { return gpt.embed(idx); });
  c.last_extra = time([&] { return gpt.head_loss(x0.detach().requires_grad_(true), idx); });
  gpt.zero_grad();
  return c;
}

}  // namespace scaletrain::parallel::pipeline

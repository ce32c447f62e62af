#include "scaletrain/parallel/pipeline/stage.h"

#include <algorithm>
#include <chrono>
#include <limits>

#include "scaletrain/util/error.h"

namespace scaletrain::parallel::pipeline {

namespace {
// Registers `module` under its dotted path in the model ("model.layers.3"),
// making the intermediate modules, so the chunk's names are the model's.
void register_path(torch::nn::Module& root, const std::string& path, std::shared_ptr<torch::nn::Module> module) {
  torch::nn::Module* parent = &root;
  size_t from = 0;
  for (size_t dot; (dot = path.find('.', from)) != std::string::npos; from = dot + 1) {
    const std::string name = path.substr(from, dot - from);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& item : parent->named_children())
      if (item.key() == name) child = item.value();
    if (!child) child = parent->register_module(name, std::make_shared<torch::nn::Module>());
    parent = child.get();
  }
  parent->register_module(path.substr(from), std::move(module));
}
}  // namespace

ChunkImpl::ChunkImpl(std::shared_ptr<interfaces::Staged> model, ChunkSpec spec)
    : model_(std::move(model)), spec_(spec) {
  if (spec_.begin >= spec_.end || spec_.end > model_->num_blocks())
    throw std::invalid_argument("pipeline chunk " + std::to_string(spec_.index) + " has no blocks");
  if (spec_.first())
    for (auto& [path, m] : model_->first_pieces()) register_path(*this, path, m);
  for (int64_t i = spec_.begin; i < spec_.end; ++i) {
    auto [path, m] = model_->block_module(i);
    register_path(*this, path, m);
  }
  if (spec_.last())
    for (auto& [path, m] : model_->last_pieces()) register_path(*this, path, m);
}

at::Tensor ChunkImpl::forward(const at::Tensor& input, const at::Tensor& targets) {
  at::Tensor x = spec_.first() ? model_->embed(input) : input;
  for (int64_t i = spec_.begin; i < spec_.end; ++i) {
    const interfaces::BlockBody body = model_->block_body(i);  // checkpointed if the model says so
    x = runner_ ? runner_(i - spec_.begin, body, x) : body(x);
  }
  return spec_.last() ? model_->head_loss(x, targets) : x;
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

BlockCosts parameter_costs(interfaces::Staged& model) {
  BlockCosts c;
  for (int64_t i = 0; i < model.num_blocks(); ++i) c.blocks.push_back(numel(*model.block_module(i).second));
  for (auto& piece : model.first_pieces()) c.first_extra += numel(*piece.second);
  for (auto& piece : model.last_pieces()) c.last_extra += numel(*piece.second);
  auto tied = model.tied_head().second;
  if (tied.defined()) c.last_extra += static_cast<double>(tied.numel());  // the head's copy of the embedding
  return c;
}

BlockCosts measured_costs(interfaces::Staged& model, int64_t batch, int repeats) {
  const interfaces::StageShape shape = model.stage_shape();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  // Drawn with a host generator, then moved beside the parameters.
  const at::Tensor w = model.staged_module().parameters().front();  // a copy: parameters() returns a temporary vector
  const at::Tensor idx = torch::randint(shape.vocab, {batch, shape.max_sequence}, gen, torch::kLong).to(w.device());
  const at::Tensor x0 = torch::randn({batch, shape.max_sequence, shape.width}, gen).to(w.device(), w.scalar_type());
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
  for (int64_t i = 0; i < model.num_blocks(); ++i)
    c.blocks.push_back(time([&] { return model.run_block(i, x0.detach().requires_grad_(true)); }));
  c.first_extra = time([&] { return model.embed(idx); });
  c.last_extra = time([&] { return model.head_loss(x0.detach().requires_grad_(true), idx); });
  model.staged_module().zero_grad();
  return c;
}

}  // namespace scaletrain::parallel::pipeline

#include "scaletrain/train/batches.h"

#include <filesystem>
#include <utility>

#include "scaletrain/data/mixture.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/template/chat_template.h"

#include "scaletrain/util/error.h"

namespace scaletrain::train {

namespace {

// One dataset of the run, checked against data.loss_on.
std::unique_ptr<data::TokenDataset> open_one(const config::Config& cfg, const std::string& path,
                                             const data::DatasetOptions& o) {
  const std::string& on = cfg.data.loss_on;
  const data::RecordKind need = on == "completion" ? data::RecordKind::PromptCompletion : data::RecordKind::Messages;
  auto refuse = [&](const std::string& holds) {
    return UsageError("data.loss_on=" + on + " needs a token file prepared from " + data::record_kind_name(need) +
                      " records, but " + path + " holds " + holds);
  };
  try {
    auto dataset = std::make_unique<data::TokenDataset>(path, o);
    if (o.use_mask && dataset->kind() != need)
      throw refuse(std::string(data::record_kind_name(dataset->kind())) + " records");
    return dataset;
  } catch (const UsageError& e) {
    // Name what the loss needs rather than the mask the dataset missed.
    if (o.use_mask && std::string(e.what()).find("has no target mask") != std::string::npos) throw refuse("plain text");
    throw;
  }
}

}  // namespace

std::unique_ptr<data::SampleSource> open_dataset(const config::Config& cfg, const Plan& plan) {
  data::DatasetOptions o;
  o.block_size = plan.model.block_size;
  o.use_mask = cfg.data.loss_on != "all";
  o.packing = cfg.data.packing;
  o.documents = cfg.data.pack == "documents";
  o.separator = cfg.data.document_separator;
  if (cfg.data.mixture.empty()) return open_one(cfg, cfg.data.path, o);
  std::vector<std::unique_ptr<data::TokenDataset>> parts;
  std::vector<double> weights;
  for (const data::MixturePart& p : data::parse_mixture(cfg.data.mixture)) {
    parts.push_back(open_one(cfg, p.path, o));
    weights.push_back(p.weight);
  }
  return std::make_unique<data::Mixture>(std::move(parts), std::move(weights), cfg.train.seed);
}

std::vector<double> micro_weights(const data::SampleSource& dataset, const data::DistributedSampler& sampler,
                                  int64_t step, int dp_rank, int dp_size, int64_t micro_batch, int64_t accum,
                                  const std::string& loss_on, int64_t* global_targets) {
  const int64_t global = dataset.count_targets(sampler.global_batch(step));
  if (global_targets != nullptr) *global_targets = global;
  if (global == 0)
    throw UsageError("step " + std::to_string(step + 1) + ": no token of the global batch is a target (data.loss_on=" +
                     loss_on + "; are the responses cut off by model.block_size?)");
  std::vector<double> w;
  for (int64_t k = 0; k < accum; ++k) {
    const auto idx = sampler.indices(step, dp_rank, dp_size, static_cast<int>(k), static_cast<int>(micro_batch));
    w.push_back(static_cast<double>(dataset.count_targets(idx) * dp_size) / static_cast<double>(global));
  }
  return w;
}

void keep_context_part(at::Tensor& inputs, at::Tensor& targets, std::shared_ptr<const models::SequenceLayout>& layout,
                       int cp_rank, int cp) {
  namespace ctx = parallel::context;
  const int64_t B = inputs.size(0), T = inputs.size(1);
  auto part = std::make_shared<models::SequenceLayout>();
  part->positions = ctx::shard_sequence(
      layout ? layout->positions : torch::arange(T, inputs.options().dtype(torch::kLong)).expand({B, T}), cp_rank, cp);
  if (layout && layout->segments.defined()) part->segments = ctx::shard_sequence(layout->segments, cp_rank, cp);
  part->span = T;
  layout = std::move(part);
  inputs = ctx::shard_sequence(inputs, cp_rank, cp);
  targets = ctx::shard_sequence(targets, cp_rank, cp);
}

double context_weight(const at::Tensor& targets, int64_t global_targets, int dp, int cp) {
  const int64_t mine = targets.ne(models::kIgnoreTarget).sum().item<int64_t>();
  return static_cast<double>(mine) * dp * cp / static_cast<double>(global_targets);
}

std::string sample_prompt_text(const config::Config& cfg) {
  const std::string prompt = cfg.train.sample_prompt.empty() ? "\n" : cfg.train.sample_prompt;
  if (!cfg.train.sample_chat) return prompt;
  namespace fs = std::filesystem;
  const fs::path tok(cfg.data.tokenizer);
  const fs::path config = (fs::is_directory(tok) ? tok : tok.parent_path()) / "tokenizer_config.json";
  if (cfg.data.tokenizer.empty() || !fs::exists(config))
    throw UsageError("train.sample_chat needs data.tokenizer to be a tokenizer whose directory has a "
                     "tokenizer_config.json with a chat_template");
  const tmpl::ChatTemplate chat = tmpl::ChatTemplate::from_tokenizer_config(config.string());
  return chat.render(tmpl::Json::array({{{"role", "user"}, {"content", prompt}}}), true);
}

}  // namespace scaletrain::train

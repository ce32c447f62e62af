// What our families' runs hand the training loop (run_internal.h): its
// options from the checkpoint.* and metrics.* keys, and what a checkpoint
// holds of the run (the layout, AdamW's moments, the model's shape, a LoRA
// run's adapters only) with what a run of this kind may resume. Resuming and
// saving are the loop's (Note [Training loop] in training_loop.cpp).
#include "scaletrain/train/run_internal.h"

#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/recipe.h"
#include "scaletrain/util/error.h"

namespace scaletrain::train::detail {

namespace {

checkpoint::ModelShape model_shape(const models::ModelConfig& m) {
  return {m.vocab_size, m.block_size, m.n_layer, m.n_head, m.n_embd, m.bias, m.family, models::config_to_hf(m).dump()};
}

// The files of data.tokenizer a checkpoint keeps a copy of (Note [Checkpoint
// assets] in checkpoint/sharded.h), as (name in the step directory, source):
// the tokenizer.json (data.tokenizer itself, or the one in that directory),
// and the tokenizer_config.json / special_tokens_map.json beside it; a
// directory of GPT-2's vocab.json + merges.txt gives those two.
std::vector<std::pair<std::string, std::string>> tokenizer_assets(const std::string& tokenizer) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::string>> out;
  if (tokenizer.empty()) return out;
  const fs::path path(tokenizer);
  const fs::path dir = fs::is_directory(path) ? path : path.parent_path();
  auto add = [&](const std::string& name, const fs::path& from) {
    if (fs::is_regular_file(from)) out.emplace_back("tokenizer/" + name, from.string());
  };
  if (fs::is_directory(path)) {
    add("tokenizer.json", dir / "tokenizer.json");
    if (out.empty()) {
      add("vocab.json", dir / "vocab.json");
      add("merges.txt", dir / "merges.txt");
    }
  } else {
    add("tokenizer.json", path);
  }
  add("tokenizer_config.json", dir / "tokenizer_config.json");
  add("special_tokens_map.json", dir / "special_tokens_map.json");
  return out;
}

// A finetune run saves and loads its adapters only: every piece of a frozen
// parameter is dropped (frozen flats are whole slots; adapters never share
// a slot with frozen parameters).
checkpoint::Layout adapters_only(checkpoint::Layout l) {
  std::vector<checkpoint::Slot> kept;
  for (auto& slot : l.slots) {
    std::vector<checkpoint::SlotPiece> pieces;
    for (auto& p : slot.pieces)
      if (models::is_adapter_parameter(p.name)) pieces.push_back(std::move(p));
    if (pieces.empty()) continue;
    slot.pieces = std::move(pieces);
    kept.push_back(std::move(slot));
  }
  l.slots = std::move(kept);
  return l;
}

// A checkpoint resumes a run of the same kind: full into full, adapters into
// adapters of the same settings on the same base (`finetune`: this run's
// checkpoint::ModelShape::finetune, "" when every parameter trains).
void check_resumable(const checkpoint::Index& x, const std::string& from, const std::string& finetune) {
  if (x.model.finetune.empty() == finetune.empty()) {
    if (finetune.empty()) return;
    const auto saved = hub::settings_from_json(nlohmann::json::parse(x.model.finetune), from + "/index.json");
    const auto now = hub::settings_from_json(nlohmann::json::parse(finetune), "this run");
    if (saved.base != now.base)
      throw UsageError("checkpoint " + from + " holds adapters of base '" + saved.base + "', but model.init_from is '" +
                       now.base + "' ('' = the seeded random init)");
    if (saved.method != now.method || saved.r != now.r || saved.target_modules != now.target_modules ||
        saved.double_quant != now.double_quant)
      throw UsageError("checkpoint " + from + " holds " + saved.method + " adapters (r=" + std::to_string(saved.r) +
                       ", layers " + c10::Join(",", saved.target_modules) +
                       "), not those this run's finetune section " + "asks for (" + now.method +
                       ", r=" + std::to_string(now.r) + ", layers " + c10::Join(",", now.target_modules) + ")");
    return;
  }
  if (finetune.empty())
    throw UsageError("checkpoint " + from + " holds adapters only (finetune.method " +
                     nlohmann::json::parse(x.model.finetune).value("method", std::string("lora")) +
                     "); resume it with the same finetune section");
  throw UsageError("checkpoint " + from + " holds a whole model, not adapters: start the finetune run from an " +
                   "exported Hub directory (model.init_from) instead");
}

}  // namespace

LoopOptions loop_options(const Run& r) {
  const config::Config& cfg = r.cfg;
  LoopOptions o;
  o.who = "scaletrain";
  o.steps = cfg.train.steps;
  o.stop_at = cfg.train.stop_at;
  o.checkpoint = {cfg.checkpoint.dir, static_cast<int>(cfg.checkpoint.keep), cfg.checkpoint.async,
                  r.plan.full_state_dict, tokenizer_assets(cfg.data.tokenizer)};
  o.checkpoint_every = cfg.checkpoint.every;
  o.resume = cfg.checkpoint.resume;
  o.resume_key = "checkpoint.resume";
  o.trace_key = "metrics.trace_steps";
  o.metrics_path = cfg.metrics.path;
  o.log_every = cfg.metrics.log_every;
  o.lines = true;
  o.bar = cfg.metrics.progress;
  o.trace_steps = cfg.metrics.trace_steps;
  o.trace_dir = cfg.metrics.trace_dir;
  return o;
}

// A LoRA or QLoRA run saves and loads its adapters only (Note [PEFT adapter
// directories]), and refuses a checkpoint of another kind.
RunCheckpoint run_checkpoint(Run& r) {
  const config::Config& cfg = r.cfg;
  RunCheckpoint c;
  c.layout = r.dp().checkpoint_layout();
  c.layout.mesh = r.dims.describe();
  c.optimizer = std::make_unique<checkpoint::OptimizerMoments<optim::AdamW>>(*r.opt);
  c.model = model_shape(r.plan.model);
  if (const auto& lora = r.plan.engines.start.lora) {
    c.layout = adapters_only(std::move(c.layout));
    const hub::AdapterSettings settings =
        hub::adapter_settings(r.model(), *lora, cfg.finetune.method, cfg.model.init_from, cfg.finetune.double_quant);
    c.model.finetune = hub::settings_to_json(settings).dump();
  }
  c.check = [finetune = c.model.finetune](const checkpoint::Index& x, const std::string& from) {
    check_resumable(x, from, finetune);
  };
  return c;
}

}  // namespace scaletrain::train::detail

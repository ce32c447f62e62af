// Resuming a run from a checkpoint and saving one (run_internal.h): which
// checkpoint to go on from (checkpoint.resume, a restarted attempt), what a
// run of this kind may resume, and everything the next step depends on
// besides the tensors.
#include "scaletrain/train/run_internal.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/precision/fp8.h"
#include "scaletrain/precision/loss_scaler.h"
#include "scaletrain/train/plan/plan.h"
#include "scaletrain/train/recipe.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/trace.h"

namespace scaletrain::train::detail {

// The launcher's attempt number (launch --max-restarts): 0 on a first start.
int restart_count() {
  for (const char* name : {"SCALETRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"})
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && *end == '\0' && n >= 0 && n < 1000000) return static_cast<int>(n);
      throw UsageError(std::string(name) + "=" + v + " is not an attempt number");
    }
  return 0;
}

namespace {

// The checkpoint to resume from per checkpoint.resume, or "" for a fresh start.
// Under auto, the newest complete checkpoint whose files pass their checksums:
// a newer one that fails is skipped with a line naming the bad file (`lead`
// prints it), and when every one fails the run stops rather than starting
// over beside them.
// A restarted group (restart_count() > 0) goes on from the newest intact
// checkpoint of checkpoint.dir whatever checkpoint.resume says: the first
// attempt's progress is there, and starting over would redo it (or, with a
// fixed path, go back to it).
std::string resume_path(const config::CheckpointingOptions& c, bool lead) {
  if (const int restart = restart_count(); restart > 0) {
    if (c.dir.empty() || checkpoint::complete_checkpoints(c.dir).empty()) {
      if (lead && (c.resume == "auto" || c.resume == "never"))
        std::printf("scaletrain: restart %d of the group: no checkpoint to go on from (%s), starting at step 0\n",
                    restart, c.dir.empty() ? "checkpoint.dir is not set" : ("none in " + c.dir).c_str());
    } else if (c.resume != "auto") {
      if (lead)
        std::printf(
            "scaletrain: restart %d of the group: resuming from the newest intact checkpoint in %s "
            "(checkpoint.resume=%s is for a first start)\n",
            restart, c.dir.c_str(), c.resume.c_str());
      config::CheckpointingOptions newest = c;
      newest.resume = "auto";
      return resume_path(newest, lead);
    }
  }
  if (c.resume == "never") return "";
  if (c.resume == "auto") {
    if (c.dir.empty()) return "";
    const std::vector<std::string> all = checkpoint::complete_checkpoints(c.dir);
    std::string newest_bad;
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      std::string bad;
      try {
        const std::vector<std::string> problems = checkpoint::verify_files(*it, checkpoint::read_index(*it));
        if (problems.empty()) return *it;
        bad = "corrupt file " + problems.front();
      } catch (const UsageError& e) {
        bad = e.what();
      }
      if (lead) std::printf("scaletrain: checkpoint.resume=auto: skipping %s: %s\n", it->c_str(), bad.c_str());
      if (newest_bad.empty()) newest_bad = bad;
    }
    if (!all.empty())
      throw UsageError("checkpoint.resume=auto: none of the " + std::to_string(all.size()) + " checkpoints in " +
                       c.dir + " is intact (the newest: " + newest_bad +
                       "); remove them, or set checkpoint.resume=never to start over");
    return "";
  }
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(c.resume) / "index.json")) return c.resume;         // a step directory
  if (auto newest = checkpoint::newest_checkpoint(c.resume)) return *newest;  // a root of step directories
  throw UsageError("checkpoint.resume=" + c.resume + " is not a complete checkpoint nor a directory holding one");
}

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
// adapters of the same settings on the same base.
void check_resumable(const checkpoint::Index& x, const std::string& from, const Run& r) {
  if (x.model.finetune.empty() == r.finetune.empty()) {
    if (r.finetune.empty()) return;
    const auto saved = hub::settings_from_json(nlohmann::json::parse(x.model.finetune), from + "/index.json");
    const auto now = hub::settings_from_json(nlohmann::json::parse(r.finetune), "this run");
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
  if (r.finetune.empty())
    throw UsageError("checkpoint " + from + " holds adapters only (finetune.method " +
                     nlohmann::json::parse(x.model.finetune).value("method", std::string("lora")) +
                     "); resume it with the same finetune section");
  throw UsageError("checkpoint " + from + " holds a whole model, not adapters: start the finetune run from an " +
                   "exported Hub directory (model.init_from) instead");
}

}  // namespace

// Resuming restores, besides the tensors, everything the next step depends
// on: the step (which also positions the LR schedule and the sampler, both
// pure functions of it), AdamW's step count, the loss scaler and the RNG.
// Returns the step to start from.
int64_t resume(Run& r) {
  const config::Config& cfg = r.cfg;
  const std::string from = resume_path(cfg.checkpoint, r.lead);
  if (!cfg.checkpoint.dir.empty() || !from.empty()) {  // only runs that checkpoint need a layout
    r.layout = r.dp().checkpoint_layout();
    r.layout.mesh = r.dims.describe();
    if (const auto& lora = r.plan.engines.start.lora) {  // adapters only (Note [PEFT adapter directories])
      r.layout = adapters_only(std::move(r.layout));
      const hub::AdapterSettings settings =
          hub::adapter_settings(r.model(), *lora, cfg.finetune.method, cfg.model.init_from, cfg.finetune.double_quant);
      r.finetune = hub::settings_to_json(settings).dump();
    }
  }
  if (!cfg.checkpoint.dir.empty()) checkpoint::check_shared_directory(*r.world->group(), cfg.checkpoint.dir);
  if (!cfg.checkpoint.dir.empty())
    r.ckpt = std::make_unique<checkpoint::Checkpointer>(
        *r.world->group(),
        checkpoint::CheckpointOptions{cfg.checkpoint.dir, static_cast<int>(cfg.checkpoint.keep), cfg.checkpoint.async,
                                      r.plan.full_state_dict, tokenizer_assets(cfg.data.tokenizer)});
  if (from.empty()) return 0;
  const auto t_load = std::chrono::steady_clock::now();
  check_resumable(checkpoint::read_index(from), from, r);
  checkpoint::OptimizerMoments<optim::AdamW> moments(*r.opt);
  const checkpoint::Index index = checkpoint::load_checkpoint(from, r.layout, &moments);
  r.dp().after_load();
  if (r.scaler && !index.state.loss_scaler.empty())
    r.scaler->load_state(precision::LossScalerState::from_map(index.state.loss_scaler));
  checkpoint::set_cpu_rng_state(index.state.rng_cpu);
  if (r.lead)
    std::printf("scaletrain: resumed from %s (step %lld, saved by %s on %d ranks; loaded in %.3f s)\n", from.c_str(),
                static_cast<long long>(index.state.step), index.strategy.c_str(), index.world_size,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  // Note [FP8 scaling state]: the delayed scales go on where they were.
  const bool delayed = !r.fp8.empty() && cfg.precision.fp8_recipe == "delayed";
  if (delayed && !index.state.fp8_scaling.empty()) {
    try {
      precision::fp8_restore_scaling(r.fp8, index.state.fp8_scaling);
    } catch (const std::invalid_argument& e) {
      throw UsageError("checkpoint " + from + ": " + e.what());
    }
  } else if (r.lead && delayed) {
    std::printf(
        "scaletrain: note: %s holds no FP8 scaling state (saved without delayed FP8 scaling): the scales "
        "start again from 1\n",
        from.c_str());
  } else if (r.lead && !index.state.fp8_scaling.empty()) {
    std::printf("scaletrain: note: the FP8 scaling state in %s is not used (this run has no delayed FP8 scaling)\n",
                from.c_str());
  }
  return index.state.step;
}

void save_checkpoint(Run& r, int64_t done) {
  trace::Span span("checkpoint", "save checkpoint", done);
  checkpoint::SaveState st{
      {done, r.opt->steps(), r.scaler ? r.scaler->state().to_map() : std::map<std::string, double>{},
       checkpoint::cpu_rng_state(),
       // Note [FP8 scaling state]: agreed over the whole job (pipeline stages hold different layers).
       precision::fp8_scaling_state(r.fp8, {r.world->group().get()})},
      model_shape(r.plan.model)};
  st.model.finetune = r.finetune;
  const checkpoint::OptimizerMoments<optim::AdamW> moments(*r.opt);
  r.ckpt->save(r.layout, &moments, st);
  if (r.lead)
    std::printf("scaletrain: checkpoint %s %s (training stalled %.3f s)\n",
                r.cfg.checkpoint.async ? "started" : "saved", checkpoint::step_dir(r.cfg.checkpoint.dir, done).c_str(),
                r.ckpt->last_stall_s());
}

}  // namespace scaletrain::train::detail

#include "scaletrain/train/plan/model_config.h"

#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_read.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/util/error.h"

#include <utility>

namespace scaletrain::train {
namespace {

// An explicit model.<key> must be the file's value (`what`: "model.init_from PATH").
void agree(const char* key, int64_t given, int64_t from_file, const std::string& what) {
  if (given != 0 && given != from_file)
    throw UsageError(std::string("model.") + key + "=" + std::to_string(given) + " disagrees with " + what + " (" +
                     std::to_string(from_file) + ")");
}

// The keys that choose how to train rather than what the model is.
void with_training_keys(models::ModelConfig& c, const config::ModelOptions& m) {
  const config::ModelOptions defaults;
  c.attention = m.attention;
  c.fused = m.fused;
  if (m.router_aux_loss_coef != defaults.router_aux_loss_coef) c.router_aux_loss_coef = m.router_aux_loss_coef;
  if (m.router_z_loss_coef != defaults.router_z_loss_coef) c.router_z_loss_coef = m.router_z_loss_coef;
  if (m.capacity_factor != defaults.capacity_factor) c.capacity_factor = m.capacity_factor;
  if (m.moe_drop_policy != defaults.moe_drop_policy) c.moe_drop_policy = m.moe_drop_policy;
}

// What every source of a model takes from the run's keys: block_size (only
// shorter than `positions`, the source's table), dropout, the experts'
// counts (only repeated) and the training keys; then the model's checks.
models::ModelConfig with_run_keys(models::ModelConfig f, const config::ModelOptions& m, const std::string& what,
                                  const std::string& positions) {
  if (m.block_size > f.block_size)
    throw UsageError("model.block_size=" + std::to_string(m.block_size) + " is longer than " + positions + " (" +
                     std::to_string(f.block_size) + " positions)");
  if (m.block_size) f.block_size = m.block_size;
  f.dropout = m.dropout;
  agree("num_local_experts", m.num_local_experts, f.num_local_experts, what);
  agree("num_experts_per_tok", m.num_experts_per_tok, f.num_local_experts > 0 ? f.num_experts_per_tok : 0, what);
  with_training_keys(f, m);
  f.validate();
  return f;
}

// A config.json's model with the run's keys on top: the dimensions may only
// repeat the file's, block_size may shorten the sequence.
models::ModelConfig with_keys(models::ModelConfig f, const config::ModelOptions& m, const std::string& what) {
  agree("n_layer", m.n_layer, f.n_layer, what);
  agree("n_head", m.n_head, f.n_head, what);
  agree("n_kv_head", m.n_kv_head, f.kv_heads(), what);
  agree("intermediate_size", m.intermediate_size, f.mlp_width(), what);
  agree("n_embd", m.n_embd, f.n_embd, what);
  agree("vocab_size", m.vocab_size, f.vocab_size, what);
  return with_run_keys(std::move(f), m, what, what + " allows");
}

}  // namespace

models::ModelConfig resolve_model_config(const config::ModelOptions& m) {
  if (!m.config.empty()) {
    if (!m.init_from.empty())
      throw UsageError("model.config and model.init_from both describe the model: give one (init_from reads the "
                       "config.json beside its weights)");
    return with_keys(models::read_hf_config(m.config), m, "model.config " + m.config);
  }
  models::ModelConfig c = models::model_preset(m.preset);
  if (m.init_from.empty()) {
    if (m.n_layer) c.n_layer = m.n_layer;
    if (m.n_head) c.n_head = m.n_head;
    if (m.n_kv_head) c.n_kv_head = m.n_kv_head;
    if (m.intermediate_size) c.intermediate_size = m.intermediate_size;
    if (m.n_embd) c.n_embd = m.n_embd;
    if (m.block_size) c.block_size = m.block_size;
    if (m.vocab_size) c.vocab_size = m.vocab_size;
    c.dropout = m.dropout;
    if (m.num_local_experts) c.num_local_experts = m.num_local_experts;
    if (m.num_experts_per_tok) c.num_experts_per_tok = m.num_experts_per_tok;
    with_training_keys(c, m);
    c.validate();
    return c;
  }
  // A Hub directory of the llama family: its config.json says everything.
  if (const auto hub = hub::read_hub_config(m.init_from);
      hub && hub->value("model_type", std::string()) != "gpt2") {
    return with_keys(models::config_from_hf(*hub, m.init_from + "/config.json"), m, "model.init_from " + m.init_from);
  }
  if (c.family != "gpt2")
    throw UsageError("model.init_from " + m.init_from + " has no config.json of the " + c.family +
                     " family beside it (model.preset=" + m.preset + ")");
  if (m.n_kv_head || m.intermediate_size)
    throw UsageError("model.n_kv_head / model.intermediate_size: GPT-2 files from model.init_from have neither");
  models::ModelConfig f;
  try {
    f = hub::hf_gpt2_file_config(m.init_from);
  } catch (const checkpoint::SafetensorsError& e) {  // a missing or malformed file: bad input, one line
    throw UsageError("model.init_from: " + std::string(e.what()));
  }
  const std::string what = "model.init_from " + m.init_from;
  agree("n_layer", m.n_layer, f.n_layer, what);
  agree("n_embd", m.n_embd, f.n_embd, what);
  agree("vocab_size", m.vocab_size, f.vocab_size, what);
  if (f.n_head > 0) {
    agree("n_head", m.n_head, f.n_head, what);
  } else if (m.n_head) {
    f.n_head = m.n_head;
  } else if (c.n_embd == f.n_embd) {
    f.n_head = c.n_head;  // the preset describes this width
  } else {
    throw UsageError("model.init_from " + m.init_from +
                     ": the head count is not in the weights and there is no config.json beside them; set model.n_head");
  }
  return with_run_keys(std::move(f), m, what, what + "'s position table");
}

}  // namespace scaletrain::train

namespace scaletrain::train {

int64_t model_width(const config::ModelOptions& m) { return resolve_model_config(m).n_embd; }

config::Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return config::load_config(path, overrides, model_width);
}

void apply_deepspeed_config(config::Config& c, const std::string& path, int data_parallel_size) {
  config::apply_deepspeed_config(c, path, data_parallel_size, model_width);
}

}  // namespace scaletrain::train

#pragma once
// LoRA adapters in and out, in PEFT's directory layout, and merging them
// into a base model.
//
// Note [PEFT adapter directories]
// A directory holds adapter_config.json and adapter_model.safetensors, as
// PEFT's save_pretrained writes them:
// - the config: peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha,
//   lora_dropout, target_modules (the adapted layers' names, expanded: never
//   "all-linear"), use_rslora, bias "none", fan_in_fan_out (true for GPT-2,
//   whose Hub weights are Conv1D, stored [in, out]), base_model_name_or_path,
//   and the defaults of the features we do not have (use_dora false, empty
//   rank_pattern / alpha_pattern, no modules_to_save or layers_to_transform);
//   reading refuses a config that uses any of them;
// - the tensors: "base_model.model." + the Hub name of the adapted layer +
//   ".lora_A.weight" ([r, in]) / ".lora_B.weight" ([out, r]). The Hub name is
//   the family's (llama: ours; gpt2: "transformer." + ours). lora_A and
//   lora_B have these shapes for Conv1D layers too; only merging transposes.
//
// A finetune run's checkpoints hold the adapters and their optimizer state
// only; their index records the settings below (checkpoint::ModelShape::
// finetune), so `checkpoint export --adapter` needs no run config.
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/lora.h"

namespace scaletrain::hub {

struct AdapterSettings {
  std::string method = "lora";  // lora | qlora (ours; PEFT does not record it)
  int64_t r = 8;
  double alpha = 8;
  double dropout = 0;
  bool rslora = false;
  std::vector<std::string> target_modules;  // the adapted layers' names (leaf), sorted
  std::string base;                         // the base model: model.init_from, or "" for a seeded random init
  bool double_quant = true;                 // qlora only

  double scaling() const;
  models::LoraOptions lora_options(uint64_t seed) const;
};

// The settings of the adapters `model` carries (after models::apply_lora).
AdapterSettings adapter_settings(const models::CausalLM& model, const models::LoraOptions& lora, std::string method,
                                 std::string base, bool double_quant);

// To and from the index's record (compact JSON object).
nlohmann::json settings_to_json(const AdapterSettings& s);
AdapterSettings settings_from_json(const nlohmann::json& j, const std::string& source);

// PEFT's name for our adapter parameter `name` of a `family` model, and back
// ("" when `peft_name` is not an adapter tensor of that family).
std::string peft_tensor_name(const std::string& family, const std::string& name);
std::string our_tensor_name(const std::string& family, const std::string& peft_name);

// A PEFT adapter directory's content, with our parameter names.
struct Adapter {
  AdapterSettings settings;
  std::map<std::string, at::Tensor> tensors;  // fp32 (as stored, converted)
};

// Writes adapter_config.json and adapter_model.safetensors into the existing
// directory `dir`. `tensors`: our names; written in `dtype` (fp32 default).
// Family "module": a user's module (models/lora_linear.h), whose names are
// its module paths and whose task_type is null.
void write_adapter_files(const std::string& dir, const std::string& family, const AdapterSettings& s,
                         const std::map<std::string, at::Tensor>& tensors, at::ScalarType dtype = at::kFloat);

// Reads DIR (Note [PEFT adapter directories]). Throws UsageError, one line,
// naming the file and the problem: missing files, malformed JSON, another
// peft_type, a feature we do not have, r < 1, a tensor that is not an
// adapter of a `family` model.
Adapter read_adapter(const std::string& dir, const std::string& family);

// Checks that `model` (after apply_lora with the adapter's settings) has
// exactly the adapter's tensors with their shapes; UsageError naming the
// first tensor that differs.
void check_adapter_fits(const Adapter& a, const models::CausalLM& model, const std::string& dir);

// `scaletrain checkpoint export --adapter`: the adapters of a finetune
// checkpoint as a PEFT directory at out_dir (written whole or not at all).
// Returns the number of tensors written.
int64_t export_adapter(const std::string& step_dir, const std::string& out_dir);

// `scaletrain lora merge`: base Hub directory + PEFT adapter directory ->
// a Hub directory holding W + scaling * B A for every adapted layer (in
// fp64, stored in `dtype`: "" = the base's torch_dtype, else fp32, bf16 or
// fp16), the base's config.json and its tokenizer files. Returns the number
// of layers merged.
int64_t merge_adapter(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
                      const std::string& dtype = "");

}  // namespace scaletrain::hub

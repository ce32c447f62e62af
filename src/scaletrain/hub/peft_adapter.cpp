#include "scaletrain/hub/peft_adapter.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "scaletrain/hub/hub_read.h"
#include "scaletrain/hub/hub_write.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_export.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"
#include "scaletrain/util/strings.h"

namespace scaletrain::hub {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kPeftPrefix = "base_model.model.";
const char* const kSuffixes[] = {".lora_A.weight", ".lora_B.weight"};
const char* const kConfigFile = "adapter_config.json";
const char* const kWeightsFile = "adapter_model.safetensors";

// "layers.0.self_attn.q_proj.lora_A.weight" -> {"layers.0.self_attn.q_proj", ".lora_A.weight"}.
std::pair<std::string, std::string> split_adapter_name(const std::string& name) {
  for (const char* s : kSuffixes)
    if (util::ends_with(name, s)) return {name.substr(0, name.size() - std::string(s).size()), s};
  return {"", ""};
}

std::string leaf(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

// The Hub name of our layer path (a module, not a parameter).
std::string hub_layer(const std::string& family, const std::string& layer) {
  if (family != "gpt2") return layer;
  const std::string w = hub::hf_gpt2_name(layer + ".weight");
  return w.substr(0, w.size() - std::string(".weight").size());
}

json read_json(const fs::path& p) {
  return util::read_json_file(p.string(), "adapter: " + p.string());  // Note [Strict JSON]
}

at::ScalarType parse_dtype(const std::string& d) {
  if (d == "fp32") return at::kFloat;
  if (d == "bf16") return at::kBFloat16;
  if (d == "fp16") return at::kHalf;
  throw UsageError("--dtype must be fp32, bf16 or fp16, got '" + d + "'");
}

}  // namespace

double AdapterSettings::scaling() const { return lora_options(0).scaling(); }

models::LoraOptions AdapterSettings::lora_options(uint64_t seed) const {
  models::LoraOptions o;
  o.r = r;
  o.alpha = alpha;
  o.rslora = rslora;
  o.dropout = dropout;
  o.target_modules = target_modules;
  o.seed = seed;
  return o;
}

AdapterSettings adapter_settings(const models::CausalLM& model, const models::LoraOptions& lora, std::string method,
                                 std::string base, bool double_quant) {
  AdapterSettings s;
  s.method = std::move(method);
  s.r = lora.r;
  s.alpha = lora.alpha;
  s.dropout = lora.dropout;
  s.rslora = lora.rslora;
  s.base = std::move(base);
  s.double_quant = double_quant;
  std::set<std::string> names;
  for (const auto& item : model.named_modules()) {
    const auto* lin = item.value()->as<models::LinearImpl>();
    if (lin && lin->has_adapter()) names.insert(leaf(item.key()));
  }
  s.target_modules.assign(names.begin(), names.end());
  return s;
}

json settings_to_json(const AdapterSettings& s) {
  return {{"method", s.method},     {"r", s.r},
          {"lora_alpha", s.alpha},  {"lora_dropout", s.dropout},
          {"use_rslora", s.rslora}, {"target_modules", s.target_modules},
          {"base", s.base},         {"double_quant", s.double_quant}};
}

AdapterSettings settings_from_json(const json& j, const std::string& source) {
  AdapterSettings s;
  try {
    s.method = j.at("method").get<std::string>();
    s.r = j.at("r").get<int64_t>();
    s.alpha = j.at("lora_alpha").get<double>();
    s.dropout = j.at("lora_dropout").get<double>();
    s.rslora = j.at("use_rslora").get<bool>();
    s.target_modules = j.at("target_modules").get<std::vector<std::string>>();
    s.base = j.at("base").get<std::string>();
    s.double_quant = j.value("double_quant", true);
  } catch (const json::exception& e) {
    throw UsageError(source + ": malformed finetune record (" + std::string(e.what()) + ")");
  }
  return s;
}

std::string peft_tensor_name(const std::string& family, const std::string& name) {
  const auto [layer, suffix] = split_adapter_name(name);
  if (layer.empty()) throw UsageError("'" + name + "' is not an adapter parameter");
  return kPeftPrefix + hub_layer(family, layer) + suffix;
}

std::string our_tensor_name(const std::string& family, const std::string& peft_name) {
  if (peft_name.rfind(kPeftPrefix, 0) != 0) return "";
  const auto [hub, suffix] = split_adapter_name(peft_name.substr(kPeftPrefix.size()));
  if (hub.empty()) return "";
  std::string layer = hub;
  if (family == "gpt2") {
    const std::string hf = hub::hf_gpt2_name("");
    if (layer.rfind(hf, 0) != 0) return "";
    layer = layer.substr(hf.size());
  }
  return layer + suffix;
}

void write_adapter_files(const std::string& dir, const std::string& family, const AdapterSettings& s,
                         const std::map<std::string, at::Tensor>& tensors, at::ScalarType dtype) {
  const json config = {{"peft_type", "LORA"},
                       {"task_type", family == "module" ? json(nullptr) : json("CAUSAL_LM")},
                       {"r", s.r},
                       {"lora_alpha", s.alpha},
                       {"lora_dropout", s.dropout},
                       {"target_modules", s.target_modules},
                       {"use_rslora", s.rslora},
                       {"bias", "none"},
                       {"fan_in_fan_out", family == "gpt2"},
                       {"base_model_name_or_path", s.base},
                       {"inference_mode", true},
                       {"init_lora_weights", true},
                       {"modules_to_save", nullptr},
                       {"layers_to_transform", nullptr},
                       {"layers_pattern", nullptr},
                       {"rank_pattern", json::object()},
                       {"alpha_pattern", json::object()},
                       {"use_dora", false},
                       {"revision", nullptr}};
  std::vector<at::Tensor> keep;
  std::vector<checkpoint::TensorRef> refs;
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.detach().to(at::kCPU, dtype).contiguous());  // host: file bytes
    const at::Tensor& c = keep.back();
    refs.push_back({peft_tensor_name(family, name), checkpoint::safetensors_dtype(dtype, name), c.sizes().vec(),
                    c.data_ptr(), c.nbytes()});
  }
  try {
    checkpoint::write_safetensors((fs::path(dir) / kWeightsFile).string(), refs, {{"format", "pt"}});
  } catch (const checkpoint::SafetensorsError& e) {
    throw UsageError("cannot write " + (fs::path(dir) / kWeightsFile).string() + ": " + e.what());
  }
  checkpoint::write_file_durably((fs::path(dir) / kConfigFile).string(), config.dump(2) + "\n");
}

Adapter read_adapter(const std::string& dir, const std::string& family) {
  const fs::path cfg = fs::path(dir) / kConfigFile, weights = fs::path(dir) / kWeightsFile;
  if (!fs::is_regular_file(cfg)) throw UsageError("adapter " + dir + ": no " + kConfigFile);
  if (!fs::is_regular_file(weights)) throw UsageError("adapter " + dir + ": no " + kWeightsFile);
  const json j = read_json(cfg);
  const std::string src = "adapter " + cfg.string();
  auto refuse = [&](const std::string& what) { throw UsageError(src + ": " + what); };
  if (!j.is_object()) refuse("not a JSON object");
  const std::string type = j.value("peft_type", std::string("(none)"));
  if (type != "LORA") refuse("peft_type " + type + " is not LORA (this build reads LoRA adapters only)");
  Adapter a;
  AdapterSettings& s = a.settings;
  try {
    s.r = j.at("r").get<int64_t>();
    s.alpha = j.value("lora_alpha", 8.0);
    s.dropout = j.contains("lora_dropout") && !j["lora_dropout"].is_null() ? j["lora_dropout"].get<double>() : 0.0;
    s.rslora = j.contains("use_rslora") && !j["use_rslora"].is_null() && j["use_rslora"].get<bool>();
    if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
      s.base = j["base_model_name_or_path"].get<std::string>();
    if (j.value("use_dora", false)) refuse("use_dora is true (DoRA adapters are not supported)");
    if (j.value("bias", std::string("none")) != "none")
      refuse("bias " + j["bias"].dump() + " (only none is supported)");
    for (const char* k : {"rank_pattern", "alpha_pattern"})
      if (j.contains(k) && !j[k].is_null() && !j[k].empty())
        refuse(std::string(k) + " is set (per-layer ranks are not supported)");
    for (const char* k : {"modules_to_save", "layers_to_transform"})
      if (j.contains(k) && !j[k].is_null() && !(j[k].is_array() && j[k].empty()))
        refuse(std::string(k) + " is set (not supported)");
    if (family != "gpt2" && j.value("fan_in_fan_out", false))
      refuse("fan_in_fan_out is true, which is for Conv1D layers (GPT-2); a " + family + " model has none");
  } catch (const json::exception& e) {
    refuse(std::string("malformed (") + e.what() + ")");
  }
  if (s.r < 1) refuse("r must be at least 1, got " + std::to_string(s.r));
  if (!(s.alpha > 0) || !std::isfinite(s.alpha)) refuse("lora_alpha must be a positive number");

  // The tensors decide which layers are adapted (target_modules may be a
  // regular expression in PEFT's config; it is not needed).
  std::set<std::string> leaves;
  try {
    hub::HubWeights w(weights.string());
    for (const std::string& name : w.names()) {
      const std::string ours = our_tensor_name(family, name);
      if (ours.empty())
        throw UsageError("adapter " + weights.string() + ": tensor " + name + " is not a LoRA tensor of a " + family +
                         " model (" + kPeftPrefix + "<layer>.lora_A.weight)");
      a.tensors[ours] = w.read(name, at::kFloat);
      leaves.insert(leaf(split_adapter_name(ours).first));
    }
  } catch (const checkpoint::SafetensorsError& e) {
    throw UsageError("adapter " + weights.string() + ": " + e.what());
  }
  if (a.tensors.empty()) throw UsageError("adapter " + weights.string() + " holds no tensors");
  for (const auto& [name, t] : a.tensors) {
    const auto [layer, suffix] = split_adapter_name(name);
    const bool is_a = suffix == kSuffixes[0];
    const std::string other = layer + (is_a ? kSuffixes[1] : kSuffixes[0]);
    if (!a.tensors.count(other))
      throw UsageError("adapter " + weights.string() + ": " + peft_tensor_name(family, name) + " has no " +
                       peft_tensor_name(family, other));
    if (t.dim() != 2 || t.size(is_a ? 0 : 1) != s.r)
      throw UsageError("adapter " + weights.string() + ": " + peft_tensor_name(family, name) + " has shape " +
                       util::shape_text(t.sizes()) + ", not of rank r = " + std::to_string(s.r));
  }
  s.target_modules.assign(leaves.begin(), leaves.end());
  return a;
}

void check_adapter_fits(const Adapter& a, const models::CausalLM& model, const std::string& dir) {
  std::set<std::string> seen;
  const std::string family = model.config().family;
  for (const auto& item : model.named_parameters()) {
    if (!models::is_adapter_parameter(item.key())) continue;
    seen.insert(item.key());
    const auto it = a.tensors.find(item.key());
    if (it == a.tensors.end())
      throw UsageError("adapter " + dir + " has no " + peft_tensor_name(family, item.key()) + " (its layers are " +
                       c10::Join(", ", a.settings.target_modules) + ")");
    if (it->second.sizes() != item.value().sizes())
      throw UsageError("adapter " + dir + ": " + peft_tensor_name(family, item.key()) + " has shape " +
                       util::shape_text(it->second.sizes()) + ", the model's layer needs " +
                       util::shape_text(item.value().sizes()) + " (an adapter of a model of other shapes)");
  }
  for (const auto& [name, t] : a.tensors)
    if (!seen.count(name))
      throw UsageError("adapter " + dir + ": " + peft_tensor_name(family, name) +
                       " adapts a layer that this run does not (finetune.target_modules)");
}

int64_t export_adapter(const std::string& step_dir, const std::string& out_dir) {
  const checkpoint::Index x = checkpoint::read_index(step_dir);
  if (x.model.finetune.empty())
    throw UsageError("checkpoint " + step_dir + " trains every parameter (no adapters): export it without --adapter");
  const auto bad = checkpoint::verify_files(step_dir, x);
  if (!bad.empty())
    throw UsageError("corrupt checkpoint file " + bad.front() +
                     (bad.size() > 1 ? " (and " + std::to_string(bad.size() - 1) + " more)" : ""));
  const std::string source = (fs::path(step_dir) / "index.json").string();
  const AdapterSettings s = settings_from_json(json::parse(x.model.finetune), source + " model.finetune");
  const std::string family = recorded_model(x, step_dir).family;
  std::map<std::string, at::Tensor> tensors;
  at::ScalarType dtype = at::kFloat;
  for (const auto& [key, entry] : x.tensors) {
    if (key.rfind("model/", 0) != 0) continue;
    const std::string name = key.substr(6);
    if (!models::is_adapter_parameter(name))
      throw UsageError("checkpoint " + step_dir + " holds " + key + ", which is not an adapter");
    checkpoint::Dtype stored = checkpoint::Dtype::F32;
    if (!checkpoint::dtype_from_name(entry.dtype, &stored))
      throw UsageError("checkpoint " + step_dir + ": tensor " + key + " has unknown dtype " + entry.dtype);
    dtype = checkpoint::torch_dtype(stored, key);
    at::Tensor whole = at::empty(entry.shape, at::TensorOptions().dtype(dtype));
    checkpoint::read_tensors(step_dir, x, {{key, whole}});
    tensors[name] = whole;
  }
  if (tensors.empty()) throw UsageError("checkpoint " + step_dir + " holds no adapters");
  write_directory(out_dir, "checkpoint export --adapter",
                  [&](const std::string& tmp) { write_adapter_files(tmp, family, s, tensors, dtype); });
  return static_cast<int64_t>(tensors.size());
}

int64_t merge_adapter(const std::string& base_dir, const std::string& adapter_dir, const std::string& out_dir,
                      const std::string& dtype) {
  const at::ScalarType forced = dtype.empty() ? at::ScalarType::Undefined : parse_dtype(dtype);
  if (!fs::is_directory(base_dir)) throw UsageError("lora merge: base " + base_dir + " is not a Hub directory");
  const models::ModelConfig config = models::read_hf_config(base_dir);
  const Adapter a = read_adapter(adapter_dir, config.family);
  auto hub = std::make_shared<hub::HubWeights>(base_dir);
  const bool gpt2 = config.family == "gpt2";
  const double scaling = a.settings.scaling();

  // Hub weight name -> (A, B) of its layer; shapes checked before writing.
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> deltas;
  for (const auto& [name, t] : a.tensors) {
    const auto [layer, suffix] = split_adapter_name(name);
    if (suffix != kSuffixes[0]) continue;
    const at::Tensor& A = t;
    const at::Tensor& B = a.tensors.at(layer + kSuffixes[1]);
    const std::string w = hub_layer(config.family, layer) + ".weight";
    if (!hub->has(w))
      throw UsageError("lora merge: adapter " + adapter_dir + " adapts " + hub_layer(config.family, layer) +
                       ", which base " + base_dir + " has no weight for");
    std::vector<int64_t> want = {B.size(0), A.size(1)};  // [out, in]
    if (gpt2) std::swap(want[0], want[1]);               // Conv1D stores [in, out]
    const auto& have = hub->view(w).shape;
    if (have != want)
      throw UsageError("lora merge: adapter " + adapter_dir + " does not fit base " + base_dir + ": " + w + " is " +
                       util::shape_text(have) + ", the adapter's layer is " + util::shape_text(want));
    deltas[w] = {A, B};
  }

  std::vector<hub::HubTensor> tensors;
  for (const std::string& name : hub->names()) {
    const checkpoint::TensorView& v = hub->view(name);
    checkpoint::Dtype out = v.dtype;
    if (forced != at::ScalarType::Undefined) out = checkpoint::safetensors_dtype(forced, name);
    const at::ScalarType out_t = checkpoint::torch_dtype(out, name);
    auto it = deltas.find(name);
    std::function<at::Tensor()> read;
    if (it == deltas.end()) {
      read = [hub, name, out_t] { return hub->read(name, out_t).contiguous(); };
    } else {
      const at::Tensor A = it->second.first, B = it->second.second;
      read = [hub, name, out_t, A, B, scaling, gpt2] {
        at::Tensor delta = at::matmul(B.to(at::kDouble), A.to(at::kDouble)) * scaling;  // [out, in]
        if (gpt2) delta = delta.t();
        return (hub->read(name, at::kDouble) + delta).to(out_t).contiguous();
      };
    }
    tensors.push_back({name, out, v.shape, read});
  }
  write_directory(out_dir, "lora merge", [&](const std::string& tmp) {
    hub::write_hub_weights(tmp, tensors, hub::kDefaultMaxShardBytes);
    // The base's config and tokenizer files, as they are.
    for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json", "vocab.json", "merges.txt"}) {
      const fs::path from = fs::path(base_dir) / f;
      if (!fs::is_regular_file(from)) continue;
      std::error_code ec;
      fs::copy_file(from, fs::path(tmp) / f, ec);
      if (ec) throw UsageError("cannot copy " + from.string() + ": " + ec.message());
    }
  });
  return static_cast<int64_t>(deltas.size());
}

}  // namespace scaletrain::hub

#include "scaletrain/hub/hf_gpt2.h"

#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "scaletrain/hub/hub_read.h"
#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"
#include "scaletrain/util/strings.h"

namespace scaletrain::hub {

using checkpoint::Dtype;
using checkpoint::dtype_name;
using hub::HubWeights;
using checkpoint::save_safetensors;
using checkpoint::tensor_from_view;
using checkpoint::TensorView;
namespace {

constexpr const char* kGpt2Prefix = "transformer.";

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw UsageError("hf gpt2 " + path + ": " + problem);
}

// Conv1D weights, stored [in, out] by HF (Note [HF GPT-2 names]).
bool is_conv1d_weight(const std::string& name) {
  return util::ends_with(name, ".attn.c_attn.weight") || util::ends_with(name, ".attn.c_proj.weight") ||
         util::ends_with(name, ".mlp.c_fc.weight") || util::ends_with(name, ".mlp.c_proj.weight");
}

// The name without "transformer.".
std::string bare(const std::string& name) { return name.compare(0, 12, kGpt2Prefix) == 0 ? name.substr(12) : name; }

// If `name` (bare) is "h.N.<rest>", stores N and rest and returns true.
bool block_index(const std::string& name, int64_t* n, std::string* rest) {
  if (name.compare(0, 2, "h.") != 0) return false;
  std::size_t i = 2;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
  if (i == 2 || i - 2 > 9 || i >= name.size() || name[i] != '.') return false;
  *n = std::stoll(name.substr(2, i - 2));
  *rest = name.substr(i + 1);
  return true;
}

// HF's causal-mask buffers, which carry no weights.
bool is_mask_buffer(const std::string& bare_name) {
  int64_t n = 0;
  std::string rest;
  return block_index(bare_name, &n, &rest) && (rest == "attn.bias" || rest == "attn.masked_bias");
}

bool is_float(Dtype d) { return d == Dtype::F64 || d == Dtype::F32 || d == Dtype::F16 || d == Dtype::BF16; }

// The file's tensors by bare name, without mask buffers; lm_head separately.
struct HfTensors {
  std::map<std::string, const TensorView*> by_name;
  const TensorView* lm_head = nullptr;
};

HfTensors index_file(const HubWeights& file) {
  HfTensors out;
  for (const std::string& key : file.names()) {
    const TensorView& t = file.view(key);
    const std::string name = bare(t.name);
    if (is_mask_buffer(name)) continue;
    if (name == "lm_head.weight") {
      out.lm_head = &t;
      continue;
    }
    if (!out.by_name.emplace(name, &t).second) {
      fail(file.source(), "tensor '" + t.name + "' appears twice (with and without the \"transformer.\" prefix)");
    }
  }
  return out;
}

}  // namespace

std::string hf_gpt2_name(const std::string& name) { return kGpt2Prefix + name; }

at::Tensor hf_gpt2_tensor(const std::string& name, const at::Tensor& value) {
  return is_conv1d_weight(name) ? value.detach().t() : value.detach();
}

void check_hf_gpt2_exportable(const models::ModelConfig& config, const std::string& path) {
  if (!config.bias) fail(path, "HF GPT-2 has biases in every layer; a model with bias=false cannot be exported");
}

void export_hf_gpt2(const models::GPT& model, const std::string& path) {
  check_hf_gpt2_exportable(model->config(), path);
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : model->named_parameters())
    tensors.emplace_back(hf_gpt2_name(item.key()), hf_gpt2_tensor(item.key(), item.value()).to(at::kFloat));
  save_safetensors(path, tensors, {{"format", "pt"}});
}

namespace {

// Checks every tensor of the file against `model`'s parameters (by shape
// only: a deferred model has no bytes yet) before any is read.
void check_file(const models::GPT& model, const HfTensors& hf, const std::string& path) {
  if (!model->config().bias) fail(path, "HF GPT-2 has biases in every layer; a model with bias=false cannot load it");
  const auto params = model->named_parameters();

  // Check everything first, so that a bad file leaves the model untouched.
  std::set<std::string> expected;
  for (const auto& item : params) {
    const std::string& name = item.key();
    expected.insert(name);
    const auto it = hf.by_name.find(name);
    if (it == hf.by_name.end()) {
      fail(path, "missing tensor '" + std::string(kGpt2Prefix) + name + "' (or '" + name + "')");
    }
    const TensorView& t = *it->second;
    std::vector<int64_t> want = item.value().sizes().vec();
    if (is_conv1d_weight(name)) std::swap(want[0], want[1]);
    // A longer position table serves a shorter block_size: its first rows are loaded.
    const bool longer_wpe =
        name == "wpe.weight" && t.shape.size() == 2 && t.shape[0] > want[0] && t.shape[1] == want[1];
    if (t.shape != want && !longer_wpe) {
      const auto& c = model->config();
      fail(path, "tensor '" + t.name + "' has shape " + util::shape_text(t.shape) + ", expected " +
                     util::shape_text(want) + " (vocab_size=" + std::to_string(c.vocab_size) +
                     ", block_size=" + std::to_string(c.block_size) + ", n_embd=" + std::to_string(c.n_embd) + ")");
    }
    if (!is_float(t.dtype)) fail(path, "tensor '" + t.name + "' has dtype " + dtype_name(t.dtype) + ", not a float");
  }
  for (const auto& [name, t] : hf.by_name) {
    if (!expected.count(name)) {
      fail(path, "unexpected tensor '" + t->name +
                     "' (not a parameter of a GPT with n_layer=" + std::to_string(model->config().n_layer) + ")");
    }
  }
  if (hf.lm_head) {
    const TensorView& wte = *hf.by_name.at("wte.weight");
    if (hf.lm_head->shape != wte.shape || hf.lm_head->dtype != wte.dtype ||
        !tensor_from_view(*hf.lm_head, path).equal(tensor_from_view(wte, path))) {
      fail(path, "tensor '" + hf.lm_head->name + "' differs from '" + wte.name + "'; this model ties its head to wte");
    }
  }
}

// The file's value of parameter `name`, shaped like ours (Conv1D transposed,
// the position table cut to `rows`).
at::Tensor read_param(const HfTensors& hf, const std::string& name, int64_t rows, const std::string& path) {
  at::Tensor src = tensor_from_view(*hf.by_name.at(name), path);
  if (is_conv1d_weight(name)) src = src.t();
  if (name == "wpe.weight") src = src.narrow(0, 0, rows);
  return src;
}

}  // namespace

void import_hf_gpt2(models::GPT& model, const std::string& path) {
  const HubWeights file(path);
  const HfTensors hf = index_file(file);
  check_file(model, hf, path);
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    // copy_ converts dtype and device, and copies the transpose's strides.
    item.value().copy_(read_param(hf, item.key(), item.value().size(0), path));
  }
}

interfaces::InitFn hf_gpt2_init(const models::GPT& model, const std::string& path) {
  auto file = std::make_shared<const HubWeights>(path);
  auto hf = std::make_shared<const HfTensors>(index_file(*file));
  check_file(model, *hf, path);
  return [file, hf, path](const std::string& name, at::Tensor& out) {
    torch::NoGradGuard no_grad;
    out.copy_(read_param(*hf, name, out.size(0), path));
  };
}

models::GPTConfig hf_gpt2_config(const std::string& path, int64_t n_head) {
  const HubWeights file(path);
  const HfTensors hf = index_file(file);
  auto shape_of = [&](const std::string& name) -> const std::vector<int64_t>& {
    const auto it = hf.by_name.find(name);
    if (it == hf.by_name.end())
      fail(path, "missing tensor '" + std::string(kGpt2Prefix) + name + "' (or '" + name + "')");
    if (it->second->shape.size() != 2) {
      fail(path,
           "tensor '" + it->second->name + "' has shape " + util::shape_text(it->second->shape) + ", expected 2-D");
    }
    return it->second->shape;
  };
  const auto& wte = shape_of("wte.weight");
  const auto& wpe = shape_of("wpe.weight");
  if (wte[1] != wpe[1]) {
    fail(path,
         "wte.weight width " + std::to_string(wte[1]) + " differs from wpe.weight width " + std::to_string(wpe[1]));
  }
  std::set<int64_t> blocks;
  for (const auto& [name, t] : hf.by_name) {
    int64_t n = 0;
    std::string rest;
    if (block_index(name, &n, &rest)) blocks.insert(n);
  }
  if (blocks.empty()) fail(path, "no transformer blocks (no tensor named h.N.*)");
  const int64_t n_layer = *blocks.rbegin() + 1;
  if (static_cast<int64_t>(blocks.size()) != n_layer) {
    for (int64_t i = 0; i < n_layer; ++i) {
      if (!blocks.count(i))
        fail(path, "block h." + std::to_string(i) + " is missing but h." + std::to_string(n_layer - 1) + " exists");
    }
  }
  models::GPTConfig c;
  c.vocab_size = wte[0];
  c.n_embd = wte[1];
  c.block_size = wpe[0];
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.dropout = 0.0;
  c.bias = hf.by_name.count("h.0.attn.c_attn.bias") > 0;
  if (n_head > 0) c.validate();  // 0: the head count is still unknown
  return c;
}

models::GPTConfig hf_gpt2_file_config(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path json_path = (fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path()) / "config.json";
  if (!fs::exists(json_path)) return hf_gpt2_config(path, 0);
  const std::string where = "hf gpt2 " + json_path.string() + ": ";
  const nlohmann::json j = util::read_json_file(json_path.string(), "hf gpt2 " + json_path.string());
  if (!j.is_object()) throw UsageError(where + "the top level must be an object");
  auto integer = [&](const char* key) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) return 0;
    if (!j[key].is_number_integer()) throw UsageError(where + key + " must be an integer, got " + j[key].dump());
    return j[key].get<int64_t>();
  };
  const int64_t n_head = integer("n_head");
  if (j.contains("n_head") && n_head < 1) throw UsageError(where + "n_head must be positive");
  models::GPTConfig c = hf_gpt2_config(path, n_head);
  // Each dimension config.json states must be the one the weights have.
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"n_layer", c.n_layer},
                                   {"n_embd", c.n_embd},
                                   {"n_positions", c.block_size},
                                   {"vocab_size", c.vocab_size}}) {
    const int64_t v = integer(key);
    if (j.contains(key) && v != value)
      throw UsageError(where + key + "=" + std::to_string(v) + " disagrees with the weights in " + path + " (" +
                       std::to_string(value) + ")");
  }
  if (j.contains("model_type") && j["model_type"] != "gpt2")
    throw UsageError(where + "model_type " + j["model_type"].dump() + " is not gpt2");
  if (j.contains("layer_norm_epsilon") && j["layer_norm_epsilon"].is_number() &&
      std::fabs(j["layer_norm_epsilon"].get<double>() - 1e-5) > 1e-12)
    throw UsageError(where + "layer_norm_epsilon=" + j["layer_norm_epsilon"].dump() +
                     " is not supported (this GPT-2 uses 1e-5)");
  if (j.contains("activation_function") && j["activation_function"] != "gelu_new" &&
      j["activation_function"] != "gelu_pytorch_tanh")
    throw UsageError(where + "activation_function " + j["activation_function"].dump() +
                     " is not supported (this GPT-2 uses the tanh GELU, gelu_new)");
  if (const int64_t inner = integer("n_inner"); inner != 0 && inner != 4 * c.n_embd)
    throw UsageError(where + "n_inner=" + std::to_string(inner) + " is not supported (this GPT-2 uses 4 x n_embd)");
  return c;
}

}  // namespace scaletrain::hub

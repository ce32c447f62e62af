#include "scaletrain/hub/hub_export.h"

#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/util/error.h"

namespace scaletrain::hub {
namespace {

namespace fs = std::filesystem;
using checkpoint::Dtype;

Dtype asked_dtype(const std::string& s) {
  if (s == "fp32" || s == "float32") return Dtype::F32;
  if (s == "bf16" || s == "bfloat16") return Dtype::BF16;
  if (s == "fp16" || s == "float16") return Dtype::F16;
  throw UsageError("--dtype " + s + " is not one of fp32, bf16, fp16");
}

const char* torch_dtype_name(Dtype d) {
  switch (d) {
    case Dtype::BF16: return "bfloat16";
    case Dtype::F16: return "float16";
    case Dtype::F64: return "float64";
    default: return "float32";
  }
}

// OUT_DIR may not exist, or be an empty directory.
void check_out_dir(const fs::path& out) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (!fs::is_directory(out, ec) || !fs::is_empty(out, ec))
    throw UsageError("output " + out.string() + " exists and is not an empty directory; not overwriting it");
}

void copy_asset(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) throw UsageError("cannot copy " + from.string() + " to " + to.string() + ": " + ec.message());
}

// Everything but the final rename, into `tmp`.
HubExportResult write_export(const std::string& dir, const checkpoint::Index& x, const fs::path& tmp,
                             const HubExportOptions& o) {
  const models::ModelConfig config = recorded_model(x, dir);
  const bool gpt2 = config.family == "gpt2";
  if (gpt2) hub::check_hf_gpt2_exportable(config, dir);
  const bool convert = !o.dtype.empty();
  const Dtype to = convert ? asked_dtype(o.dtype) : Dtype::F32;

  // The parameters, names and shapes only: no bytes (Note [Hub export]).
  const models::ModelPtr model = models::make_model(config, /*materialize=*/false);
  std::vector<hub::HubTensor> tensors;
  std::set<std::string> params;
  Dtype written = to;
  for (const auto& item : model->named_parameters()) {
    const std::string name = item.key();
    const std::string key = "model/" + name;
    params.insert(key);
    const auto it = x.tensors.find(key);
    if (it == x.tensors.end())
      throw UsageError("checkpoint " + dir + " has no tensor " + key + " (its index records a model that has it)");
    const std::vector<int64_t> shape = item.value().sizes().vec();
    if (it->second.shape != shape)
      throw UsageError("checkpoint " + dir + ": tensor " + key + " has shape " + c10::str(it->second.shape) +
                       ", the recorded model's is " + c10::str(shape));
    Dtype stored = Dtype::F32;
    if (!checkpoint::dtype_from_name(it->second.dtype, &stored))
      throw UsageError("checkpoint " + dir + ": tensor " + key + " has unknown dtype " + it->second.dtype);
    const Dtype out = convert ? to : stored;
    if (tensors.empty()) written = out;
    // The Hub file's shape: a view of a tensor of ours (gpt2's Conv1D weights transposed).
    const at::Tensor probe = at::empty(shape, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
    const at::Tensor hf_probe = gpt2 ? hub::hf_gpt2_tensor(name, probe) : probe;
    auto read = [dir, &x, key, name, shape, stored, out, gpt2]() {
      at::Tensor whole = at::empty(shape, at::TensorOptions().dtype(checkpoint::torch_dtype(stored, key)));
      checkpoint::read_tensors(dir, x, {{key, whole}});
      const at::Tensor hf = gpt2 ? hub::hf_gpt2_tensor(name, whole) : whole;
      return hf.to(checkpoint::torch_dtype(out, key)).contiguous();
    };
    tensors.push_back({gpt2 ? hub::hf_gpt2_name(name) : name, out, hf_probe.sizes().vec(), read});
  }
  for (const auto& [key, t] : x.tensors)
    if (key.rfind("model/", 0) == 0 && !params.count(key))
      throw UsageError("checkpoint " + dir + " holds " + key + ", which the model its index records has not");

  HubExportResult r;
  r.files = hub::write_hub_weights(tmp.string(), tensors, o.max_shard_bytes);
  r.tensors = static_cast<int64_t>(tensors.size());
  for (const auto& t : tensors) r.total_bytes += t.nbytes();
  r.dtype = checkpoint::dtype_name(written);

  nlohmann::json cj = models::config_to_hf(config);
  cj["torch_dtype"] = torch_dtype_name(written);
  checkpoint::write_file_durably((tmp / "config.json").string(), cj.dump(2) + "\n");
  r.files.push_back("config.json");
  // The tokenizer files the run had (Note [Checkpoint assets]).
  for (const auto& f : x.files) {
    if (f.name.rfind("tokenizer/", 0) != 0) continue;
    const std::string base = fs::path(f.name).filename().string();
    copy_asset(fs::path(dir) / f.name, tmp / base);
    r.files.push_back(base);
  }
  return r;
}

}  // namespace

// The model the index records (Note [Hub export]).
models::ModelConfig recorded_model(const checkpoint::Index& x, const std::string& dir) {
  const std::string source = (fs::path(dir) / "index.json").string() + " model.hf_config";
  if (!x.model.hf_config.empty())
    return models::config_from_hf(nlohmann::json::parse(x.model.hf_config), source);
  const std::string family = models::recorded_family(x.model.family);
  if (family != "gpt2")
    throw UsageError("checkpoint " + dir + " does not record its " + family +
                     " model's config (an index from before model.hf_config); it cannot be exported");
  models::ModelConfig c;  // an older GPT-2 index: its dimensions are the whole model
  c.vocab_size = x.model.vocab_size;
  c.block_size = x.model.block_size;
  c.n_layer = x.model.n_layer;
  c.n_head = x.model.n_head;
  c.n_embd = x.model.n_embd;
  c.bias = x.model.bias;
  c.validate();
  return c;
}

void write_directory(const std::string& out_dir, const std::string& what,
                     const std::function<void(const std::string& tmp)>& fill) {
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "out/" names "out"
  if (out.empty()) throw UsageError(what + ": no output directory given");
  check_out_dir(out);
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const fs::path tmp = parent / ("." + out.filename().string() + ".export-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::create_directories(parent, ec);
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) || ec)
    throw UsageError("cannot create " + tmp.string() + ": " + (ec ? ec.message() : "it exists"));
  try {
    fill(tmp.string());
    if (fs::exists(out)) fs::remove(out);  // the empty directory check_out_dir allowed
    fs::rename(tmp, out);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw UsageError("cannot write " + out.string() + ": " + e.code().message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

HubExportResult export_hub(const std::string& step_dir, const std::string& out_dir, const HubExportOptions& options) {
  if (!options.dtype.empty()) asked_dtype(options.dtype);  // a bad flag before any reading
  if (options.max_shard_bytes < 1) throw UsageError("--max-shard-size must be at least one byte");
  const checkpoint::Index x = checkpoint::read_index(step_dir);
  {
    fs::path out = fs::path(out_dir).lexically_normal();
    if (!out.empty()) check_out_dir(out.filename().empty() ? out.parent_path() : out);  // before reading the files
  }
  if (!x.model.finetune.empty())
    throw UsageError("checkpoint " + step_dir +
                     " holds adapters only (a finetune run): export them with --adapter, or merge them into "
                     "the base with `scaletrain lora merge`");
  const auto bad = checkpoint::verify_files(step_dir, x);
  if (!bad.empty())
    throw UsageError("corrupt checkpoint file " + bad.front() +
                     (bad.size() > 1 ? " (and " + std::to_string(bad.size() - 1) + " more)" : ""));
  HubExportResult r;
  write_directory(out_dir, "checkpoint export", [&](const std::string& tmp) { r = write_export(step_dir, x, tmp, options); });
  return r;
}

}  // namespace scaletrain::hub

// `scaletrain checkpoint inspect|consolidate|export|convert`.
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_read.h"
#include "scaletrain/hub/hub_write.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/checkpoint/torch_file.h"
#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/hub/hub_export.h"
#include "scaletrain/hub/peft_adapter.h"
#include "scaletrain/util/error.h"

namespace scaletrain::cli {
namespace {

namespace fs = std::filesystem;

// DIR is a step directory, or a root whose newest complete checkpoint is meant.
std::string resolve(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "index.json")) return dir;
  if (auto newest = checkpoint::newest_checkpoint(dir)) return *newest;
  throw UsageError("checkpoint " + dir + " has no index.json and holds no complete checkpoint");
}

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int inspect(const std::string& arg) {
  const std::string dir = resolve(arg);
  const checkpoint::Index x = checkpoint::read_index(dir);
  const auto& m = x.model;
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  format version %d, step %lld, world size %d, strategy %s, mesh %s\n", x.version,
              static_cast<long long>(x.step), x.world_size, x.strategy.c_str(), x.mesh.c_str());
  std::printf("  model: vocab %lld, block %lld, %lld layers, %lld heads, width %lld%s\n",
              static_cast<long long>(m.vocab_size), static_cast<long long>(m.block_size),
              static_cast<long long>(m.n_layer), static_cast<long long>(m.n_head), static_cast<long long>(m.n_embd),
              m.bias ? "" : ", no bias");
  std::printf(
      "  state: optimizer steps %lld, loss scaler %s, cpu rng %s\n", static_cast<long long>(x.state.optimizer_steps),
      x.state.loss_scaler.empty() ? "none" : ("scale " + std::to_string(x.state.loss_scaler.at("scale"))).c_str(),
      x.state.rng_cpu.empty() ? "none" : "saved");
  int64_t total = 0;
  for (const auto& f : x.files) total += f.bytes;
  std::printf("  files: %zu, %s\n", x.files.size(), human(static_cast<double>(total)).c_str());
  const auto bad = checkpoint::verify_files(dir, x);
  for (const auto& f : x.files) {
    const std::string path = (fs::path(dir) / f.name).string();
    bool ok = true;
    for (const auto& b : bad) ok = ok && b.rfind(path + ":", 0) != 0;
    std::printf("    %-26s rank %-4d %10s  crc32 %08x  %s\n", f.name.c_str(), f.rank,
                human(static_cast<double>(f.bytes)).c_str(), f.crc32, ok ? "ok" : "BAD");
  }
  if (!x.model.finetune.empty()) std::printf("  adapters only: %s\n", x.model.finetune.c_str());
  std::printf("  tensors: %zu\n", x.tensors.size());
  for (const auto& [name, t] : x.tensors) {
    checkpoint::Dtype dt = checkpoint::Dtype::F32;
    checkpoint::dtype_from_name(t.dtype, &dt);
    const double bytes = static_cast<double>(t.numel()) * static_cast<double>(checkpoint::dtype_size(dt));
    std::printf("    %-44s %-18s %s %10s  %zu piece%s\n", name.c_str(), shape_str(t.shape).c_str(), t.dtype.c_str(),
                human(bytes).c_str(), t.pieces.size(), t.pieces.size() == 1 ? "" : "s");
  }
  if (bad.empty()) {
    std::printf("  checksums: all %zu files ok\n", x.files.size());
    return 0;
  }
  std::printf("  checksums: %zu of %zu files bad\n", bad.size(), x.files.size());
  std::fflush(stdout);
  // A corrupt checkpoint is bad input: one line, exit 2 (the table above names every bad file).
  throw UsageError("checkpoint " + dir + ": " + std::to_string(bad.size()) + " of " +
                   std::to_string(x.files.size()) + " files bad; corrupt checkpoint file " + bad.front());
}

int consolidate(const std::string& arg, const std::string& out) {
  const std::string dir = resolve(arg);
  const checkpoint::Index x = checkpoint::read_index(dir);
  if (!x.model.finetune.empty())
    throw UsageError("checkpoint " + dir + " holds adapters only (a finetune run): export them with `checkpoint "
                     "export --adapter`, or merge them into the base with `scaletrain lora merge`");
  if (models::recorded_family(x.model.family) != "gpt2")
    throw UsageError("checkpoint consolidate writes GPT-2 files; " + dir + " holds a model of family " +
                     x.model.family);
  models::GPT model(hub::recorded_model(x, dir));  // fp32; every parameter is overwritten below
  std::vector<std::pair<std::string, at::Tensor>> outs;
  for (auto& item : model->named_parameters()) outs.emplace_back("model/" + item.key(), item.value());
  checkpoint::read_tensors(dir, x, outs);
  hub::export_hf_gpt2(model, out);
  std::printf("wrote %s: %zu tensors of step %lld (Hugging Face GPT-2 layout)\n", out.c_str(), outs.size(),
              static_cast<long long>(x.step));
  return 0;
}

int export_dir(const std::string& arg, const std::string& out, const std::string& max_shard_size,
               const std::string& dtype) {
  hub::HubExportOptions o;
  o.max_shard_bytes = hub::parse_shard_size(max_shard_size);  // a bad size before anything is read
  o.dtype = dtype;
  const std::string dir = resolve(arg);
  const hub::HubExportResult r = hub::export_hub(dir, out, o);
  std::string files;
  for (const auto& f : r.files) files += (files.empty() ? "" : ", ") + f;
  std::printf("wrote %s: %lld tensors, %s in %s (Hugging Face Hub layout): %s\n", out.c_str(),
              static_cast<long long>(r.tensors), human(static_cast<double>(r.total_bytes)).c_str(), r.dtype.c_str(),
              files.c_str());
  return 0;
}

// A Hub directory of .bin files as one of safetensors shards, with every
// other file (config.json, tokenizer files) copied.
int convert_dir(const std::string& in, const std::string& out, int64_t max_shard_bytes) {
  if (fs::exists(fs::path(in) / "model.safetensors") || fs::exists(fs::path(in) / "model.safetensors.index.json"))
    throw UsageError(in + " already holds safetensors weights");
  if (fs::exists(out) && !(fs::is_directory(out) && fs::is_empty(out)))
    throw UsageError("-o " + out + ": exists and is not an empty directory");
  const hub::HubWeights w(in);
  std::vector<hub::HubTensor> tensors;
  for (const std::string& name : w.names()) {
    const checkpoint::TensorView& v = w.view(name);
    tensors.push_back({name, v.dtype, v.shape, [&w, name] { return checkpoint::tensor_from_view(w.view(name), w.source()); }});
  }
  fs::create_directories(out);
  const std::vector<std::string> files = hub::write_hub_weights(out, tensors, max_shard_bytes);
  int copied = 0;
  for (const auto& e : fs::directory_iterator(in)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || e.path().extension() == ".bin" || name == "pytorch_model.bin.index.json") continue;
    fs::copy_file(e.path(), fs::path(out) / name);
    ++copied;
  }
  std::printf("wrote %s: %zu tensors in %zu safetensors file(s), %d other file(s) copied\n", out.c_str(),
              tensors.size(), files.size(), copied);
  return 0;
}

// A torch.save file (a state dict, or one under `key`) as one safetensors file.
int convert(const std::string& in, const std::string& out, const std::string& key, const std::string& size,
            bool sized) {
  const int64_t max_shard_bytes = hub::parse_shard_size(size);
  if (sized && !fs::is_directory(in))
    throw UsageError("--max-shard-size cuts a directory's shards; " + in + " converts to one file");
  if (fs::is_directory(in)) {
    if (!key.empty()) throw UsageError("--key picks an entry of one file; " + in + " is a directory");
    return convert_dir(in, out, max_shard_bytes);
  }
  if (fs::path(out).extension() != ".safetensors")
    throw UsageError("-o " + out + ": a PyTorch file converts to one .safetensors file");
  const checkpoint::NamedTensors tensors = checkpoint::read_torch_state_dict(in, key);
  try {
    checkpoint::save_safetensors(out, tensors, {{"format", "pt"}});
  } catch (const checkpoint::SafetensorsError& e) {
    throw UsageError(e.what());
  }
  std::printf("wrote %s: %zu tensors\n", out.c_str(), tensors.size());
  return 0;
}

}  // namespace

void add_checkpoint(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("checkpoint", "inspect, consolidate or export sharded checkpoints; convert "
                                               "PyTorch files");
  cmd->require_subcommand(1);
  auto dir = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto* ins = cmd->add_subcommand("inspect", "layout, step, tensors, sizes and checksum status of a checkpoint");
  ins->add_option("dir", *dir, "step directory (or a checkpoint root: its newest complete checkpoint)")->required();
  ins->callback([&run, dir] { run = [dir] { return inspect(*dir); }; });
  auto* con = cmd->add_subcommand("consolidate", "write the full model as one Hugging Face GPT-2 safetensors file");
  con->add_option("dir", *dir, "step directory (or a checkpoint root: its newest complete checkpoint)")->required();
  con->add_option("-o,--output", *out, "output file (model.safetensors)")->required();
  con->callback([&run, dir, out] { run = [dir, out] { return consolidate(*dir, *out); }; });
  auto size = std::make_shared<std::string>("5GB");
  auto dtype = std::make_shared<std::string>();
  auto* exp = cmd->add_subcommand("export", "write the model as a Hugging Face Hub directory (config.json, "
                                            "safetensors shards, tokenizer files)");
  exp->add_option("dir", *dir, "step directory (or a checkpoint root: its newest complete checkpoint)")->required();
  exp->add_option("-o,--output", *out, "output directory (must not exist, or be empty)")->required();
  exp->add_option("--max-shard-size", *size, "largest shard: 5GB (default), 500MB, 2GiB, or bytes");
  exp->add_option("--dtype", *dtype, "fp32 | bf16 | fp16 (default: the checkpoint's parameter dtype)");
  auto adapter = std::make_shared<bool>(false);
  exp->add_flag("--adapter", *adapter,
                "a finetune checkpoint's adapters as a PEFT directory (adapter_config.json, "
                "adapter_model.safetensors)");
  exp->callback([&run, dir, out, size, dtype, adapter, exp] {
    const bool sized = exp->count("--dtype") + exp->count("--max-shard-size") > 0;
    run = [dir, out, size, dtype, adapter, sized] {
      if (!*adapter) return export_dir(*dir, *out, *size, *dtype);
      if (sized) throw UsageError("--adapter writes the adapters as stored, in one file: no --dtype or --max-shard-size");
      const int64_t n = hub::export_adapter(resolve(*dir), *out);
      std::printf("wrote %s: %lld adapter tensors (PEFT layout): adapter_model.safetensors, adapter_config.json\n",
                  out->c_str(), static_cast<long long>(n));
      return 0;
    };
  });
  auto key = std::make_shared<std::string>();
  auto* conv = cmd->add_subcommand("convert", "a torch.save file (model.pt, pytorch_model.bin) as safetensors, or a "
                                              "Hub directory of .bin files as one of safetensors shards");
  conv->add_option("input", *dir, "a PyTorch file, or a directory with pytorch_model.bin[.index.json]")->required();
  conv->add_option("-o,--output", *out, "FILE.safetensors, or a new directory")->required();
  conv->add_option("--key", *key, "the state dict's key in the saved dict (e.g. model, state_dict)");
  conv->add_option("--max-shard-size", *size, "a directory's largest shard: 5GB (default), 500MB, 2GiB, or bytes");
  conv->callback([&run, dir, out, key, size, conv] {
    const bool sized = conv->count("--max-shard-size") > 0;
    run = [dir, out, key, size, sized] { return convert(*dir, *out, *key, *size, sized); };
  });
}

}  // namespace scaletrain::cli

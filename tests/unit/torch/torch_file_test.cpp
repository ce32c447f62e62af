// PyTorch's torch.save files (checkpoint/torch_file.h): what Python's torch
// writes is read bit for bit, what we write Python's torch reads, and every
// hostile file of tests/reference/torch_files.py is refused by name with
// nothing executed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "scaletrain/hub/hub_read.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/checkpoint/torch_file.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/models/llama.h"
#include "scaletrain/util/error.h"
#include "cli_util.h"

namespace scaletrain::test {
namespace torch_file_test {

namespace fs = std::filesystem;
using namespace scaletrain::checkpoint;

bool have_python_torch() { return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0; }

std::string reference(const std::string& args) {
  return std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/torch_files.py " + args;
}

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("st_torch_file_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// The same dtype, shape and bytes.
void expect_bitwise(const std::string& name, const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << name;
  ASSERT_EQ(got.sizes(), want.sizes()) << name;
  ASSERT_TRUE(got.is_contiguous()) << name;
  const at::Tensor w = want.contiguous();
  EXPECT_EQ(std::memcmp(got.data_ptr(), w.data_ptr(), got.nbytes()), 0) << name;
}

fs::path python_files() {
  static const fs::path dir = [] {
    const fs::path d = scratch("python");
    const std::string cmd = reference("write " + d.string());
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    return d;
  }();
  return dir;
}

#define REQUIRE_PYTHON() \
  if (!have_python_torch()) GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed"

TEST(TorchFile, ReadsEveryDtypeViewAndSharedStorageAsPythonSavedThem) {
  REQUIRE_PYTHON();
  const fs::path d = python_files();
  const NamedTensors got = read_torch_state_dict((d / "state.pt").string());
  const TensorMap want = load_safetensors((d / "state.safetensors").string());
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : got) expect_bitwise(name, t, want.at(name));
  // The file's order is the state dict's; a parameter keeps its flag.
  EXPECT_EQ(got.front().first, "f32");
  const TorchFile f((d / "state.pt").string());
  EXPECT_TRUE(f.root().get("param")->tensor->parameter);
  EXPECT_TRUE(f.root().get("param")->tensor->requires_grad);
  EXPECT_EQ(f.root().get("view")->tensor->storage, f.root().get("base")->tensor->storage);
}

TEST(TorchFile, ReadsAnOptimizerStateAndPlainValues) {
  REQUIRE_PYTHON();
  const fs::path d = python_files();
  const TorchFile f((d / "training.pt").string());
  const TensorMap want = load_safetensors((d / "training.safetensors").string());
  for (const auto& [name, t] : state_dict_tensors(f, "model")) expect_bitwise(name, t, want.at("model." + name));
  const PyObject* optim = f.root().get("optim");
  ASSERT_TRUE(optim);
  const PyObject* state = optim->get("state");
  ASSERT_EQ(state->entries.size(), 6u);
  for (int64_t i = 0; i < 6; ++i)
    for (const char* k : {"exp_avg", "exp_avg_sq", "step"})
      expect_bitwise(k, f.tensor(*state->get(i)->get(k)->tensor),
                     want.at("optim.state." + std::to_string(i) + "." + k));
  const PyObject& group = *optim->get("param_groups")->items.at(0);
  EXPECT_EQ(group.get("lr")->real, 1e-2);
  EXPECT_EQ(group.get("betas")->items.at(1)->real, 0.95);
  EXPECT_EQ(group.get("params")->items.size(), 6u);
  EXPECT_EQ(f.root().get("step")->integer, 3);
}

TEST(TorchFile, RefusesEveryHostileFileByNameAndRunsNothing) {
  REQUIRE_PYTHON();
  const fs::path d = scratch("hostile");
  const fs::path marker = d / "MARKER";
  const std::string cmd = reference("malicious " + (d / "files").string() + " " + marker.string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(d / "files" / "manifest.json");
  const auto manifest = nlohmann::json::parse(in);
  ASSERT_GE(manifest.size(), 15u);
  for (const auto& entry : manifest) {
    const std::string path = (d / "files" / entry.at("file").get<std::string>()).string();
    try {
      const TorchFile f(path);
      state_dict_tensors(f);
      ADD_FAILURE() << path << " was accepted";
    } catch (const TorchFileError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(entry.at("expect").get<std::string>()), std::string::npos) << msg;
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  EXPECT_FALSE(fs::exists(marker));
  // The same hand-made archive with a plain state dict is read: the refusals
  // above are for what each file holds, not for how it was made.
  EXPECT_EQ(read_torch_state_dict((d / "files" / "control.pt").string()).size(), 1u);
}

TEST(TorchFile, NamesALegacyFile) {
  REQUIRE_PYTHON();
  try {
    TorchFile((python_files() / "legacy.pt").string());
    ADD_FAILURE() << "accepted";
  } catch (const TorchFileError& e) {
    EXPECT_NE(std::string(e.what()).find("legacy"), std::string::npos) << e.what();
  }
}

TEST(TorchFile, PythonReadsWhatWeWrite) {
  REQUIRE_PYTHON();
  const fs::path d = python_files();
  const fs::path out = scratch("ours") / "state.pt";
  save_torch_state_dict(out.string(), read_torch_state_dict((d / "state.pt").string()));
  const std::string cmd = reference("check " + out.string() + " " + (d / "state.safetensors").string() + " > /dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  // And we read it back as written.
  const TensorMap want = load_safetensors((d / "state.safetensors").string());
  for (const auto& [name, t] : read_torch_state_dict(out.string())) expect_bitwise(name, t, want.at(name));
}

TEST(TorchFile, LoadsIntoAUserModuleByName) {
  REQUIRE_PYTHON();
  const fs::path d = python_files();
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                            torch::nn::Linear(8, 2));
  load_state_dict(*net, read_torch_state_dict((d / "model.pt").string()));
  const TensorMap want = load_safetensors((d / "model.safetensors").string());
  for (const auto& p : net->named_parameters()) expect_bitwise(p.key(), p.value().detach(), want.at(p.key()));
  // Every mismatch is named at once, and nothing is written.
  torch::nn::Sequential other(torch::nn::Linear(4, 8), torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                              torch::nn::Linear(8, 3), torch::nn::Linear(3, 3));
  const at::Tensor before = other->named_parameters()["0.weight"].clone();
  try {
    load_state_dict(*other, read_torch_state_dict((d / "model.pt").string()));
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'2.weight' is [2, 8] in the file, [3, 8] in the module"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing '3.weight'"), std::string::npos) << msg;
  }
  EXPECT_TRUE(torch::equal(before, other->named_parameters()["0.weight"]));
}

// A Hub directory with only .bin files (as transformers wrote before
// safetensors), made by Python's torch.save from a safetensors directory,
// gives the model the same weights.
TEST(TorchFile, HubDirectoryOfBinFilesLoadsLikeItsSafetensors) {
  REQUIRE_PYTHON();
  const fs::path d = scratch("hub");
  const std::string py = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/";
  std::string cmd = py + "hub_checkpoint.py write " + (d / "st").string() +
                    " --arch llama --dtype bfloat16 --max-shard-size 60000 --seed 3 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& [out, shards] : {std::pair<std::string, int>{"bin", 1}, {"bins", 3}}) {
    cmd = reference("hubbin " + (d / "st").string() + " " + (d / out).string() + " --shards " + std::to_string(shards));
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const hub::HubWeights st((d / "st").string()), bin((d / out).string());
    ASSERT_EQ(st.names(), bin.names());
    for (const std::string& name : st.names())
      expect_bitwise(name, bin.read(name, torch::kFloat), st.read(name, torch::kFloat));
    std::ifstream in(d / out / "config.json");
    const models::ModelConfig c = models::llama_config_from_hf(nlohmann::json::parse(in), out);
    auto a = models::make_model(c), b = models::make_model(c);
    hub::load_hub_weights(*a, (d / "st").string());
    hub::load_hub_weights(*b, (d / out).string());
    const auto pa = a->named_parameters(), pb = b->named_parameters();
    for (const auto& p : pa) expect_bitwise(p.key(), p.value().detach(), pb[p.key()].detach());
  }
  // `checkpoint convert` turns the .bin directory into safetensors shards
  // (the other files copied), read back as the original.
  const test::Run r = run("checkpoint convert " + (d / "bins").string() + " -o " + (d / "conv").string() +
                    " --max-shard-size 60000");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(d / "conv" / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(d / "conv" / "config.json"));
  const hub::HubWeights st((d / "st").string()), conv((d / "conv").string());
  ASSERT_EQ(st.names(), conv.names());
  for (const std::string& name : st.names())
    expect_bitwise(name, conv.read(name, torch::kFloat), st.read(name, torch::kFloat));
}

// GPT-2 as its old .bin files are: bare names, no lm_head (tied), and the
// mask buffers attn.bias / attn.masked_bias, which the loader skips.
TEST(TorchFile, Gpt2BinFileLoadsLikeItsSafetensors) {
  REQUIRE_PYTHON();
  const fs::path d = scratch("gpt2");
  std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/hub_checkpoint.py write " +
                    (d / "st").string() + " --arch gpt2 --gpt2-bare-names --seed 5 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  cmd = reference("hubbin " + (d / "st").string() + " " + (d / "bin").string() + " --gpt2-masks");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(d / "st" / "config.json");
  const models::ModelConfig c = models::gpt2_config_from_hf(nlohmann::json::parse(in), "config.json");
  models::GPT a(c), b(c);
  hub::import_hf_gpt2(a, (d / "st").string());
  hub::import_hf_gpt2(b, (d / "bin").string());
  const auto pb = b->named_parameters();
  for (const auto& p : a->named_parameters()) expect_bitwise(p.key(), p.value().detach(), pb[p.key()].detach());
}

TEST(TorchFile, CliConvertsAFileAndRefusesBadInputWithExit2) {
  REQUIRE_PYTHON();
  const fs::path d = python_files(), out = scratch("convert");
  test::Run r = run("checkpoint convert " + (d / "training.pt").string() + " --key model -o " +
              (out / "model.safetensors").string());
  ASSERT_EQ(r.code, 0) << r.err;
  const TensorMap want = load_safetensors((d / "model.safetensors").string());
  const TensorMap got = load_safetensors((out / "model.safetensors").string());
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, t] : got) expect_bitwise(name, t, want.at(name));
  r = run("checkpoint convert " + (d / "training.pt").string() + " -o " + (out / "all.safetensors").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("is a dict, not a tensor (is the state dict under a key such as 'model'?)"), std::string::npos)
      << r.err;
  r = run("checkpoint convert " + (d / "model.pt").string() + " -o " + (out / "model.bin").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("converts to one .safetensors file"), std::string::npos) << r.err;
  r = run("checkpoint convert " + (d / "model.pt").string() + " --max-shard-size 1GB -o " +
          (out / "sized.safetensors").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--max-shard-size cuts a directory's shards"), std::string::npos) << r.err;
  r = run("checkpoint convert " + (d / "legacy.pt").string() + " -o " + (out / "legacy.safetensors").string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("legacy"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out / "legacy.safetensors"));
  // Every hostile file: exit 2 with its one-line reason, under a 4 GiB
  // address-space limit (a reader that allocated what a file claims would
  // die of bad_alloc, exit 1), and nothing written.
  const fs::path bad = out / "hostile";
  const std::string make = reference("malicious " + bad.string() + " " + (out / "MARKER").string());
  ASSERT_EQ(std::system(make.c_str()), 0) << make;
  std::ifstream in(bad / "manifest.json");
  for (const auto& entry : nlohmann::json::parse(in)) {
    const std::string file = (bad / entry.at("file").get<std::string>()).string();
    const fs::path err = out / "err.txt";
    const std::string cmd = "bash -c 'ulimit -v 4194304; exec " + std::string(SCALETRAIN_BIN) + " checkpoint convert " +
                            file + " -o " + (out / "x.safetensors").string() + "' >/dev/null 2>" + err.string();
    const int status = std::system(cmd.c_str());
    std::ifstream e(err);
    const std::string text((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
    EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 2) << file << ": " << text;
    EXPECT_NE(text.find(entry.at("expect").get<std::string>()), std::string::npos) << text;
  }
  EXPECT_FALSE(fs::exists(out / "x.safetensors"));
  EXPECT_FALSE(fs::exists(out / "MARKER"));
}

}  // namespace torch_file_test
}  // namespace scaletrain::test

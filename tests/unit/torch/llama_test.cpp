// The llama family (models/llama.h) against things it did not write: the
// published parameter counts, the published config.json files, and an
// independent Python implementation of Hugging Face's LlamaForCausalLM /
// Qwen2ForCausalLM forward (tests/reference/hf_causal_lm.py) on the same
// weights and tokens.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "scaletrain/hub/hub_read.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/estimate/model_spec.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/llama.h"
#include "scaletrain/models/spec_catalog.h"
#include "scaletrain/train/plan/model_config.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace llama_test {

namespace fs = std::filesystem;

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("st_llama_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

models::ModelConfig tiny(const std::string& family = "llama") {
  models::ModelConfig c = models::model_preset("llama-tiny");
  c.family = family;
  c.qkv_bias = family == "qwen2";
  return c;
}

// Writes the model's weights (our names are Hugging Face's) and config.json
// as a Hub directory, runs the Python reference on `ids`, and returns its loss.
double reference_loss(models::CausalLM& model, const at::Tensor& ids, const fs::path& dir) {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& item : model.named_parameters()) named.emplace_back(item.key(), item.value().detach().contiguous());
  checkpoint::save_safetensors((dir / "model.safetensors").string(), named, {{"format", "pt"}});
  std::ofstream(dir / "config.json") << models::llama_config_to_hf(model.config()).dump(1);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t b = 0; b < ids.size(0); ++b) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t t = 0; t < ids.size(1); ++t) row.push_back(ids[b][t].item<int64_t>());
    rows.push_back(row);
  }
  std::ofstream(dir / "ids.json") << rows.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/reference/hf_causal_lm.py loss " + dir.string() + " " + (dir / "ids.json").string() +
                          " " + (dir / "out.json").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd << " (needs Debian's python3-torch: scripts/install-deps.sh)";
  std::ifstream in(dir / "out.json");
  return nlohmann::json::parse(in).at("loss").get<double>();
}

double our_loss(models::CausalLM& model, const at::Tensor& ids) {
  torch::NoGradGuard no_grad;
  const int64_t T = ids.size(1);
  return model.loss(ids.narrow(1, 0, T - 1), ids.narrow(1, 1, T - 1)).item<double>();
}

void expect_matches_reference(models::ModelConfig c, const std::string& name) {
  SCOPED_TRACE(name);
  torch::manual_seed(7);
  models::ModelPtr model = models::make_model(c);
  // Random norm weights, so a norm applied in the wrong place shows.
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters())
      if (item.key().find("norm") != std::string::npos) item.value().normal_(1.0, 0.2);
  }
  const at::Tensor ids = torch::randint(0, c.vocab_size, {2, 24}, torch::kLong);
  const double ours = our_loss(*model, ids);
  const double ref = reference_loss(*model, ids, scratch_dir(name));
  EXPECT_NEAR(ours, ref, 1e-5 * ref);
  EXPECT_GT(ref, 1.0);  // a real loss, not an empty batch
}

TEST(Llama, LossEqualsThePythonReference) {
  expect_matches_reference(tiny(), "gqa_untied");
  models::ModelConfig tied = tiny();
  tied.tie_word_embeddings = true;
  tied.n_kv_head = 4;
  expect_matches_reference(tied, "mha_tied");
  models::ModelConfig scaled = tiny();
  scaled.rope_scaling = {"llama3", 8.0, 1.0, 4.0, 16};  // original context 16 < 24 tokens: every regime
  scaled.rope_theta = 500000.0;
  expect_matches_reference(scaled, "llama3_rope");
  models::ModelConfig biased = tiny();
  biased.attention_bias = biased.mlp_bias = true;
  expect_matches_reference(biased, "biases");
}

TEST(Llama, Qwen2IsLlamaWithQkvBias) {
  models::ModelConfig c = tiny("qwen2");
  expect_matches_reference(c, "qwen2");
  auto model = models::make_model(c);
  EXPECT_TRUE(model->named_parameters().contains("model.layers.0.self_attn.q_proj.bias"));
  EXPECT_FALSE(model->named_parameters().contains("model.layers.0.self_attn.o_proj.bias"));
}

// Parameter counts published for these models: ours from the model itself
// (built without parameter bytes) where that is quick, and the estimator's
// count of the same config for the big ones, checked against ours on the
// small ones.
TEST(Llama, ParameterCountsArePublished) {
  auto count = [](const std::string& preset) {
    return estimate::count_params(models::estimator_spec(models::model_preset(preset))).total;
  };
  EXPECT_EQ(count("llama-2-7b"), 6738415616);
  EXPECT_EQ(count("llama-3-8b"), 8030261248);
  EXPECT_EQ(count("llama-3.1-8b"), 8030261248);
  EXPECT_EQ(count("smollm2-135m"), 134515008);
  EXPECT_EQ(count("gpt2"), 124439808);
  for (const std::string preset : {"smollm2-135m", "llama-tiny", "gpt2"}) {
    auto model = models::make_model(models::model_preset(preset), /*materialize=*/false);
    EXPECT_EQ(model->num_parameters(), count(preset)) << preset;
  }
}

TEST(Llama, PublishedConfigFilesGiveThePresets) {
  const fs::path dir = fs::path(SCALETRAIN_SOURCE_DIR) / "tests/fixtures/hub_configs";
  for (const std::string name : {"llama-2-7b", "llama-3-8b", "llama-3.1-8b", "smollm2-135m", "smollm2-360m",
                                 "tinyllama-1.1b"}) {
    std::ifstream in(dir / name / "config.json");
    ASSERT_TRUE(in) << name;
    const models::ModelConfig got = models::llama_config_from_hf(nlohmann::json::parse(in), name);
    const models::ModelConfig want = models::model_preset(name);
    EXPECT_EQ(got.vocab_size, want.vocab_size) << name;
    EXPECT_EQ(got.n_layer, want.n_layer) << name;
    EXPECT_EQ(got.n_head, want.n_head) << name;
    EXPECT_EQ(got.kv_heads(), want.kv_heads()) << name;
    EXPECT_EQ(got.n_embd, want.n_embd) << name;
    EXPECT_EQ(got.mlp_width(), want.mlp_width()) << name;
    EXPECT_EQ(got.tie_word_embeddings, want.tie_word_embeddings) << name;
    EXPECT_EQ(got.rope_theta, want.rope_theta) << name;
    EXPECT_EQ(got.rope_scaling.type, want.rope_scaling.type) << name;
    EXPECT_EQ(got.block_size, want.block_size) << name;
  }
}

TEST(Llama, UnsupportedConfigsAreOneLineErrors) {
  auto message = [](nlohmann::json j) {
    try {
      models::llama_config_from_hf(j, "config.json");
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  nlohmann::json base = models::llama_config_to_hf(tiny());
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = base;
    j[key] = v;
    return j;
  };
  EXPECT_NE(message(with("model_type", "falcon")).find("model_type 'falcon'"), std::string::npos);
  EXPECT_NE(message(with("hidden_act", "gelu")).find("hidden_act"), std::string::npos);
  EXPECT_NE(message(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}})).find("yarn"), std::string::npos);
  nlohmann::json mistral = with("model_type", "mistral");
  mistral["sliding_window"] = 8;
  EXPECT_NE(message(mistral).find("sliding_window"), std::string::npos);
  mistral["sliding_window"] = nullptr;
  EXPECT_EQ(message(mistral), "(accepted)");
  EXPECT_NE(message(with("num_key_value_heads", 3)).find("n_kv_head"), std::string::npos);
  for (const auto& m : {message(with("model_type", "falcon")), message(with("hidden_act", "gelu"))})
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}

TEST(Llama, TensorParallelDegreesThatCannotSplitAreNamed) {
  const auto problems = models::tensor_parallel_problems(tiny(), 4);  // 4 heads, 2 kv heads
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("2 key/value heads"), std::string::npos) << problems[0];
  EXPECT_TRUE(models::tensor_parallel_problems(tiny(), 2).empty());
  models::ModelConfig gpt = models::model_preset("tiny");
  gpt.n_kv_head = 2;
  EXPECT_THROW(gpt.validate(), UsageError);  // GPT-2 has no grouped-query attention: refused, not ignored
  // A built model answers the engines (split_problems) as the registry does, for either family.
  for (const models::ModelConfig& c : {tiny(), models::model_preset("tiny")}) {
    const auto model = models::make_model(c, /*materialize=*/false);
    for (int tp : {0, 2, 3, 4})
      EXPECT_EQ(model->split_problems(tp), models::tensor_parallel_problems(c, tp)) << c.family << " tp=" << tp;
  }
  EXPECT_EQ(models::make_model(tiny(), false)->split_problems(0),
            std::vector<std::string>{"tensor parallel degree tp=0 must be at least 1"});
  EXPECT_FALSE(models::make_model(tiny(), false)->split_problems(3).empty());  // 4 heads
  models::ModelConfig unknown = tiny();
  unknown.family = "falcon";
  try {
    unknown.validate();
    ADD_FAILURE() << "an unknown family was validated";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()), "unknown model family 'falcon' (known: gpt2, llama, qwen2, mixtral)");
  }
}

// The engines see the model through models/causal_lm.h only: no source file
// under parallel/ names a family.
// model.config: a published config.json is the architecture, for each family
// (parameter counts as published); the run's keys may only repeat its
// dimensions; what this build cannot honour is one line.
// The one-line UsageError of resolving `m` ("(accepted)" when none).
std::string config_error(const config::ModelOptions& m) {
  try {
    train::resolve_model_config(m);
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    return msg.find('\n') == std::string::npos ? msg : "(several lines) " + msg;
  }
  return "(accepted)";
}

TEST(Llama, ModelConfigKeyReadsPublishedConfigs) {
  const fs::path hub = fs::path(SCALETRAIN_SOURCE_DIR) / "tests/fixtures/hub_configs";
  auto count = [](const config::ModelOptions& m) {
    const auto model = models::make_model(train::resolve_model_config(m), /*materialize=*/false);
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    return n;
  };
  config::ModelOptions m;
  m.config = (hub / "smollm2-135m").string();  // a directory holding config.json
  EXPECT_EQ(count(m), 134515008);
  m.config = (hub / "gpt2/config.json").string();
  EXPECT_EQ(count(m), 124439808);
  m.config = (hub / "qwen2-0.5b").string();
  EXPECT_EQ(count(m), 494032768);
  m.config = (hub / "tinyllama-1.1b").string();
  m.block_size = 256;  // shorter sequences: allowed
  EXPECT_EQ(train::resolve_model_config(m).block_size, 256);
  m.n_layer = 3;
  EXPECT_NE(config_error(m).find("model.n_layer=3 disagrees with model.config"), std::string::npos) << config_error(m);
  m = {};
  m.config = (hub / "mistral-7b-v0.1").string();  // sliding window 4096 < 32768 positions
  EXPECT_NE(config_error(m).find("sliding_window"), std::string::npos) << config_error(m);
  m.config = std::string(SCALETRAIN_SOURCE_DIR) + "/tests/unit/core/estimate_data/t5_config.json";
  EXPECT_NE(config_error(m).find("model_type 't5' is not supported (known: gpt2, llama"), std::string::npos) << config_error(m);
  m.config = (hub / "smollm2-135m").string();
  m.init_from = "/nonexistent";
  EXPECT_NE(config_error(m).find("model.config and model.init_from"), std::string::npos) << config_error(m);
}

// Engines, the estimator and the checkpoint format know models only through
// the model interface (models/causal_lm.h, models/spec_catalog.h); the
// Hugging Face name maps of a family (checkpoint/hf_gpt2.*) are the exception.
TEST(Llama, EnginesNameNoModelFamily) {
  const fs::path src = fs::path(SCALETRAIN_SOURCE_DIR) / "src/scaletrain";
  const std::vector<std::string> words{"gpt", "llama", "qwen", "mistral", "bert", "wte"};
  for (const char* dir : {"parallel", "estimate", "checkpoint"}) {
    int files = 0;
    for (const auto& e : fs::recursive_directory_iterator(src / dir)) {
      if (!e.is_regular_file()) continue;
      // The per-family name maps are the one exception the design allows.
      if (e.path().filename().string().rfind("hf_gpt2.", 0) == 0) continue;
      ++files;
      std::ifstream in(e.path());
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      for (auto& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      for (const auto& w : words) EXPECT_EQ(text.find(w), std::string::npos) << e.path() << " names '" << w << "'";
    }
    EXPECT_GT(files, 5) << dir;
  }
}

}  // namespace llama_test
}  // namespace scaletrain::test

namespace scaletrain::test {
namespace llama_test {

std::string python(const std::string& args) {
  return std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/" + args;
}

// A random llama in the Hub layout, written by the independent Python tool
// (bf16, sharded into several files with an index).
fs::path write_hub(const std::string& name, const std::string& extra = "") {
  const fs::path dir = scratch_dir(name);
  const std::string cmd = python("hub_checkpoint.py write " + (dir / "hub").string() +
                                 " --arch llama --dtype bfloat16 --max-shard-size 60000 --seed 3 " + extra +
                                 " > /dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return dir / "hub";
}

models::ModelConfig hub_config(const fs::path& dir) {
  std::ifstream in(dir / "config.json");
  return models::llama_config_from_hf(nlohmann::json::parse(in), (dir / "config.json").string());
}

std::string load_error(const fs::path& dir, const models::ModelConfig& c) {
  auto model = models::make_model(c);
  try {
    hub::load_hub_weights(*model, dir.string());
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(loaded)";
}

// Loads a Hub directory into the model its config.json describes; the loss
// on random ids equals the Python reference's on the same directory.
void expect_hub_loss_matches(const fs::path& dir) {
  const models::ModelConfig c = hub_config(dir);
  auto model = models::make_model(c);
  hub::load_hub_weights(*model, dir.string());
  torch::manual_seed(1);
  const at::Tensor ids = torch::randint(0, c.vocab_size, {2, 20}, torch::kLong);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t b = 0; b < 2; ++b) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t t = 0; t < 20; ++t) row.push_back(ids[b][t].item<int64_t>());
    rows.push_back(row);
  }
  std::ofstream(dir.parent_path() / "ids.json") << rows.dump();
  const std::string cmd = python("hf_causal_lm.py loss " + dir.string() + " " + (dir.parent_path() / "ids.json").string() +
                                 " " + (dir.parent_path() / "out.json").string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir.parent_path() / "out.json");
  const double ref = nlohmann::json::parse(in).at("loss").get<double>();
  EXPECT_NEAR(our_loss(*model, ids), ref, 1e-5 * ref);
}

TEST(LlamaHub, ShardedBf16DirectoryLoadsAndGivesTheReferenceLoss) {
  const fs::path dir = write_hub("hub_load");
  ASSERT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  expect_hub_loss_matches(dir);
}

// A Mixtral directory (MixtralForCausalLM names: block_sparse_moe.gate,
// experts.J.w1/w2/w3) written by the Python tool loads under its own names.
TEST(LlamaHub, MixtralDirectoryLoadsAndGivesTheReferenceLoss) {
  const fs::path dir =
      write_hub("hub_mixtral", "--arch mixtral --set num_local_experts=4 --set num_experts_per_tok=2");
  const models::ModelConfig c = hub_config(dir);
  EXPECT_EQ(c.family, "mixtral");
  EXPECT_EQ(c.num_local_experts, 4);
  expect_hub_loss_matches(dir);
}

// What a sharded rank reads (hub::hub_slice_init): any range of the
// flattened tensor, converted from the file's bf16, equals that range of the
// whole tensor; a range outside the tensor is a one-line error.
TEST(LlamaHub, SliceReadsEqualTheWholeTensor) {
  const fs::path dir = write_hub("hub_slices");
  const models::ModelConfig c = hub_config(dir);
  auto model = models::make_model(c, /*materialize=*/false);
  const auto fill = hub::hub_slice_init(*model, dir.string());
  const hub::HubWeights hub(dir.string());
  int checked = 0;
  for (const auto& name : {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"}) {
    const at::Tensor whole = hub.read(name, at::kFloat).reshape({-1});
    const int64_t n = whole.numel();
    for (const auto& [begin, count] : {std::pair<int64_t, int64_t>{0, n}, {n / 3, n / 2}, {n - 7, 7}, {5, 0}}) {
      at::Tensor out = at::full({count}, -1.0f);
      fill(name, begin, count, out);
      EXPECT_TRUE(at::equal(out, whole.narrow(0, begin, count))) << name << " [" << begin << ", " << begin + count << ")";
      ++checked;
    }
    at::Tensor out = at::empty({8});
    try {
      fill(name, n - 4, 8, out);
      ADD_FAILURE() << name << ": a range past the end was read";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("has no elements"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(checked, 12);
}

// The process's resident mapped-file memory (RssFile in /proc/self/status), bytes.
int64_t rss_file_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("RssFile:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  ADD_FAILURE() << "no RssFile in /proc/self/status";
  return 0;
}

// A loader reading every tensor must not keep the whole checkpoint resident:
// each read gives the mapped pages it touched back, and a later read of the
// same bytes faults them in again, unchanged.
TEST(LlamaHub, ReadsGiveTheirMappedPagesBack) {
  const fs::path file = fs::temp_directory_path() / ("scaletrain_pages_" + std::to_string(::getpid()) + ".safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  torch::manual_seed(5);
  for (int i = 0; i < 8; ++i) tensors.emplace_back("w" + std::to_string(i), torch::randn({1024, 2048}));  // 8 MiB each
  checkpoint::save_safetensors(file.string(), tensors);
  {
    const hub::HubWeights hub(file.string());
    const int64_t before = rss_file_bytes();
    for (const auto& [name, t] : tensors) {
      EXPECT_TRUE(at::equal(hub.read(name, at::kFloat), t)) << name;
      at::Tensor part = at::empty({1 << 19});
      hub.read_range(name, 1 << 19, 1 << 19, part);
      EXPECT_TRUE(at::equal(part, t.reshape({-1}).narrow(0, 1 << 19, 1 << 19))) << name;
    }
    const int64_t grown = rss_file_bytes() - before;
    EXPECT_LT(grown, 16 << 20) << "reading 64 MiB of tensors left " << (grown >> 20) << " MiB of the file resident";
    EXPECT_TRUE(at::equal(hub.read("w0", at::kFloat), tensors[0].second));  // faulted in again
  }
  fs::remove(file);
}

TEST(LlamaHub, BrokenDirectoriesAreOneLineErrorsNamingTheProblem) {
  const fs::path good = write_hub("hub_bad");
  const models::ModelConfig c = hub_config(good);
  EXPECT_EQ(load_error(good, c), "(loaded)");
  struct Case {
    std::string flag, needle;
  };
  const std::vector<Case> cases{
      {"--missing-shard", "does not exist"},
      {"--index-names-missing-file", "does not exist"},
      {"--header-lies past-end", "safetensors"},
      {"--missing-tensor model.layers.1.mlp.up_proj.weight", "missing tensor 'model.layers.1.mlp.up_proj.weight'"},
      {"--extra-tensor model.layers.9.mlp.up_proj.weight", "unexpected tensor 'model.layers.9.mlp.up_proj.weight'"},
      {"--wrong-shape model.norm.weight", "tensor 'model.norm.weight' has shape"},
  };
  int i = 0;
  for (const auto& k : cases) {
    const fs::path copy = good.parent_path() / ("bad" + std::to_string(i++));
    const std::string cmd =
        python("hub_checkpoint.py corrupt " + good.string() + " --out " + copy.string() + " " + k.flag + " > /dev/null");
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const std::string msg = load_error(copy, c);
    EXPECT_NE(msg.find(k.needle), std::string::npos) << k.flag << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // Old files' rotary_emb.inv_freq entries are not parameters: ignored.
  const fs::path inv = good.parent_path() / "inv_freq";
  ASSERT_EQ(std::system(python("hub_checkpoint.py corrupt " + good.string() + " --out " + inv.string() +
                               " --add-inv-freq > /dev/null")
                            .c_str()),
            0);
  EXPECT_EQ(load_error(inv, c), "(loaded)");
}

}  // namespace llama_test
}  // namespace scaletrain::test

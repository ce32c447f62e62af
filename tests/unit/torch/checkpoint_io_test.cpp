// Tests of the at::Tensor safetensors adapter (checkpoint/tensor_io.h) and the
// Hugging Face GPT-2 mapping (hub/hf_gpt2.h).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/hub/hf_gpt2.h"
#include "scaletrain/checkpoint/safetensors.h"
#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using namespace scaletrain;
using namespace scaletrain::checkpoint;
using namespace scaletrain::hub;

namespace checkpoint_io_test {

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("st_ckpt_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

models::GPTConfig small_config() {
  models::GPTConfig c;
  c.vocab_size = 50;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

// Runs `f` and expects an exception of type E whose message contains `needle`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

using Named = std::vector<std::pair<std::string, at::Tensor>>;

Named to_named(const TensorMap& m) { return Named(m.begin(), m.end()); }

TEST(CheckpointTensorIO, RoundTripEveryDtype) {
  TempDir dir;
  torch::manual_seed(0);
  const auto r = torch::randn({3, 5});
  Named in = {
      {"f64", r.to(torch::kDouble)},
      {"f32", r},
      {"f16", r.to(torch::kHalf)},
      {"bf16", r.to(torch::kBFloat16)},
      {"i64", torch::arange(-7, 8, torch::kLong).view({3, 5}) * int64_t{1000000000000}},
      {"i32", torch::arange(-7, 8, torch::kInt)},
      {"i16", torch::arange(-7, 8, torch::kShort)},
      {"i8", torch::arange(-7, 8, torch::kChar)},
      {"u8", torch::arange(0, 255, torch::kByte)},
      {"bool", r > 0},
      {"transposed", r.t()},                                  // non-contiguous
      {"strided", r.to(torch::kBFloat16).slice(1, 0, 5, 2)},  // non-contiguous bf16
      {"scalar", torch::tensor(3.5)},
      {"empty", torch::zeros({0, 4})},
  };
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, in, {{"format", "pt"}});
  Metadata md;
  const TensorMap out = load_safetensors(path, &md);
  EXPECT_EQ(md, (Metadata{{"format", "pt"}}));
  ASSERT_EQ(out.size(), in.size());
  for (const auto& [name, t] : in) {
    const at::Tensor& u = out.at(name);
    EXPECT_EQ(u.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(u.sizes(), t.sizes()) << name;
    EXPECT_TRUE(u.is_contiguous()) << name;
    EXPECT_TRUE(torch::equal(u, t)) << name;
  }
  EXPECT_EQ(SafetensorsFile(path).at("bf16").dtype, Dtype::BF16);
}

TEST(CheckpointTensorIO, LoadedTensorsOwnTheirMemory) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  save_safetensors(path, {{"w", torch::ones({4})}});
  TensorMap m = load_safetensors(path);
  fs::remove(path);
  m.at("w").add_(1);  // writable, and still valid after the file is gone
  EXPECT_TRUE(torch::equal(m.at("w"), torch::full({4}, 2.0)));
}

TEST(CheckpointTensorIO, UnsupportedDtypesNameTheTensor) {
  TempDir dir;
  expect_error<SafetensorsError>(
      [&] {
        save_safetensors(dir.file("c"), {{"cplx", torch::zeros({2}, torch::kComplexFloat)}});
      },
      "tensor 'cplx'");
  expect_error<SafetensorsError>([&] { save_safetensors(dir.file("u"), {{"undef", at::Tensor()}}); }, "undefined");
  const uint16_t u16[2] = {1, 2};
  write_safetensors(dir.file("u16"), {{"u16_tensor", Dtype::U16, {2}, u16, 4}});
  expect_error<SafetensorsError>([&] { load_safetensors(dir.file("u16")); }, "tensor 'u16_tensor': dtype U16");
  const uint8_t bad_bool[2] = {1, 2};
  write_safetensors(dir.file("b"), {{"flags", Dtype::BOOL, {2}, bad_bool, 2}});
  expect_error<SafetensorsError>([&] { load_safetensors(dir.file("b")); }, "tensor 'flags': BOOL element 1 is 2");
}

TEST(HFGPT2, ExportThenImportGivesIdenticalParametersAndLogits) {
  TempDir dir;
  torch::manual_seed(1);
  models::GPT a(small_config());
  torch::manual_seed(2);
  models::GPT b(small_config());
  const std::string path = dir.file("model.safetensors");
  export_hf_gpt2(a, path);
  import_hf_gpt2(b, path);
  const auto pa = a->named_parameters();
  const auto pb = b->named_parameters();
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  a->eval();
  b->eval();
  const auto idx = torch::randint(0, 50, {2, 16}, torch::kLong);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(a->forward(idx), b->forward(idx)));
}

// The exported file, read by an independent Python implementation of HF's
// GPT2LMHeadModel forward (tests/unit/torch/hf_gpt2_reference.py), gives our
// logits: checks the Conv1D transposition and the names against HF semantics,
// not just export/import symmetry.
TEST(HFGPT2, PythonReferenceForwardGivesOurLogits) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 with torch (Debian python3-torch) not installed";
  }
  TempDir dir;
  torch::manual_seed(3);
  models::GPT m(small_config());
  m->eval();
  const auto idx = torch::randint(0, 50, {2, 11}, torch::kLong);
  export_hf_gpt2(m, dir.file("model.safetensors"));
  save_safetensors(dir.file("ids.safetensors"), {{"ids", idx}});
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/unit/torch/hf_gpt2_reference.py " + dir.file("model.safetensors") + " " +
                          dir.file("ids.safetensors") + " 2 " + dir.file("logits.safetensors");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const at::Tensor ref = load_safetensors(dir.file("logits.safetensors")).at("logits");
  torch::NoGradGuard no_grad;
  const at::Tensor ours = m->forward(idx);
  ASSERT_EQ(ref.sizes(), ours.sizes());
  EXPECT_TRUE(torch::allclose(ours, ref, 1e-5, 1e-5)) << (ours - ref).abs().max().item<float>();
}

TEST(HFGPT2, ExportLayoutUsesHFNamesAndConv1DShapes) {
  TempDir dir;
  models::GPT m(small_config());
  const std::string path = dir.file("model.safetensors");
  export_hf_gpt2(m, path);
  const SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), (Metadata{{"format", "pt"}}));
  EXPECT_EQ(f.tensors().size(), 2 + 2 + 2 * 12u);  // wte, wpe, ln_f.{w,b}, 12 per block
  for (const TensorView& t : f.tensors()) {
    EXPECT_EQ(t.name.rfind("transformer.", 0), 0u) << t.name;
    EXPECT_EQ(t.dtype, Dtype::F32) << t.name;
  }
  EXPECT_EQ(f.view().find("lm_head.weight"), nullptr);
  EXPECT_EQ(f.at("transformer.h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{8, 24}));  // [in, out]
  EXPECT_EQ(f.at("transformer.h.1.mlp.c_fc.weight").shape, (std::vector<int64_t>{8, 32}));
  EXPECT_EQ(f.at("transformer.h.1.mlp.c_proj.weight").shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(f.at("transformer.wte.weight").shape, (std::vector<int64_t>{50, 8}));
  const auto w = torch::from_blob(const_cast<float*>(f.at("transformer.h.0.mlp.c_fc.weight").as<float>()), {8, 32});
  EXPECT_TRUE(torch::equal(w, m->named_parameters()["h.0.mlp.c_fc.weight"].t()));
}

// The published hub file's spelling: bare names, mask buffers, and a tied
// lm_head.weight.
TEST(HFGPT2, LoadsBareNamesWithMaskBuffersAndTiedHead) {
  TempDir dir;
  models::GPT a(small_config());
  export_hf_gpt2(a, dir.file("prefixed.safetensors"));
  Named hub;
  for (const auto& [name, t] : load_safetensors(dir.file("prefixed.safetensors"))) {
    hub.emplace_back(name.substr(std::string("transformer.").size()), t);
  }
  for (int i = 0; i < 2; ++i) {
    hub.emplace_back("h." + std::to_string(i) + ".attn.bias", torch::ones({1, 1, 16, 16}).tril());
    hub.emplace_back("h." + std::to_string(i) + ".attn.masked_bias", torch::tensor(-1e4));
  }
  hub.emplace_back("lm_head.weight", a->wte->weight.detach().clone());
  save_safetensors(dir.file("hub.safetensors"), hub);

  models::GPT b(small_config());
  import_hf_gpt2(b, dir.file("hub.safetensors"));
  for (const auto& item : a->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), b->named_parameters()[item.key()])) << item.key();
  }
  const models::GPTConfig c = hf_gpt2_config(dir.file("hub.safetensors"), 2);
  EXPECT_EQ(c.vocab_size, 50);
  EXPECT_EQ(c.block_size, 16);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_embd, 8);
  EXPECT_EQ(c.n_head, 2);
  EXPECT_TRUE(c.bias);
}

TEST(HFGPT2, ConfigFromExportedFileMatchesTheModel) {
  TempDir dir;
  models::GPTConfig want = small_config();
  want.n_layer = 3;
  export_hf_gpt2(models::GPT(want), dir.file("m.safetensors"));
  const models::GPTConfig got = hf_gpt2_config(dir.file("m.safetensors"), 2);
  EXPECT_EQ(got.vocab_size, want.vocab_size);
  EXPECT_EQ(got.block_size, want.block_size);
  EXPECT_EQ(got.n_layer, 3);
  EXPECT_EQ(got.n_embd, want.n_embd);
  models::GPT m(got);
  import_hf_gpt2(m, dir.file("m.safetensors"));
  expect_error<UsageError>([&] { hf_gpt2_config(dir.file("m.safetensors"), 3); }, "n_head");
}

// Edits an exported file and expects import to fail naming the tensor, and to
// leave the model untouched.
class HFGPT2Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    export_hf_gpt2(models::GPT(small_config()), dir_.file("good.safetensors"));
    tensors_ = load_safetensors(dir_.file("good.safetensors"));
  }
  void expect_import_error(const std::string& needle) {
    save_safetensors(dir_.file("bad.safetensors"), to_named(tensors_));
    models::GPT m(small_config());
    const auto before = m->wte->weight.detach().clone();
    expect_error<UsageError>([&] { import_hf_gpt2(m, dir_.file("bad.safetensors")); }, needle);
    EXPECT_TRUE(torch::equal(before, m->wte->weight)) << "model changed by a failed import";
  }
  TempDir dir_;
  TensorMap tensors_;
};

TEST_F(HFGPT2Errors, MissingTensor) {
  tensors_.erase("transformer.h.1.ln_2.bias");
  expect_import_error("missing tensor 'transformer.h.1.ln_2.bias'");
}

TEST_F(HFGPT2Errors, UnexpectedTensor) {
  tensors_["transformer.h.2.ln_1.weight"] = torch::ones({8});
  expect_import_error("unexpected tensor 'transformer.h.2.ln_1.weight'");
}

TEST_F(HFGPT2Errors, MisshapedTensor) {
  // Stored [out, in] as if it were a torch Linear: the classic transposition bug.
  tensors_["transformer.h.0.attn.c_attn.weight"] = tensors_["transformer.h.0.attn.c_attn.weight"].t();
  expect_import_error("tensor 'transformer.h.0.attn.c_attn.weight' has shape [24, 8], expected [8, 24]");
}

TEST_F(HFGPT2Errors, DuplicateSpelling) {
  tensors_["wte.weight"] = tensors_["transformer.wte.weight"];
  expect_import_error("appears twice");
}

TEST_F(HFGPT2Errors, UntiedHead) {
  tensors_["lm_head.weight"] = torch::zeros({50, 8});
  expect_import_error("tensor 'lm_head.weight' differs from 'transformer.wte.weight'");
}

TEST_F(HFGPT2Errors, IntegerTensor) {
  tensors_["transformer.ln_f.bias"] = torch::zeros({8}, torch::kLong);
  expect_import_error("tensor 'transformer.ln_f.bias' has dtype I64");
}

}  // namespace checkpoint_io_test

// The models' attention paths and packed documents (Note [Attention paths],
// Note [Packed documents] in models/attention.h), at the level of a model in
// fp64: a window of several documents with their SequenceLayout gives the
// loss and the gradients of running each document alone; the flash and the
// naive attention give the same model; the fused head + cross-entropy gives
// the unfused loss and gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "scaletrain/models/attention.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace packed_documents_test {

constexpr int64_t kIgnore = models::kIgnoreTarget;

models::ModelConfig config(const std::string& family, const std::string& attention, bool fused = true) {
  models::ModelConfig c = models::model_preset(family == "gpt2" ? "tiny" : "llama-tiny");
  c.family = family;
  c.n_layer = 2;
  c.n_embd = 24;
  c.n_head = 4;
  if (family != "gpt2") {
    c.n_kv_head = 2;  // grouped-query attention
    c.intermediate_size = 40;
  }
  c.vocab_size = 61;
  c.block_size = 32;
  c.attention = attention;
  c.fused = fused;
  return c;
}

models::ModelPtr build(const models::ModelConfig& c) {
  torch::manual_seed(7);
  auto m = models::make_model(c);
  m->to(torch::kDouble);
  return m;
}

std::map<std::string, at::Tensor> grads(models::CausalLM& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

void expect_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, g] : a) {
    const double err = (g - b.at(name)).abs().max().item<double>();
    EXPECT_LE(err, tol) << name;
  }
}

// Rows of documents of the given lengths, laid end to end in one window per
// row; the last token of each document has no target (the next document's
// first token is not its continuation).
struct Packed {
  at::Tensor idx, targets;
  models::SequenceLayout layout;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> docs;  // per row: (start, length)
};

Packed pack(const std::vector<std::vector<int64_t>>& rows, int64_t vocab) {
  int64_t T = 0;
  for (int64_t n : rows.front()) T += n;
  Packed p;
  const int64_t B = static_cast<int64_t>(rows.size());
  p.idx = torch::randint(vocab, {B, T}, torch::kLong);
  p.targets = torch::randint(vocab, {B, T}, torch::kLong);
  p.layout.segments = torch::empty({B, T}, torch::kLong);
  p.layout.positions = torch::empty({B, T}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0, id = 0;
    p.docs.emplace_back();
    for (int64_t n : rows[static_cast<size_t>(b)]) {
      for (int64_t j = 0; j < n; ++j) {
        p.layout.segments[b][start + j] = id;
        p.layout.positions[b][start + j] = j;
        if (j + 1 < n) p.targets[b][start + j] = p.idx[b][start + j + 1];
      }
      p.targets[b][start + n - 1] = kIgnore;
      p.docs.back().emplace_back(start, n);
      start += n;
      ++id;
    }
  }
  return p;
}

// Each document alone, its loss weighted by its targets: the packed loss's
// mean over all the window's targets, and its gradients.
double separate_loss(models::CausalLM& m, const Packed& p) {
  const double total = (p.targets != kIgnore).sum().item<double>();
  double loss = 0;
  for (int64_t b = 0; b < p.idx.size(0); ++b) {
    for (auto [start, n] : p.docs[static_cast<size_t>(b)]) {
      auto idx = p.idx[b].narrow(0, start, n).unsqueeze(0);
      auto tgt = p.targets[b].narrow(0, start, n).unsqueeze(0);
      const double count = (tgt != kIgnore).sum().item<double>();
      auto l = m.loss(idx, tgt) * (count / total);
      l.backward();
      loss += l.item<double>();
    }
  }
  return loss;
}

class PackedDocuments : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(PackedDocuments, EqualEachDocumentAlone) {
  const auto& [family, attention] = GetParam();
  auto m = build(config(family, attention));
  torch::manual_seed(3);
  // Two rows of 18 tokens: documents of 5, 1, 9, 3 and of 18 (one document).
  const Packed p = pack({{5, 1, 9, 3}, {7, 11}}, m->config().vocab_size);
  m->set_sequence_layout(std::make_shared<models::SequenceLayout>(p.layout));
  auto packed = m->loss(p.idx, p.targets);
  packed.backward();
  m->set_sequence_layout(nullptr);
  const auto g_packed = grads(*m);
  m->zero_grad();
  const double alone = separate_loss(*m, p);
  EXPECT_NEAR(packed.item<double>(), alone, 1e-10);
  expect_close(g_packed, grads(*m), 1e-10);

  // Without the layout the documents see each other: a different loss.
  torch::NoGradGuard no_grad;
  EXPECT_GT(std::abs(m->loss(p.idx, p.targets).item<double>() - alone), 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Families, PackedDocuments,
                         ::testing::Combine(::testing::Values("gpt2", "llama"), ::testing::Values("flash", "naive")));

// The same model, weights and batch under both attention paths, and with the
// head fused or not: fp64 losses and gradients agree to 1e-10.
class AttentionPaths : public ::testing::TestWithParam<std::string> {};

TEST_P(AttentionPaths, FlashNaiveFusedUnfusedAgree) {
  const std::string family = GetParam();
  torch::manual_seed(5);
  const auto idx = torch::randint(61, {3, 29}, torch::kLong);
  auto targets = torch::randint(61, {3, 29}, torch::kLong);
  targets.index_put_({0, torch::indexing::Slice(0, 4)}, kIgnore);
  std::vector<std::pair<double, std::map<std::string, at::Tensor>>> runs;
  for (auto [attention, fused] : std::vector<std::pair<std::string, bool>>{{"naive", false}, {"flash", false},
                                                                          {"naive", true}, {"flash", true}}) {
    auto m = build(config(family, attention, fused));
    auto l = m->loss(idx, targets);
    l.backward();
    runs.emplace_back(l.item<double>(), grads(*m));
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT_NEAR(runs[i].first, runs[0].first, 1e-10) << "run " << i;
    expect_close(runs[i].second, runs[0].second, 1e-10);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, AttentionPaths, ::testing::Values("gpt2", "llama"));

TEST(AttentionPaths, BadSettingsAreRefused) {
  auto c = config("gpt2", "flash");
  c.dropout = 0.1;
  EXPECT_THROW(
      {
        try {
          c.validate();
        } catch (const UsageError& e) {
          EXPECT_NE(std::string(e.what()).find("model.attention: naive"), std::string::npos) << e.what();
          throw;
        }
      },
      UsageError);
  c.attention = "naive";
  EXPECT_NO_THROW(c.validate());
  c.dropout = 0;
  c.attention = "fast";
  EXPECT_THROW(c.validate(), UsageError);
}

// CUDA tensors take the naive path and the unfused head (the kernels are the
// CPU's); the choice itself is checked here, on the CPU build.
TEST(AttentionPaths, KernelsTakeCpuTensorsOnly) {
  EXPECT_TRUE(models::flash_runs_on(torch::zeros({1, 1, 2, 4}, torch::kFloat)));
  EXPECT_TRUE(models::flash_runs_on(torch::zeros({1, 1, 2, 4}, torch::kBFloat16)));
  EXPECT_FALSE(models::flash_runs_on(torch::zeros({1, 1, 2, 4}, torch::kLong)));
  EXPECT_FALSE(models::flash_runs_on(torch::zeros({1, 1, 2, 4}, torch::TensorOptions().device(torch::kMeta))));
}

}  // namespace packed_documents_test
}  // namespace scaletrain::test

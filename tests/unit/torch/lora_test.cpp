// LoRA adapters (models/lora.h) on both families, against what PEFT
// defines: the adapted model starts equal to the base model, only A and B
// train, the forward is base + scaling * B A x, and merging B A * scaling
// into W gives the same model. QLoRA (models/qlora.h): the base weights in
// NF4 parameters, computed on their dequantization, deferred ones filled
// with the eager bytes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <set>

#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/linear.h"
#include "scaletrain/models/lora.h"
#include "scaletrain/models/qlora.h"
#include "scaletrain/precision/nf4.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace lora_test {

models::ModelConfig config(const std::string& preset) {
  models::ModelConfig c = models::model_preset(preset);
  c.n_layer = 2;
  return c;
}

models::ModelPtr build(const std::string& preset, at::ScalarType dtype = at::kDouble) {
  torch::manual_seed(5);
  auto m = models::make_model(config(preset));
  m->to(dtype);
  return m;
}

models::LoraOptions lora(std::vector<std::string> targets, int64_t r = 4, double alpha = 8) {
  models::LoraOptions o;
  o.r = r;
  o.alpha = alpha;
  o.target_modules = std::move(targets);
  o.seed = 11;
  return o;
}

std::pair<at::Tensor, at::Tensor> batch(int64_t vocab) {
  torch::manual_seed(9);
  auto x = torch::randint(vocab, {2, 16}, torch::kLong);
  return {x, torch::roll(x, -1, 1)};
}

class LoraFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraFamilies, AdaptedModelStartsEqualToTheBase) {
  auto m = build(GetParam());
  auto [x, y] = batch(m->config().vocab_size);
  const double base = m->loss(x, y).item<double>();
  models::apply_lora(*m, lora({"all-linear"}));
  EXPECT_EQ(m->loss(x, y).item<double>(), base);  // B = 0: exactly the base model
}

TEST_P(LoraFamilies, OnlyAdaptersTrain) {
  auto m = build(GetParam());
  const auto targets = models::default_lora_targets(m->config().family);
  const auto layers = models::apply_lora(*m, lora(targets));
  EXPECT_EQ(layers.size(), static_cast<size_t>(m->config().n_layer * targets.size()));
  auto [x, y] = batch(m->config().vocab_size);
  m->loss(x, y).backward();
  int adapters = 0;
  for (const auto& item : m->named_parameters()) {
    const bool adapter = models::is_adapter_parameter(item.key());
    EXPECT_EQ(item.value().requires_grad(), adapter) << item.key();
    EXPECT_EQ(item.value().grad().defined(), adapter) << item.key();
    if (!adapter) continue;
    ++adapters;
    const std::string layer = item.key().substr(0, item.key().find(".lora_"));
    EXPECT_NE(std::find(layers.begin(), layers.end(), layer), layers.end()) << item.key();
  }
  EXPECT_EQ(adapters, static_cast<int>(2 * layers.size()));
}

// MFU of a finetune step: the frozen block weights skip their weight
// gradient, 2 of the 6 FLOPs per weight and token (hand-counted here from the
// config: every linear of the blocks is frozen under LoRA).
TEST_P(LoraFamilies, StepFlopsLeaveOutFrozenWeightGradients) {
  auto m = build(GetParam());
  const int64_t T = 16;
  EXPECT_EQ(m->step_flops_per_token(T), m->flops_per_token(T));  // full training: every weight trains
  const auto& c = m->config();
  const double h = c.n_embd, I = c.mlp_width(), kv = c.kv_heads() * c.head_dim();
  const double per_block = c.family == "gpt2" ? 3 * h * h + h * h + 2 * h * I  // c_attn, c_proj, c_fc, c_proj
                                              : h * h + 2 * h * kv + h * h + 3 * h * I;  // q, k, v, o, gate, up, down
  models::apply_lora(*m, lora({"all-linear"}));
  EXPECT_DOUBLE_EQ(m->step_flops_per_token(T), m->flops_per_token(T) - 2 * c.n_layer * per_block);
}

TEST_P(LoraFamilies, MergedWeightsGiveTheSameModel) {
  // Adapted model with trained-looking (random) B, against the base model
  // with W + scaling * B A written into W: PEFT's merge, computed here.
  auto m = build(GetParam());
  auto o = lora({"all-linear"}, 4, 6);
  o.rslora = true;
  models::apply_lora(*m, o);
  torch::manual_seed(3);
  {
    torch::NoGradGuard g;
    for (auto& item : m->named_parameters())
      if (item.key().find("lora_B") != std::string::npos) item.value().normal_(0, 0.05);
  }
  auto [x, y] = batch(m->config().vocab_size);
  const double adapted = m->loss(x, y).item<double>();

  auto merged = build(GetParam());
  auto adapted_params = m->named_parameters();
  {
    torch::NoGradGuard g;
    for (auto& item : merged->named_parameters()) {
      item.value().copy_(adapted_params[item.key()]);
      const std::string stem = item.key().substr(0, item.key().size() - std::string("weight").size());
      if (adapted_params.contains(stem + "lora_A.weight"))
        item.value().add_(torch::matmul(adapted_params[stem + "lora_B.weight"], adapted_params[stem + "lora_A.weight"]) *
                          (6.0 / std::sqrt(4.0)));
    }
  }
  EXPECT_NEAR(merged->loss(x, y).item<double>(), adapted, 1e-12 * std::abs(adapted));
  EXPECT_NE(adapted, build(GetParam())->loss(x, y).item<double>());  // B != 0 changed the model
}

INSTANTIATE_TEST_SUITE_P(Families, LoraFamilies, ::testing::Values("tiny", "llama-tiny"),
                         [](const auto& info) { return info.param == "tiny" ? std::string("gpt2") : std::string("llama"); });

TEST(Lora, ForwardIsBasePlusScaledLowRank) {
  torch::manual_seed(1);
  models::Linear lin(6, 5, true);
  lin->to(at::kDouble);
  lin->add_adapter(3, 2.5, 0.0);
  {
    torch::NoGradGuard g;
    lin->lora_A.normal_();
    lin->lora_B.normal_();
  }
  auto x = torch::randn({4, 6}, torch::kDouble);
  auto want = torch::matmul(x, lin->weight.t()) + lin->bias + 2.5 * torch::matmul(torch::matmul(x, lin->lora_A.t()), lin->lora_B.t());
  EXPECT_TRUE(torch::allclose(lin(x), want, 1e-12, 1e-12));
  std::set<std::string> names;
  for (const auto& item : lin->named_parameters()) names.insert(item.key());
  EXPECT_EQ(names, (std::set<std::string>{"weight", "bias", "lora_A.weight", "lora_B.weight"}));  // PEFT's names
}

TEST(Lora, ScalingIsAlphaOverRankOrOverItsRoot) {
  auto o = lora({"q_proj"}, 16, 32);
  EXPECT_DOUBLE_EQ(o.scaling(), 2.0);
  o.rslora = true;
  EXPECT_DOUBLE_EQ(o.scaling(), 8.0);
}

TEST(Lora, InitializationFollowsPeft) {
  auto m = build("llama-tiny", at::kFloat);
  auto o = lora({"q_proj", "down_proj"}, 8, 8);
  models::apply_lora(*m, o);
  auto p = m->named_parameters();
  const auto& a = p["model.layers.0.self_attn.q_proj.lora_A.weight"];
  const auto& down = p["model.layers.1.mlp.down_proj.lora_A.weight"];
  const double in = static_cast<double>(a.size(1)), din = static_cast<double>(down.size(1));
  // kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)), std 1/sqrt(3 in).
  EXPECT_LE(a.abs().max().item<double>(), 1.0 / std::sqrt(in));
  EXPECT_GT(a.abs().max().item<double>(), 0.9 / std::sqrt(in));
  EXPECT_LE(down.abs().max().item<double>(), 1.0 / std::sqrt(din));
  EXPECT_NEAR(a.std().item<double>(), 1.0 / std::sqrt(3 * in), 0.15 / std::sqrt(3 * in));
  EXPECT_EQ(p["model.layers.0.self_attn.q_proj.lora_B.weight"].abs().max().item<double>(), 0.0);
  // The same (seed, name) gives the same values, whatever else was drawn.
  torch::manual_seed(1234);
  at::Tensor again = at::empty_like(a);
  models::init_adapter("model.layers.0.self_attn.q_proj.lora_A.weight", again, o);
  EXPECT_TRUE(torch::equal(again, a));
  models::init_adapter("model.layers.1.self_attn.q_proj.lora_A.weight", again, o);
  EXPECT_FALSE(torch::equal(again, a));  // each layer its own draw
  // gaussian: N(0, 1/r) in PEFT's sense (standard deviation 1/r).
  o.gaussian_init = true;
  at::Tensor g = at::empty({64, 512});
  models::init_adapter("x.lora_A.weight", g, o);
  EXPECT_NEAR(g.std().item<double>(), 1.0 / 8, 0.005);
  EXPECT_NEAR(g.mean().item<double>(), 0.0, 0.005);
}

TEST(Lora, DeferredAdaptersGetTheEagerValues) {
  auto o = lora({"all-linear"});
  auto eager = build("llama-tiny", at::kFloat);
  models::apply_lora(*eager, o);
  torch::manual_seed(5);
  auto deferred = models::make_model(config("llama-tiny"), /*materialize=*/false);
  models::apply_lora(*deferred, o);
  auto init = models::with_adapter_init([](const std::string& name, at::Tensor&) { FAIL() << name << " is not an adapter"; }, o);
  auto e = eager->named_parameters();
  int n = 0;
  for (const auto& item : deferred->named_parameters()) {
    if (!models::is_adapter_parameter(item.key())) continue;
    EXPECT_EQ(item.value().storage().nbytes(), 0u) << item.key();  // no bytes until the strategy asks
    at::Tensor v = at::empty(item.value().sizes());
    init(item.key(), v);
    EXPECT_TRUE(torch::equal(v, e[item.key()])) << item.key();
    ++n;
  }
  EXPECT_EQ(n, 2 * 7 * 2);  // 7 linear layers per block, 2 blocks
}

TEST(Lora, DropoutActsInTrainingOnly) {
  torch::manual_seed(1);
  models::Linear lin(8, 8, false);
  lin->add_adapter(4, 1.0, 0.5);
  {
    torch::NoGradGuard g;
    lin->lora_A.normal_();
    lin->lora_B.normal_();
  }
  auto x = torch::randn({16, 8});
  const auto exact = torch::matmul(x, lin->weight.t()) + torch::matmul(torch::matmul(x, lin->lora_A.t()), lin->lora_B.t());
  lin->eval();
  EXPECT_TRUE(torch::allclose(lin(x), exact, 1e-5, 1e-5));
  lin->train();
  EXPECT_FALSE(torch::allclose(lin(x), exact, 1e-5, 1e-5));
}

TEST(Lora, BadTargetsAreRefusedByName) {
  auto m = build("llama-tiny");
  try {
    models::apply_lora(*m, lora({"q_proj", "qproj"}));
    FAIL() << "no error";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'qproj' names no linear layer"), std::string::npos) << msg;
    EXPECT_NE(msg.find("down_proj"), std::string::npos) << msg;  // the layers it has
  }
  EXPECT_THROW(models::apply_lora(*build("tiny"), lora({"lm_head"})), UsageError);  // heads are not adapted
  EXPECT_THROW(models::apply_lora(*build("tiny"), lora({"c_attn"}, 0)), UsageError);
  EXPECT_THROW(models::apply_lora(*build("tiny"), lora({"all-linear", "c_fc"})), UsageError);
}

// A quantized layer holds the four uint8 parameters in the weight's place and
// computes x W'^T + b with W' the NF4 round trip of its weight.
TEST(Qlora, QuantizedLayerComputesOnTheDequantizedWeight) {
  torch::manual_seed(3);
  models::Linear lin(96, 40, true);
  lin->to(at::kDouble);
  const at::Tensor w = lin->weight.detach().clone(), b = lin->bias.detach().clone();
  lin->quantize({});
  std::vector<std::string> names;
  for (const auto& item : lin->named_parameters()) {
    names.push_back(item.key());
    if (item.key() != "bias") {
      EXPECT_EQ(item.value().scalar_type(), at::kByte) << item.key();
      EXPECT_FALSE(item.value().requires_grad()) << item.key();
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"weight_nf4", "weight_absmax", "weight_absmax_scale",
                                             "weight_absmax_offset", "bias"}));
  EXPECT_FALSE(lin->weight.defined());
  EXPECT_EQ(lin->weight_nf4.numel(), 96 * 40 / 2);
  EXPECT_EQ(lin->weight_absmax.numel(), 96 * 40 / 64);
  EXPECT_EQ(lin->in_features(), 96);
  EXPECT_EQ(lin->out_features(), 40);
  const at::Tensor wq = precision::nf4_dequantize(precision::nf4_quantize(w), at::kDouble);
  EXPECT_FALSE(torch::equal(wq, w));  // the layer really computes on 4 bits
  auto x = torch::randn({3, 96}, torch::kDouble);
  EXPECT_TRUE(torch::allclose(lin(x), torch::linear(x, wq, b), 1e-12, 1e-12));
  // The adapter trains in the weight's dtype on top of it.
  lin->add_adapter(4, 2.0, 0.0);
  EXPECT_EQ(lin->lora_A.scalar_type(), at::kDouble);
  EXPECT_EQ(lin->lora_B.sizes(), (std::vector<int64_t>{40, 4}));
  {
    torch::NoGradGuard g;
    lin->lora_A.normal_();
    lin->lora_B.normal_();
  }
  const auto want = torch::linear(x, wq, b) + 2.0 * torch::linear(torch::linear(x, lin->lora_A), lin->lora_B);
  EXPECT_TRUE(torch::allclose(lin(x), want, 1e-12, 1e-12));
  EXPECT_THROW(lin->quantize({}), c10::Error);
}

// Without double quantization the per-block absmax is kept as fp32 bytes.
TEST(Qlora, WithoutDoubleQuantTheAbsmaxIsStoredInFp32) {
  torch::manual_seed(4);
  models::Linear lin(64, 8, false);
  const at::Tensor w = lin->weight.detach().clone();
  precision::NF4Options o;
  o.double_quant = false;
  lin->quantize(o);
  EXPECT_EQ(lin->weight_absmax.numel(), 8 * 4);
  EXPECT_EQ(lin->weight_absmax_scale.numel(), 0);
  const auto q = precision::nf4_quantize(w, o);
  EXPECT_TRUE(torch::equal(lin->weight_absmax.clone().view(at::kFloat), q.absmax));
  auto x = torch::randn({2, 64});
  EXPECT_TRUE(torch::allclose(lin(x), torch::linear(x, precision::nf4_dequantize(q)), 1e-6, 1e-6));
}

// QLoRA on a whole model: before the first step it computes what the
// quantized base does; only the adapters have gradients.
TEST_P(LoraFamilies, QuantizedBaseWithAdaptersStartsEqualToTheQuantizedBase) {
  auto base = build(GetParam());
  EXPECT_GT(models::quantize_base(*base, {}), 0);
  auto adapted = build(GetParam());
  models::quantize_base(*adapted, {});
  models::apply_lora(*adapted, lora({"all-linear"}));
  auto [x, y] = batch(base->config().vocab_size);
  const auto l0 = base->loss(x, y), l1 = adapted->loss(x, y);
  EXPECT_EQ(l0.item<double>(), l1.item<double>());
  auto full = build(GetParam());
  EXPECT_NE(full->loss(x, y).item<double>(), l0.item<double>());  // quantization changed the model
  l1.backward();
  for (const auto& item : adapted->named_parameters()) {
    const bool adapter = models::is_adapter_parameter(item.key());
    EXPECT_EQ(item.value().requires_grad(), adapter) << item.key();
    if (models::is_nf4_parameter(item.key())) EXPECT_EQ(item.value().scalar_type(), at::kByte) << item.key();
    if (item.key().find("lora_A") != std::string::npos)  // B = 0: A's gradient is zero
      EXPECT_EQ(item.value().grad().abs().max().item<double>(), 0) << item.key();
    if (item.key().find("lora_B") != std::string::npos) EXPECT_GT(item.value().grad().abs().max().item<double>(), 0);
  }
}

// A deferred model's NF4 parameters, filled one at a time in registration
// order from the weights the model would draw, hold the eager model's bytes.
TEST(Qlora, DeferredNf4ParametersGetTheEagerBytes) {
  auto eager = build("llama-tiny", at::kFloat);
  models::quantize_base(*eager, {});
  torch::manual_seed(5);
  auto deferred = models::make_model(config("llama-tiny"), /*materialize=*/false);
  models::quantize_base(*deferred, {});
  auto* raw = deferred.get();
  auto init = models::with_nf4_init(
      interfaces::init_through(at::kFloat, [raw](const std::string& n, at::Tensor& t) { raw->init_parameter(n, t); }),
      *deferred);
  auto e = eager->named_parameters();
  int nf4 = 0;
  for (const auto& item : deferred->named_parameters()) {
    if (item.value().numel() > 0) EXPECT_EQ(item.value().storage().nbytes(), 0u) << item.key();
    at::Tensor v = at::empty(item.value().sizes(), item.value().options());
    init(item.key(), v);
    EXPECT_TRUE(torch::equal(v, e[item.key()])) << item.key();
    nf4 += models::is_nf4_parameter(item.key());
  }
  EXPECT_EQ(nf4, 2 * 7 * 4);  // 7 linear layers per block, 2 blocks, 4 parameters each
}

}  // namespace lora_test
}  // namespace scaletrain::test

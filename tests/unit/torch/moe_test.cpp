// Mixture of Experts (models/moe.h) against what it did not write: the
// routing, capacity dropping and auxiliary losses of an independent Python
// implementation of the definitions (tests/reference/moe.py) on the same
// router logits; a Mixtral model's loss against the Python Hugging Face
// reference (tests/reference/hf_causal_lm.py); Mixtral-8x7B's parameter
// counts; and the auxiliary losses' gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "scaletrain/checkpoint/tensor_io.h"
#include "scaletrain/estimate/model_spec.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/models/llama.h"
#include "scaletrain/models/moe.h"
#include "scaletrain/models/spec_catalog.h"

namespace scaletrain::test {
namespace moe_test {

namespace fs = std::filesystem;

fs::path scratch_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("st_moe_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

nlohmann::json python_route(const at::Tensor& logits, int64_t seq_len, const models::MoeOptions& o,
                            const std::string& name) {
  const fs::path dir = scratch_dir(name);
  nlohmann::json in;
  in["logits"] = nlohmann::json::array();
  const at::Tensor l = logits.to(at::kDouble).contiguous();
  for (int64_t n = 0; n < l.size(0); ++n) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t e = 0; e < l.size(1); ++e) row.push_back(l[n][e].item<double>());
    in["logits"].push_back(row);
  }
  in["seq_len"] = seq_len;
  in["k"] = o.experts_per_token;
  in["capacity_factor"] = o.capacity_factor;
  in["drop_policy"] = o.drop_policy;
  std::ofstream(dir / "in.json") << in.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR + "/tests/reference/moe.py route " +
                          (dir / "in.json").string() + " " + (dir / "out.json").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream out(dir / "out.json");
  auto j = nlohmann::json::parse(out);
  fs::remove_all(dir);
  return j;
}

// Routes fp64 logits with models::route and compares every output with the reference.
void expect_route_matches(const at::Tensor& logits, int64_t seq_len, const models::MoeOptions& o,
                          const std::string& name) {
  SCOPED_TRACE(name);
  const models::Routing r = models::route(logits, o, seq_len);
  const nlohmann::json ref = python_route(logits, seq_len, o, name);
  const int64_t n = logits.size(0), k = o.experts_per_token;
  int wrong_expert = 0, wrong_kept = 0, dropped = 0;
  double weight_err = 0;
  std::vector<int64_t> per_expert(static_cast<size_t>(o.num_experts), 0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      wrong_expert += r.experts[t][j].item<int64_t>() != ref["experts"][t][j].get<int64_t>() ? 1 : 0;
      wrong_kept += r.kept[t][j].item<bool>() != ref["kept"][t][j].get<bool>() ? 1 : 0;
      weight_err = std::max(weight_err, std::abs(r.weights[t][j].item<double>() - ref["weights"][t][j].get<double>()));
      if (r.kept[t][j].item<bool>())
        ++per_expert[static_cast<size_t>(r.experts[t][j].item<int64_t>())];
      else
        ++dropped;
    }
  EXPECT_EQ(wrong_expert, 0);
  EXPECT_EQ(wrong_kept, 0);
  EXPECT_LT(weight_err, 1e-12);
  EXPECT_EQ(dropped, ref["dropped"].get<int64_t>());
  EXPECT_EQ(per_expert, ref["tokens_per_expert"].get<std::vector<int64_t>>());
  const double aux = models::load_balancing_loss(r, o, seq_len).item<double>(), z = models::router_z_loss(r).item<double>();
  EXPECT_NEAR(aux, ref["aux"].get<double>(), 1e-12 * std::abs(ref["aux"].get<double>()));
  EXPECT_NEAR(z, ref["z"].get<double>(), 1e-12 * std::abs(ref["z"].get<double>()));
}

TEST(Moe, RoutingDroppingAndLossesEqualTheReference) {
  torch::manual_seed(3);
  models::MoeOptions o;
  o.num_experts = 6;
  o.experts_per_token = 2;
  // 3 sequences of 10 tokens; logits with a bias towards expert 1 so capacity bites.
  at::Tensor logits = torch::randn({30, 6}, torch::kDouble) * 1.5;
  logits.select(1, 1).add_(1.0);
  expect_route_matches(logits, 10, o, "dropless");
  o.capacity_factor = 1.0;
  expect_route_matches(logits, 10, o, "capacity_probs");
  o.drop_policy = "position";
  expect_route_matches(logits, 10, o, "capacity_position");
  o.capacity_factor = 0.5;
  o.drop_policy = "probs";
  o.experts_per_token = 1;
  expect_route_matches(logits, 5, o, "k1_half_capacity");
  // Capacity really dropped something, and per sequence: the same tokens
  // routed as one long sequence drop differently.
  const models::Routing per_seq = models::route(logits, o, 5), whole = models::route(logits, o, 30);
  EXPECT_GT((~per_seq.kept).sum().item<int64_t>(), 0);
  EXPECT_FALSE(torch::equal(per_seq.kept, whole.kept));
}

// The forward of a Mixtral model (router, top-2 of 4 SwiGLU experts,
// renormalized weights) equals the Python Hugging Face reference's loss.
TEST(Moe, MixtralLossEqualsThePythonReference) {
  torch::manual_seed(11);
  models::ModelConfig c = models::model_preset("mixtral-tiny");
  models::ModelPtr model = models::make_model(c);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("norm") != std::string::npos) item.value().normal_(1.0, 0.2);
      if (item.key().find("gate.weight") != std::string::npos) item.value().normal_(0.0, 0.5);  // decisive routing
    }
  }
  const at::Tensor ids = torch::randint(0, c.vocab_size, {2, 24}, torch::kLong);
  double ours = 0;
  {
    torch::NoGradGuard no_grad;
    ours = model->loss(ids.narrow(1, 0, 23), ids.narrow(1, 1, 23)).item<double>();
  }
  const fs::path dir = scratch_dir("mixtral");
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value().detach().contiguous());
  checkpoint::save_safetensors((dir / "model.safetensors").string(), named, {{"format", "pt"}});
  std::ofstream(dir / "config.json") << models::llama_config_to_hf(c).dump(1);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t b = 0; b < 2; ++b) {
    nlohmann::json row = nlohmann::json::array();
    for (int64_t t = 0; t < 24; ++t) row.push_back(ids[b][t].item<int64_t>());
    rows.push_back(row);
  }
  std::ofstream(dir / "ids.json") << rows.dump();
  const std::string cmd = std::string("/usr/bin/python3 ") + SCALETRAIN_SOURCE_DIR +
                          "/tests/reference/hf_causal_lm.py loss " + dir.string() + " " + (dir / "ids.json").string() +
                          " " + (dir / "out.json").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir / "out.json");
  const double ref = nlohmann::json::parse(in).at("loss").get<double>();
  EXPECT_NEAR(ours, ref, 1e-5 * ref);
  EXPECT_GT(ref, 1.0);
  fs::remove_all(dir);
}

// Mixtral-8x7B: 46,702,792,704 parameters, 12,879,925,248 of them used per
// token (2 of 8 experts), counted by the estimator from the preset; and the
// estimator's count of the tiny preset equals the model's own.
TEST(Moe, ParameterCountsArePublished) {
  const auto big = estimate::count_params(models::estimator_spec(models::model_preset("mixtral-8x7b")));
  EXPECT_EQ(big.total, 46702792704);
  EXPECT_EQ(big.active, 12879925248);
  const models::ModelConfig tiny = models::model_preset("mixtral-tiny");
  EXPECT_EQ(estimate::count_params(models::estimator_spec(tiny)).total, models::make_model(tiny)->num_parameters());
}

// Note [Auxiliary losses]: the layer's output carries the gradient of
// coef * aux / layers times the multiplier into the router, and nothing else:
// the router's gradient with the losses attached, less the one without,
// equals the gradient of the losses computed directly.
TEST(Moe, AuxiliaryLossGradientReachesTheRouter) {
  torch::manual_seed(5);
  models::MoeOptions o;
  o.num_experts = 4;
  o.experts_per_token = 2;
  o.aux_loss_coef = 0.3;
  o.z_loss_coef = 0.05;
  models::SparseMoeBlock block(16, 24, o);
  block->to(torch::kDouble);
  auto ctx = std::make_shared<models::MoeContext>();
  ctx->layers = 2;
  ctx->multiplier = 1.5;
  block->context = ctx;
  const at::Tensor x = torch::randn({3, 5, 16}, torch::kDouble);
  at::Tensor y0 = block(x);
  (y0.sum() * ctx->multiplier).backward();
  const at::Tensor with = block->gate->weight.grad().clone();
  // The same forward without the attachment: the losses' coefficients at 0.
  models::SparseMoeBlock bare(16, 24, [&] {
    models::MoeOptions b = o;
    b.aux_loss_coef = b.z_loss_coef = 0;
    return b;
  }());
  bare->to(torch::kDouble);
  {
    torch::NoGradGuard g;
    auto src = block->named_parameters(), dst = bare->named_parameters();
    for (auto& item : src) dst[item.key()].copy_(item.value());
  }
  at::Tensor y = bare(x);
  (y.sum() * ctx->multiplier).backward();
  const at::Tensor without = bare->gate->weight.grad().clone();
  // Direct: d/dW of multiplier / layers * (coef_aux * aux + coef_z * z).
  at::Tensor w = block->gate->weight.detach().clone().requires_grad_(true);
  const models::Routing r = models::route(torch::matmul(x.reshape({15, 16}), w.t()), o, 5);
  const at::Tensor direct_loss = (o.aux_loss_coef * models::load_balancing_loss(r, o, 5) +
                                  o.z_loss_coef * models::router_z_loss(r)) *
                                 (ctx->multiplier / ctx->layers);
  direct_loss.backward();
  EXPECT_TRUE(torch::allclose(with - without, w.grad(), 1e-10, 1e-12))
      << (with - without - w.grad()).abs().max().item<double>();
  EXPECT_GT(w.grad().abs().max().item<double>(), 1e-6);
  EXPECT_EQ(ctx->stats.forwards, 1);
}

}  // namespace moe_test
}  // namespace scaletrain::test

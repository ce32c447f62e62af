// Memory estimator: exact parameter counts, the Accelerate and DeepSpeed
// figures against hand computation, the ZeRO paper's example, Korthikanti's
// activation formulas, the planner, JSON output and error messages.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>

#include "scaletrain/estimate/memory_model.h"
#include "scaletrain/estimate/model_spec.h"
#include "scaletrain/estimate/planner.h"
#include "scaletrain/estimate/reference_methods.h"
#include "scaletrain/estimate/report.h"
#include "scaletrain/estimate/request.h"
#include "scaletrain/models/spec_catalog.h"
#include "scaletrain/util/error.h"

namespace est = scaletrain::estimate;
namespace cat = scaletrain::models;  // the families as the estimator sees them

namespace estimate_test {

std::string data_path(const std::string& file) {
  return std::string(SCALETRAIN_SOURCE_DIR) + "/tests/unit/core/estimate_data/" + file;
}

// The UsageError message of `f`, or "" when it does not throw one.
template <typename F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const scaletrain::UsageError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}


// ---- parameter counts ---------------------------------------------------------

TEST(EstimateParams, PresetsMatchReferenceArchitectures) {
  EXPECT_EQ(est::count_params(cat::estimator_preset("gpt2")).total, 124439808);  // tied head
  EXPECT_EQ(est::count_params(cat::estimator_preset("llama-2-7b")).total, 6738415616);
  EXPECT_EQ(est::count_params(cat::estimator_preset("meta-llama/Meta-Llama-3-8B")).total, 8030261248);
  // Further published figures (transformers num_parameters()).
  EXPECT_EQ(est::count_params(cat::estimator_preset("gpt2-medium")).total, 354823168);
  EXPECT_EQ(est::count_params(cat::estimator_preset("gpt2-large")).total, 774030080);
  EXPECT_EQ(est::count_params(cat::estimator_preset("gpt2-xl")).total, 1557611200);
  EXPECT_EQ(est::count_params(cat::estimator_preset("meta-llama/Llama-2-13b-hf")).total, 13015864320);
  EXPECT_EQ(est::count_params(cat::estimator_preset("llama-2-70b")).total, 68976648192);
  EXPECT_EQ(est::count_params(cat::estimator_preset("llama-3-70b")).total, 70553706496);
  EXPECT_EQ(est::count_params(cat::estimator_preset("llama-3.2-1b")).total, 1235814400);  // tied
  EXPECT_EQ(est::count_params(cat::estimator_preset("mistral-7b")).total, 7241732096);
  EXPECT_EQ(est::count_params(cat::estimator_preset("bert-base-uncased")).total, 109482240);  // with pooler
  EXPECT_EQ(est::count_params(cat::estimator_preset("bert-large-uncased")).total, 335141888);
}

TEST(EstimateParams, BaseModelDropsUntiedHeadOnly) {
  const auto llama = est::count_params(cat::estimator_preset("llama-2-7b"));
  EXPECT_EQ(llama.head, 32000LL * 4096);
  EXPECT_EQ(llama.base_model, 6738415616LL - 32000LL * 4096);
  const auto gpt2 = est::count_params(cat::estimator_preset("gpt2"));
  EXPECT_EQ(gpt2.base_model, gpt2.total);
}

TEST(EstimateParams, HfConfigsGiveSameCountsAsPresets) {
  EXPECT_EQ(est::count_params(cat::load_estimator_config(data_path("gpt2_config.json"))).total, 124439808);
  EXPECT_EQ(est::count_params(cat::load_estimator_config(data_path("llama3_8b_config.json"))).total, 8030261248);
  EXPECT_EQ(est::count_params(cat::load_estimator_config(data_path("bert_base_uncased_config.json"))).total, 109482240);
  // resolve_model takes the path too (or its directory).
  EXPECT_EQ(cat::resolve_estimator_model(data_path("gpt2_config.json")).family, "gpt2");
}

TEST(EstimateParams, RawCounts) {
  EXPECT_EQ(est::parse_param_count("7.5B"), 7500000000LL);
  EXPECT_EQ(est::parse_param_count("125M"), 125000000LL);
  EXPECT_EQ(est::parse_param_count("1.2e9"), 1200000000LL);
  EXPECT_EQ(est::parse_param_count("7_000_000"), 7000000LL);
  EXPECT_EQ(est::parse_param_count("gpt5"), -1);
  const auto raw = cat::resolve_estimator_model("7.5B");
  EXPECT_TRUE(raw.shapeless());
  EXPECT_EQ(est::count_params(raw).total, 7500000000LL);
}

TEST(EstimateParams, LoraTrainableCountMatchesPeft) {
  // PEFT on Llama-2-7B, r=8, q_proj + v_proj: 32 layers * 2 * 8 * (4096 + 4096)
  // = 4,194,304 trainable parameters.
  est::Layout l;
  l.lora_rank = 8;
  const auto e = est::estimate_rank(cat::estimator_preset("llama-2-7b"), l);
  EXPECT_EQ(e.trainable_params, 4194304);
  EXPECT_EQ(e.frozen_params, 6738415616);
  // Frozen base: 16-bit weights only; adapters carry grads + master + Adam.
  EXPECT_DOUBLE_EQ(e.gradients, 4194304.0 * 2);
  EXPECT_DOUBLE_EQ(e.optimizer, 4194304.0 * 8);
  // tp=2: q and v are column-parallel, so each rank holds A (8 x 4096) whole
  // and half of B (4096 x 8): 32 x 2 x (32,768 + 16,384) = 3,145,728.
  l.world_size = 2;
  l.tp = 2;
  EXPECT_EQ(est::estimate_rank(cat::estimator_preset("llama-2-7b"), l).trainable_params, 3145728);
}

TEST(EstimateParams, QloraKeepsTheBlocksLinearWeightsInNf4) {
  // Llama-2-7B's linear weights per block: q, k, v, o 4 x 4096^2 = 67,108,864
  // and gate, up, down 3 x 4096 x 11008 = 135,266,304: 202,375,168, x 32 =
  // 6,476,005,376 in NF4 (4 bits + an 8-bit absmax per 64 + an fp32 scale per
  // 16,384 = 0.515869140625 bytes each); the other 262,410,240 frozen weights
  // (embeddings, norms) and the 4,194,304 adapters stay 16-bit.
  EXPECT_DOUBLE_EQ(est::kNf4BytesPerParam, 0.515869140625);
  est::Layout l;
  l.lora_rank = 8;
  l.qlora = true;
  const auto e = est::estimate_rank(cat::estimator_preset("llama-2-7b"), l);
  const double Q = 6476005376.0;
  EXPECT_NEAR(e.params, (6738415616.0 - Q + 4194304.0) * 2 + Q * 0.515869140625, 1.0);
  EXPECT_EQ(e.trainable_params, 4194304);
  EXPECT_DOUBLE_EQ(e.gradients, 4194304.0 * 2);
  // Llama-2-70B QLoRA under ZeRO-3: the NF4 base is sharded like any weight.
  const auto spec = cat::estimator_preset("llama-2-70b");
  double prev = 0;
  for (int64_t n : {2, 4, 8}) {
    est::Layout z;
    z.world_size = n;
    z.sharding = est::Sharding::kZero3;
    z.lora_rank = 16;
    z.lora_targets = est::LoraTargets::kAllLinear;
    z.qlora = true;
    const auto r = est::estimate_rank(spec, z);
    z.qlora = false;
    const auto full16 = est::estimate_rank(spec, z);
    EXPECT_LT(r.params, 0.3 * full16.params) << n;  // 4.1 of 16 bits for nearly all weights
    if (prev > 0) EXPECT_NEAR(r.params, prev / 2, 0.01 * prev) << n;
    prev = r.params;
  }
  est::Layout bad;
  bad.qlora = true;
  EXPECT_NE(usage_error([&] { est::estimate_rank(cat::estimator_preset("llama-2-7b"), bad); }).find("QLoRA needs a LoRA rank"),
            std::string::npos);
}

// ---- Accelerate ---------------------------------------------------------------

TEST(EstimateAccelerate, Gpt2TableByHand) {
  // AutoModel = GPT2Model, 124,439,808 params -> 497,759,232 fp32 bytes.
  // Buffers: 12 blocks x (1024^2 bool / 8 + 4-byte masked_bias) = 1,572,912.
  // T = 499,332,144 bytes = 476.1995 MiB -> "476.2 MB".
  // Largest layer: wte 50257 x 768 x 4 = 154,389,504 = 147.2373 MiB (a block
  // is 28,482,564). float16 halves, int8 quarters, int4 eighths:
  //   T/2 = 249,666,072 -> 238.1 MB, T/4 -> 119.05 MB, T/8 = 62,416,518 -> 59.53 MB
  //   wte/2 -> 73.62 MB, /4 -> 36.81 MB, /8 = 19,298,688 -> 18.4 MB
  // Training (from T): float32 step 4T = 1,997,328,576 = 1.8602 GiB -> "1.86 GB";
  //   float16: gradients T + T//2 = 748,998,216 -> 714.3 MB, highest 2T -> 952.4 MB.
  const auto counts = est::count_params(cat::estimator_preset("gpt2"));
  EXPECT_DOUBLE_EQ(4.0 * counts.base_model + counts.buffer_bytes, 499332144.0);
  const auto rows = est::accelerate_rows(counts, {est::AccelDtype::kFloat32, est::AccelDtype::kFloat16,
                                                  est::AccelDtype::kInt8, est::AccelDtype::kInt4});
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(est::convert_bytes(rows[0].total_bytes), "476.2 MB");
  EXPECT_EQ(est::convert_bytes(rows[0].largest_layer_bytes), "147.24 MB");
  EXPECT_EQ(est::convert_bytes(rows[0].highest_bytes), "1.86 GB");
  EXPECT_DOUBLE_EQ(rows[0].step_bytes, 1997328576.0);
  EXPECT_EQ(est::convert_bytes(rows[1].total_bytes), "238.1 MB");
  EXPECT_EQ(est::convert_bytes(rows[1].largest_layer_bytes), "73.62 MB");
  EXPECT_EQ(est::convert_bytes(rows[1].gradients_bytes), "714.3 MB");
  EXPECT_DOUBLE_EQ(rows[1].gradients_bytes, 748998216.0);
  EXPECT_EQ(est::convert_bytes(rows[1].highest_bytes), "952.4 MB");
  EXPECT_EQ(est::convert_bytes(rows[2].total_bytes), "119.05 MB");
  EXPECT_EQ(est::convert_bytes(rows[3].total_bytes), "59.53 MB");
  EXPECT_EQ(est::convert_bytes(rows[3].largest_layer_bytes), "18.4 MB");
  EXPECT_LT(rows[2].highest_bytes, 0);  // int8/int4: "N/A" as in Accelerate
  const std::string table = est::render_accelerate("gpt2", rows);
  EXPECT_TRUE(contains(table, "│float32│  147.24 MB  │ 476.2 MB │      1.86 GB      │"));
  EXPECT_TRUE(contains(table, "│  int8 │   36.81 MB  │119.05 MB │        N/A        │"));
}

TEST(EstimateAccelerate, BertBaseCasedMatchesAccelerateDocs) {
  // Accelerate's model_size_estimator guide prints for bert-base-cased:
  // Total Size 413.18 MB, float16 206.59 MB, int8 103.29 MB, int4 51.65 MB,
  // Training using Adam 1.61 GB (float32) and 826.36 MB (float16).
  const auto rows = est::accelerate_rows(est::count_params(cat::estimator_preset("bert-base-cased")),
                                         {est::AccelDtype::kFloat32, est::AccelDtype::kFloat16,
                                          est::AccelDtype::kInt8, est::AccelDtype::kInt4});
  EXPECT_EQ(est::convert_bytes(rows[0].total_bytes), "413.18 MB");
  EXPECT_EQ(est::convert_bytes(rows[1].total_bytes), "206.59 MB");
  EXPECT_EQ(est::convert_bytes(rows[2].total_bytes), "103.29 MB");
  EXPECT_EQ(est::convert_bytes(rows[3].total_bytes), "51.65 MB");
  EXPECT_EQ(est::convert_bytes(rows[0].highest_bytes), "1.61 GB");
  EXPECT_EQ(est::convert_bytes(rows[1].highest_bytes), "826.36 MB");
}

TEST(EstimateAccelerate, PythonFormatting) {
  EXPECT_EQ(est::convert_bytes(512, /*is_int=*/true), "512 bytes");
  EXPECT_EQ(est::convert_bytes(512.0), "512.0 bytes");
  EXPECT_EQ(est::convert_bytes(1024), "1.0 KB");
  EXPECT_EQ(est::convert_bytes(1536), "1.5 KB");
  EXPECT_EQ(est::convert_bytes(3.0 * (1LL << 30)), "3.0 GB");
  EXPECT_EQ(est::center("ab", 5), "  ab ");  // CPython puts the odd space left when width is odd
  EXPECT_EQ(est::center("ab", 7), "   ab  ");
  EXPECT_EQ(est::center("abc", 6), " abc  ");
}

// ---- DeepSpeed ----------------------------------------------------------------

TEST(EstimateDeepSpeed, Zero2Gpt2OneGpuByHand) {
  // P = 124,439,808, 1 node x 1 GPU, factor 1.5.
  // offload:    GPU 2P = 248,879,616 (0.23 GiB); CPU int(P * max(4,16) * 1.5) = 24P = 2,986,555,392 (2.78)
  // no offload: GPU 4P + int(16P/1) = 20P = 2,488,796,160 (2.32); CPU P*4*1*1.5 = 6P = 746,638,848 (0.70)
  const int64_t P = 124439808;
  est::DeepSpeedOptions o;
  const auto off = est::zero2_row(P, true, o), on = est::zero2_row(P, false, o);
  EXPECT_EQ(off.gpu_bytes, 248879616);
  EXPECT_EQ(off.cpu_bytes, 2986555392);
  EXPECT_EQ(on.gpu_bytes, 2488796160);
  EXPECT_EQ(on.cpu_bytes, 746638848);
  const auto text = est::render_deepspeed(P, 38597376, o, est::deepspeed_rows(P, 38597376, o));
  EXPECT_TRUE(contains(text, "SW: Model with 124M total params.\n"));
  EXPECT_TRUE(contains(text, "    2.78GB |   0.23GB | offload_optimizer=cpu \n"));
  EXPECT_TRUE(contains(text, "    0.70GB |   2.32GB | offload_optimizer=none\n"));
  EXPECT_TRUE(contains(text, "SW: Model with 124M total params, 38M largest layer params."));
  EXPECT_EQ(est::count_params(cat::estimator_preset("gpt2")).largest_module, 38597376);  // wte
}

TEST(EstimateDeepSpeed, Llama2TwoNodesByHand) {
  // P = 6,738,415,616, Lp = 131,072,000 (embed_tokens / lm_head), 2 nodes x 8 GPUs:
  // G = 16, gpus_factor = 1/2, factor 1.5.
  const int64_t P = 6738415616, Lp = 131072000;
  const auto c = est::count_params(cat::estimator_preset("llama-2-7b"));
  EXPECT_EQ(c.total, P);
  EXPECT_EQ(c.largest_module, Lp);
  est::DeepSpeedOptions o;
  o.num_nodes = 2;
  o.gpus_per_node = 8;
  // ZeRO-2 offload: GPU 2P; CPU P * max(64, 16) * 1.5 = 96P.
  EXPECT_EQ(est::zero2_row(P, true, o).gpu_bytes, 2 * P);
  EXPECT_EQ(est::zero2_row(P, true, o).cpu_bytes, 96 * P);
  // ZeRO-2 no offload: GPU 4P + P = 5P; CPU P * 4 * 8 * 1.5 = 48P.
  EXPECT_EQ(est::zero2_row(P, false, o).gpu_bytes, 5 * P);
  EXPECT_EQ(est::zero2_row(P, false, o).cpu_bytes, 48 * P);
  // ZeRO-3, offload param + optimizer, zero_init: GPU 4Lp; CPU P*18*0.5*1.5 = 13.5P = 90,968,610,816.
  auto r = est::zero3_row(P, Lp, true, true, true, o);
  EXPECT_EQ(r.gpu_bytes, 4 * Lp);
  EXPECT_EQ(r.cpu_bytes, 90968610816);
  // ... without zero_init: P * max(4*8, 9) * 1.5 = 48P.
  EXPECT_EQ(est::zero3_row(P, Lp, true, true, false, o).cpu_bytes, 48 * P);
  // Optimizer offload only, zero_init: GPU 4Lp + int(2P/16) = 524,288,000 + 842,301,952; CPU 12P.
  r = est::zero3_row(P, Lp, true, false, true, o);
  EXPECT_EQ(r.gpu_bytes, 524288000 + 842301952);
  EXPECT_EQ(r.cpu_bytes, 12 * P);
  // No offload, zero_init: GPU 4Lp + int(18P/16) = 524,288,000 + 7,580,717,568; CPU Lp*4*8*1.5 = 48Lp.
  r = est::zero3_row(P, Lp, false, false, true, o);
  EXPECT_EQ(r.gpu_bytes, 524288000 + 7580717568);
  EXPECT_EQ(r.cpu_bytes, 48 * Lp);
  EXPECT_EQ(est::zero3_row(P, Lp, false, false, false, o).cpu_bytes, 48 * P);
  EXPECT_EQ(est::deepspeed_rows(P, Lp, o).size(), 8u);  // 2 ZeRO-2 + 6 ZeRO-3 lines, DeepSpeed's order
}

// ---- scaletrain model -----------------------------------------------------------

TEST(EstimateModel, ZeroPaperExample) {
  // Rajbhandari et al. 2019, Figure 1: Psi = 7.5B, N = 64, K = 12 (mixed
  // precision Adam): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
  //   baseline (2 + 2 + K) Psi          = 120e9
  //   P_os     4 Psi + K Psi / N        = 30e9 + 1.40625e9  = 31.40625e9
  //   P_os+g   2 Psi + (2 + K) Psi / N  = 15e9 + 1.640625e9 = 16.640625e9
  //   P_os+g+p (2 + 2 + K) Psi / N      = 1.875e9
  const auto spec = cat::resolve_estimator_model("7.5B");
  est::Layout l;
  l.world_size = 64;
  l.precision = est::Precision::kMixed16;
  const double expected[] = {120e9, 31.40625e9, 16.640625e9, 1.875e9};
  const double printed[] = {120, 31.4, 16.6, 1.9};
  const est::Sharding stages[] = {est::Sharding::kNone, est::Sharding::kZero1, est::Sharding::kZero2,
                                  est::Sharding::kZero3};
  for (int i = 0; i < 4; ++i) {
    l.sharding = stages[i];
    const auto e = est::estimate_rank(spec, l);
    EXPECT_DOUBLE_EQ(e.model_states(), expected[i]) << "stage " << i;
    EXPECT_NEAR(e.model_states() / 1e9, printed[i], 0.05) << "stage " << i;
  }
}

// Mixtral-8x7B, from the preset and from its published config.json: 46.7B
// parameters, 12.9B active per token. Under expert parallelism a rank holds
// 1/ep of each MoE layer's experts; sharded states split them over the N/ep
// ranks holding the same experts (Note [Experts in the sharded engine] in
// parallel/fsdp), so ZeRO-3's share is the whole model over N whatever ep is,
// while ZeRO-1 keeps the rank's own weights whole and shards only the rest.
TEST(EstimateModel, MixtralExpertsUnderExpertParallelism) {
  const auto preset = cat::estimator_preset("mistralai/Mixtral-8x7B-v0.1");
  const auto file = cat::load_estimator_config(data_path("mixtral_8x7b_config.json"));
  for (const auto& spec : {preset, file}) {
    const auto c = est::count_params(spec);
    EXPECT_EQ(c.total, 46702792704);
    EXPECT_EQ(c.active, 12879925248);
    EXPECT_EQ(c.per_layer_experts, 8LL * 3 * 4096 * 14336);
  }
  const auto c = est::count_params(preset);
  const double experts = 32.0 * static_cast<double>(c.per_layer_experts), total = static_cast<double>(c.total);
  est::Layout l;
  l.world_size = 8;
  l.precision = est::Precision::kFp32;
  l.ep = 2;
  auto e = est::estimate_rank(preset, l);  // DDP: half the experts, whole
  EXPECT_EQ(static_cast<double>(e.stage_params), total - experts / 2);
  EXPECT_DOUBLE_EQ(e.params, (total - experts / 2) * 4);
  l.sharding = est::Sharding::kZero1;
  e = est::estimate_rank(preset, l);
  EXPECT_DOUBLE_EQ(e.params, (total - experts / 2) * 4);
  EXPECT_DOUBLE_EQ(e.optimizer, total / 8 * 8);  // Adam's two fp32 states of 1/8 of everything
  l.sharding = est::Sharding::kZero3;
  for (int64_t ep : {2, 4, 8}) {
    l.ep = ep;
    e = est::estimate_rank(preset, l);
    EXPECT_DOUBLE_EQ(e.params, total / 8 * 4) << "ep " << ep;
    EXPECT_DOUBLE_EQ(e.gradients, total / 8 * 4) << "ep " << ep;
  }
  EXPECT_TRUE(contains(est::describe(l, e), "dp=8 ep=8 zero-3")) << est::describe(l, e);
  // What the trainer refuses, the estimator refuses.
  l.ep = 3;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(preset, l); }), "ep=3 does not divide num_experts=8"));
  l.ep = 4;
  l.world_size = 6;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(preset, l); }), "ep=4 does not divide the 6 data-parallel"));
  l.ep = 2;
  l.world_size = 8;
  l.tp = 2;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(preset, l); }), "not available in this build"));
  l.tp = 1;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(cat::estimator_preset("mistral-7b"), l); }),
                       "needs a model with MoE layers"));
  l.ep = 0;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(preset, l); }), "ep must be >= 1"));
}

// The block Korthikanti et al. count: LayerNorm, fused attention, a 4h MLP.
est::ModelSpec korthikanti_block(int64_t h, int64_t a) {
  est::ModelSpec k = cat::estimator_structure("gpt2");
  k.hidden_size = h;
  k.num_heads = k.num_kv_heads = a;
  k.intermediate_size = 4 * h;
  return k;
}

TEST(EstimateModel, KorthikantiActivationVariants) {
  // s = 2048, b = 1, h = 4096, a = 32, t = 8: sbh = 8,388,608, 5as/h = 80.
  const int64_t s = 2048, b = 1, h = 4096, a = 32, t = 8;
  const est::ModelSpec k = korthikanti_block(h, a);
  const double sbh = 8388608.0;
  using R = est::Recompute;
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kNone), sbh * (34 + 80));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, false, R::kNone), sbh * (10 + 3 + 10));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, true, R::kNone), sbh * 114 / 8);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, false, R::kSelective), sbh * 13);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, true, R::kSelective), sbh * 34 / 8);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kFull), 2 * sbh);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, true, R::kFull), 2 * sbh / 8);
  // Without TP every variant reduces to the t = 1 formula: 10 + 24 = 34.
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kSelective), sbh * 34);
}

TEST(EstimateModel, KorthikantiWithoutDropout) {
  // Same shapes, dropout off: no 1-byte masks (sbh each after attention and
  // MLP, as^2b on the scores) and no separate dropout output of the scores,
  // so 34 -> 32, 10 -> 8 and 5as/h -> 2as/h (= 32 here).
  const int64_t s = 2048, b = 1, h = 4096, a = 32, t = 8;
  const est::ModelSpec k = korthikanti_block(h, a);
  const double sbh = 8388608.0;
  using R = est::Recompute;
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kNone, false), sbh * (32 + 32));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, false, R::kNone, false), sbh * (8 + 3 + 4));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, true, R::kNone, false), sbh * 64 / 8);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, false, R::kSelective, false), sbh * 11);
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kFull, false), 2 * sbh);
}

// Note [Activations of a block] for an RMSNorm / SwiGLU block (Llama-2-7B:
// h 4096, I 11008, 32 heads), no dropout, per s*b*h in 16-bit bytes:
// replicated 2 norms x 4 + attention and MLP inputs 4 = 12; split q, k, v,
// o-input 8 + four gated tensors 8 x 11008/4096 = 21.5; scores 2as/h = 32.
TEST(EstimateModel, GatedRmsNormBlock) {
  const int64_t s = 2048, b = 1, t = 8;
  const est::ModelSpec k = cat::estimator_preset("llama-2-7b");
  const double sbh = 8388608.0;
  using R = est::Recompute;
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, 1, false, R::kNone, false), sbh * (12 + 29.5 + 32));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, false, R::kNone, false),
                   sbh * (12 + 29.5 / 8 + 32.0 / 8));
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, k, t, true, R::kSelective, false), sbh * 41.5 / 8);
  // Grouped-query attention keeps what full attention keeps (k and v are
  // repeated before the scores): Llama-3-8B's 8 kv heads change nothing here.
  est::ModelSpec gqa = k;
  gqa.num_kv_heads = 8;
  EXPECT_DOUBLE_EQ(est::activation_bytes_per_layer(s, b, gqa, 1, false, R::kNone, false),
                   est::activation_bytes_per_layer(s, b, k, 1, false, R::kNone, false));
}

// scaletrain's GPT of bench/RESULTS.md section 7 as the trainer describes it
// to the estimator (train/plan/memory_layout.cpp): 8 layers x 512, 8 heads, 256
// tokens, a byte vocabulary, tied head; fp32, dropout 0, micro-batch 4, Gloo.
est::ModelSpec bench_gpt() {
  est::ModelSpec s = cat::estimator_structure("gpt2");
  s.name = "gpt 8x512";
  s.vocab_size = 256;
  s.hidden_size = 512;
  s.num_layers = 8;
  s.num_heads = s.num_kv_heads = 8;
  s.intermediate_size = 2048;
  s.max_positions = 256;
  s.tie_word_embeddings = true;
  return s;
}

est::Layout bench_layout(int64_t world, est::Sharding sharding, est::Recompute recompute) {
  est::Layout l;
  l.world_size = world;
  l.sharding = sharding;
  l.precision = est::Precision::kFp32;
  l.seq_len = 256;
  l.micro_batch = 4;
  l.dropout = false;
  l.recompute = recompute;
  l.gloo = true;
  return l;
}

TEST(EstimateModel, Fp32GptByHand) {
  const auto spec = bench_gpt();
  const double psi = 25482240;  // what `scaletrain train` prints for this model
  EXPECT_EQ(est::count_params(spec).total, 25482240);
  const auto e = est::estimate_rank(spec, bench_layout(2, est::Sharding::kNone, est::Recompute::kNone));
  const double sbh = 256.0 * 4 * 512, sbv = 256.0 * 4 * 256, as2b = 8.0 * 256 * 256 * 4;
  // fp32 elements kept per layer: 16sbh + as^2b (Korthikanti's 32sbh + 2as^2b
  // bytes at 16 bits); the head keeps ln_f's input and output and the
  // log-softmax.
  const double layer = 4 * (16 * sbh + as2b);
  EXPECT_DOUBLE_EQ(e.activations, 8 * layer + 4 * (2 * sbh + sbv));
  // The worst moment is the last layer's MLP backward, the head's part freed
  // by then: the residual gradient (sbh), the hidden gradient net of the
  // freed hidden output (4sbh), and c_fc's weight gradient.
  EXPECT_DOUBLE_EQ(e.activations + e.workspace, 8 * layer + 4 * (sbh + 4 * sbh) + 4.0 * 512 * 2048);
  EXPECT_DOUBLE_EQ(e.model_states(), 16 * psi);
  EXPECT_DOUBLE_EQ(e.comm_buffers, 0);  // DDP's gradients are its buckets
  // With full recompute, DDP's one-time bucket rebuild (the gradients twice,
  // no activations) is the worst moment.
  const auto f = est::estimate_rank(spec, bench_layout(2, est::Sharding::kNone, est::Recompute::kFull));
  EXPECT_DOUBLE_EQ(f.total, 20 * psi);
  // ZeRO-3 on 2 ranks: states 16psi/2; the receive shard (4psi/2) and three
  // pooled whole-layer receive buffers stay between steps.
  const auto z = est::estimate_rank(spec, bench_layout(2, est::Sharding::kZero3, est::Recompute::kNone));
  const double layer_params = 12.0 * 512 * 512 + 13 * 512;
  EXPECT_DOUBLE_EQ(z.model_states(), 8 * psi);
  EXPECT_GE(z.comm_buffers, 4 * psi / 2 + 3 * 4 * layer_params);
}

// Checked against reality: the peak bytes of live tensors the trainer
// measured in these runs (scripts/bench-memory.sh, bench/RESULTS.md section
// 7), within 3% (every row came within 2%).
TEST(EstimateModel, Fp32GptMatchesMeasuredPeaks) {
  using S = est::Sharding;
  using R = est::Recompute;
  struct Row {
    int64_t world;
    S sharding;
    R recompute;
    double measured_mib;
  };
  const Row rows[] = {
      {1, S::kNone, R::kNone, 724.5},  {1, S::kNone, R::kFull, 486.6},  {1, S::kZero1, R::kNone, 724.5},
      {1, S::kZero1, R::kFull, 533.6}, {1, S::kZero2, R::kNone, 846.7}, {1, S::kZero2, R::kFull, 642.3},
      {1, S::kZero3, R::kNone, 859.8}, {1, S::kZero3, R::kFull, 603.2}, {2, S::kNone, R::kNone, 724.5},
      {2, S::kNone, R::kFull, 486.6},  {2, S::kZero1, R::kNone, 724.5}, {2, S::kZero1, R::kFull, 510.1},
      {2, S::kZero2, R::kNone, 749.5}, {2, S::kZero2, R::kFull, 545.1}, {2, S::kZero3, R::kNone, 656.8},
      {2, S::kZero3, R::kFull, 406.3}, {4, S::kNone, R::kNone, 724.5},  {4, S::kNone, R::kFull, 486.6},
      {4, S::kZero1, R::kNone, 675.9}, {4, S::kZero1, R::kFull, 437.2}, {4, S::kZero2, R::kNone, 652.3},
      {4, S::kZero2, R::kFull, 447.9}, {4, S::kZero3, R::kNone, 535.3}, {4, S::kZero3, R::kFull, 280.8},
  };
  for (const Row& r : rows) {
    const auto e = est::estimate_rank(bench_gpt(), bench_layout(r.world, r.sharding, r.recompute));
    EXPECT_NEAR(e.total / 1048576.0, r.measured_mib, 0.03 * r.measured_mib)
        << r.world << " ranks, " << est::sharding_name(r.sharding) << ", recompute "
        << est::recompute_name(r.recompute);
  }
}

TEST(EstimateModel, PipelineSchedulesInFlight) {
  using S = est::Schedule;
  EXPECT_DOUBLE_EQ(est::inflight_microbatches(S::kGPipe, 4, 0, 8, 1), 8);  // GPipe holds all m
  EXPECT_DOUBLE_EQ(est::inflight_microbatches(S::k1F1B, 4, 0, 8, 1), 4);   // 1F1B at most p
  EXPECT_DOUBLE_EQ(est::inflight_microbatches(S::k1F1B, 4, 3, 8, 1), 1);
  EXPECT_DOUBLE_EQ(est::inflight_microbatches(S::k1F1B, 4, 0, 2, 1), 2);
  EXPECT_DOUBLE_EQ(est::inflight_microbatches(S::kInterleaved, 4, 0, 8, 2), 4 * (1 + 3.0 / 8));
  // The whole-model effect: GPipe stores m/p times the 1F1B activations on stage 0.
  est::Layout l;
  l.world_size = 4;
  l.pp = 4;
  l.microbatches = 16;
  l.seq_len = 1024;
  l.schedule = S::k1F1B;
  const auto one = est::estimate_rank(cat::estimator_preset("gpt2"), l);
  l.schedule = S::kGPipe;
  const auto gpipe = est::estimate_rank(cat::estimator_preset("gpt2"), l);
  EXPECT_GT(gpipe.activations, 3.5 * one.activations);
}

TEST(EstimateModel, TensorParallelSplitsTheMatrices) {
  est::Layout l;
  l.world_size = 8;
  l.tp = 8;
  const auto spec = cat::estimator_preset("llama-2-7b");
  const auto c = est::count_params(spec);
  const auto e = est::estimate_rank(spec, l);
  // Matrices and embedding / head split 8 ways; RMSNorm weights replicated.
  const int64_t expected = c.per_layer_tp_split / 8 * 32 + 2 * 4096 * 32 + c.embedding / 8 + c.head / 8 + 4096;
  EXPECT_EQ(e.stage_params, expected);
  EXPECT_GT(e.tp_comm_bytes, 0);
}

// Context parallelism: each rank keeps the activations of seq / cp tokens
// (flash attention makes them linear in the sequence, so exactly half at
// cp = 2), its states are sharded over dp x cp like a data-parallel rank's,
// and the ring moves keys and values per layer as the formula says.
TEST(EstimateModel, ContextParallelSplitsTheSequence) {
  const auto spec = cat::estimator_preset("llama-3-8b");
  est::Layout l;
  l.seq_len = 16384;
  l.flash_attention = true;
  l.fused_blocks = true;
  l.sharding = est::Sharding::kZero3;
  l.world_size = 2;
  const auto dp2 = est::estimate_rank(spec, l);
  l.cp = 2;
  const auto cp2 = est::estimate_rank(spec, l);
  EXPECT_EQ(cp2.dp, 1);
  EXPECT_EQ(cp2.shard, 2);
  EXPECT_DOUBLE_EQ(cp2.model_states(), dp2.model_states());
  l.world_size = 1;
  l.cp = 1;
  const auto one = est::estimate_rank(spec, l);
  EXPECT_NEAR(cp2.activations / one.activations, 0.5, 1e-9);
  EXPECT_EQ(one.cp_comm_bytes, 0);
  // 32 layers x (1 hop of bf16 k and v forward, 1 in backward, 2 of fp32 gradients): 8192 tokens x 1024 wide.
  const double kv = 2.0 * 8192 * 1024;
  EXPECT_DOUBLE_EQ(cp2.cp_comm_bytes, 32 * (kv * 2 + kv * 2 + 2 * kv * 4));
  l.world_size = 6;
  l.cp = 3;  // 16384 tokens do not make 6 equal chunks
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(spec, l); }), "divisible by 2 x cp = 6"));
  // With a pipeline each stage holds half the layers of a cp = 2 rank's
  // activations, and sends its part of each sequence to the next stage.
  l.world_size = 4;
  l.cp = 2;
  l.pp = 2;
  const auto pp2 = est::estimate_rank(spec, l);
  l.cp = 1;
  l.world_size = 2;
  const auto pp2_whole = est::estimate_rank(spec, l);
  EXPECT_NEAR(pp2.pp_comm_bytes / pp2_whole.pp_comm_bytes, 0.5, 1e-9);
  EXPECT_LT(pp2.activations, 0.6 * pp2_whole.activations);
  EXPECT_GT(pp2.cp_comm_bytes, 0);
}

// ---- planner ------------------------------------------------------------------

TEST(EstimatePlanner, ListsFittingLayoutsCheapestFirst) {
  est::PlanOptions o;
  o.budget_bytes = 80e9;
  o.base.world_size = 64;
  o.base.gpus_per_node = 8;
  o.base.seq_len = 4096;
  o.base.microbatches = 8;
  const auto spec = cat::estimator_preset("llama-2-7b");
  const auto rows = est::plan(spec, o);
  ASSERT_FALSE(rows.empty());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_LE(rows[i].estimate.total, o.budget_bytes);
    EXPECT_NO_THROW(est::validate_layout(spec, rows[i].layout));
    if (i) EXPECT_LE(rows[i - 1].estimate.comm_seconds, rows[i].estimate.comm_seconds);
  }
  // Llama-2-7B with plain DDP at seq 4096 does not fit 80 GB (16 bytes/param alone is 108 GB).
  for (const auto& r : rows)
    EXPECT_FALSE(r.layout.tp == 1 && r.layout.pp == 1 && r.layout.sharding == est::Sharding::kNone);
  o.budget_bytes = 1e6;
  EXPECT_TRUE(est::plan(spec, o).empty());
}

TEST(EstimatePlanner, MemorySizes) {
  EXPECT_DOUBLE_EQ(est::parse_memory_size("80GB"), 80e9);
  EXPECT_DOUBLE_EQ(est::parse_memory_size("80GiB"), 80.0 * (1LL << 30));
  EXPECT_DOUBLE_EQ(est::parse_memory_size("512MB"), 512e6);
  EXPECT_FALSE(usage_error([] { est::parse_memory_size("lots"); }).empty());
}

// ---- output -------------------------------------------------------------------

TEST(EstimateOutput, AccelerateJsonCarriesEveryFigure) {
  est::Request r;
  r.model = "gpt2";
  r.method = est::Method::kAccelerate;
  const auto res = est::run(r, cat::resolve_estimator_model(r.model));
  const auto j = nlohmann::json::parse(res.json.dump());
  ASSERT_EQ(j["rows"].size(), 4u);
  for (const auto& row : j["rows"]) {
    for (const auto& [key, text] : row["text"].items())
      EXPECT_TRUE(contains(res.text, text.get<std::string>())) << key << " " << text;
    EXPECT_EQ(row["text"]["Total Size"], est::convert_bytes(row["total_bytes"].get<double>()));
  }
  EXPECT_EQ(j["rows"][0]["training_bytes"]["optimizer_step"].get<double>(), 1997328576.0);
}

TEST(EstimateOutput, ScaletrainAndPlanJsonCarryEveryFigure) {
  est::Request r;
  r.model = "llama-3-8b";
  r.world_size = 16;
  r.nodes = 2;
  r.layout.tp = 2;
  r.layout.sharding = est::Sharding::kZero2;
  r.layout.recompute = est::Recompute::kSelective;
  r.layout.sequence_parallel = true;
  r.layout.seq_len = 8192;
  auto res = est::run(r, cat::resolve_estimator_model(r.model));
  auto j = nlohmann::json::parse(res.json.dump());
  EXPECT_EQ(j["method"], "scaletrain");
  EXPECT_EQ(j["model"]["total_params"], 8030261248LL);
  const auto& pr = j["per_rank"];
  for (const char* key : {"params", "gradients", "master", "optimizer", "gathered", "comm_buffers", "activations",
                          "workspace", "total", "host", "dp_comm_bytes", "tp_comm_bytes", "pp_comm_bytes"})
    ASSERT_TRUE(pr.contains(key)) << key;
  for (const auto& [label, text] : pr["text"].items()) {
    EXPECT_TRUE(contains(res.text, label)) << label;
    EXPECT_TRUE(contains(res.text, text.get<std::string>())) << label;
  }
  EXPECT_DOUBLE_EQ(pr["total"].get<double>(), pr["params"].get<double>() + pr["gradients"].get<double>() +
                                                  pr["master"].get<double>() + pr["optimizer"].get<double>() +
                                                  pr["gathered"].get<double>() + pr["comm_buffers"].get<double>() +
                                                  pr["activations"].get<double>() + pr["workspace"].get<double>());

  r.fit_bytes = 80e9;
  r.layout.microbatches = 4;
  res = est::run(r, cat::resolve_estimator_model(r.model));
  j = nlohmann::json::parse(res.json.dump());
  EXPECT_EQ(j["method"], "plan");
  ASSERT_FALSE(j["rows"].empty());
  for (const auto& row : j["rows"]) {
    for (const auto& cell : row["text"])  // every cell is in the table
      EXPECT_TRUE(contains(res.text, cell.get<std::string>())) << cell;
    EXPECT_LE(row["per_rank"]["total"].get<double>(), 80e9);
  }

  r.fit_bytes = 0;
  r.method = est::Method::kAll;
  j = est::run(r, cat::resolve_estimator_model(r.model)).json;
  ASSERT_TRUE(j.is_array());
  EXPECT_EQ(j.size(), 3u);
  EXPECT_EQ(j[2]["method"], "deepspeed");
  EXPECT_EQ(j[2]["rows"].size(), 8u);
}

// ---- errors -------------------------------------------------------------------

TEST(EstimateErrors, UnknownArchitectureIsOneLineListingKnownOnes) {
  auto msg = usage_error([] { cat::load_estimator_config(data_path("t5_config.json")); });
  EXPECT_TRUE(contains(msg, "unknown architecture 't5'")) << msg;
  EXPECT_TRUE(contains(msg, "gpt2, llama, mistral, qwen2, mixtral, bert")) << msg;
  EXPECT_FALSE(contains(msg, "\n"));
  msg = usage_error([] { cat::resolve_estimator_model("not-a-model"); });
  EXPECT_TRUE(contains(msg, "known: ")) << msg;
  EXPECT_TRUE(contains(msg, "llama-2-7b")) << msg;
  EXPECT_FALSE(contains(msg, "\n"));
  EXPECT_FALSE(usage_error([] { cat::resolve_estimator_model(data_path("missing.json")); }).empty());
}

TEST(EstimateErrors, ImpossibleLayoutsNameTheDegrees) {
  const auto llama2 = cat::estimator_preset("llama-2-7b"), llama3 = cat::estimator_preset("llama-3-8b");
  est::Layout l;
  l.world_size = 6;
  l.tp = 3;  // 32 heads
  auto msg = usage_error([&] { est::estimate_rank(llama2, l); });
  EXPECT_TRUE(contains(msg, "tp=3 does not divide num_heads=32")) << msg;
  EXPECT_TRUE(contains(msg, "world_size=6")) << msg;
  EXPECT_FALSE(contains(msg, "\n"));
  l.world_size = 16;
  l.tp = 16;  // 32 query heads divide, 8 kv heads do not
  msg = usage_error([&] { est::estimate_rank(llama3, l); });
  EXPECT_TRUE(contains(msg, "num_kv_heads=8")) << msg;
  l.world_size = 10;
  l.tp = 4;
  msg = usage_error([&] { est::estimate_rank(llama2, l); });
  EXPECT_TRUE(contains(msg, "not divisible by tp*pp")) << msg;
  l = est::Layout{};
  l.world_size = 64;
  l.pp = 64;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(llama2, l); }), "exceeds num_layers=32"));
  l = est::Layout{};
  l.sequence_parallel = true;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(llama2, l); }), "needs tp > 1"));
  l = est::Layout{};
  l.world_size = 2;
  l.tp = 2;
  EXPECT_TRUE(contains(usage_error([&] { est::estimate_rank(cat::resolve_estimator_model("7B"), l); }), "shapes"));
  est::Request r;
  r.model = "gpt2";
  r.world_size = 12;
  r.nodes = 5;
  EXPECT_TRUE(contains(usage_error([&] { est::run(r, cat::resolve_estimator_model(r.model)); }), "not divisible by nodes=5"));
  EXPECT_TRUE(contains(usage_error([] { est::parse_recompute("some"); }), "none, selective, full"));
}
}  // namespace estimate_test

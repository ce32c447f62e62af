// Per-rank memory and per-step communication of a layout. See memory_model.h.
// The names of a layout's choices and its one-line description are in
// report.cpp.
//
// Note [Rank grid]
// ----------------
// Ranks are laid out TP fastest, then DP, then PP (Megatron's default order):
// rank = tp_rank + tp * (dp_rank + dp * pp_rank). A group with stride `st` and
// size `n` stays inside a node when st * n <= gpus_per_node. This decides which
// link bandwidth a collective runs at, and the shard group of HYBRID sharding
// (the dp ranks that share a node).
//
// Note [Pipeline split]
// ---------------------
// Layers are cut as scaletrain's pipeline cuts them by default: consecutive
// runs minimizing the largest stage's parameters, counting the embeddings on
// the first stage and the final norm and head on the last (so a small model's
// first stage takes fewer layers); the interleaved schedule splits them
// evenly. Stage 0 also holds the embeddings, the last stage the final norm, the
// pooler and the LM head; with tied embeddings and pp > 1 the last stage keeps
// its own copy of the word embedding (Megatron does the same and all-reduces
// the two gradients). We report the stage with the largest total.
//
// Note [Activations of a run]
// ---------------------------
// Checked against what autograd really keeps (the trainer's tensor-byte
// counter, bench/RESULTS.md section 7): for scaletrain's first model (a
// LayerNorm block with a 4h GELU MLP) in fp32 with dropout 0 one forward keeps
// exactly L*(64sbh + 4as^2b) + 8sbh + 4sbV bytes, which is Korthikanti's count
// without dropout (activation_bytes_per_layer) at 4 bytes per element, plus
// the head's part the paper also lists: the final norm's input and output
// (the output is the head's input) and the fp32 log-softmax of the loss (the
// logits themselves are not kept: the head's matmul saves its inputs, the
// log-softmax its output). The paper's 1-byte embedding dropout mask exists
// only with dropout. The peak comes later, in backward, when gradients are in
// flight on top of nearly all of those: RankEstimate::workspace (peak.cpp,
// Note [The worst moment]).
//
// Note [Activations of a block]
// -----------------------------
// Counted in 16-bit bytes per s*b*h (what each op's backward saves; tensors
// shared by two ops count once):
//   attention: its input (one tensor feeds q, k and v) 2; q and k for the
//     scores 4 (k after grouped heads are repeated, so GQA keeps as much as
//     MHA); v 2; the output projection's input 2; the softmax output 2as/h.
//     Rotary tables are per position, not per token: nothing per s*b*h.
//   MLP: its input 2; two linears keep the activation's input and the second
//     linear's input, 2 x 2I/h; a gated MLP keeps gate, act(gate), up and
//     their product, 4 x 2I/h.
//   norms: LayerNorm keeps its input (2 each); RMSNorm computed in fp32 keeps
//     its input and the normalized tensor the weight multiplies (4 each).
// Replicated under TP: norms, attention and MLP inputs; split: the rest. For
// LayerNorm and I = 4h this is Korthikanti's 8 + 24/t; measured for the
// RMSNorm/SwiGLU block by the trainer's counter (bench/RESULTS.md section 7).
#include "scaletrain/estimate/memory_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <vector>

#include "scaletrain/estimate/peak.h"
#include "scaletrain/util/error.h"

namespace scaletrain::estimate {

namespace {

// Bytes per parameter of each state under a precision policy.
struct Widths {
  double weight;     // working weights
  double grad;       // gradients
  double master;     // fp32 master copy (0 when weights are fp32 already)
  double optimizer;  // Adam m and v
  double compute;    // width of gathered weights / activations
};

Widths widths(Precision p) {
  switch (p) {
    case Precision::kFp32: return {4, 4, 0, 8, 4};
    case Precision::kMixed16: return {2, 2, 4, 8, 2};
    case Precision::kAutocast16: return {4, 4, 0, 8, 2};
    case Precision::kPure16: return {2, 2, 0, 4, 2};
  }
  return {4, 4, 0, 8, 4};
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Layers per pipeline stage, cut as scaletrain's pipeline cuts them by
// default (parallel.pp_balance: params): consecutive runs that minimize the
// largest run's parameters, the embedding counted on the first stage and the
// final norm and head on the last. Ties go to the earliest cut, as there.
std::vector<int64_t> layers_per_stage(int64_t layers, int64_t pp, double layer, double first_extra,
                                      double last_extra) {
  const double inf = std::numeric_limits<double>::infinity();
  auto cost = [&](int64_t b, int64_t e, int64_t part) {
    return static_cast<double>(e - b) * layer + (part == 0 ? first_extra : 0) + (part == pp - 1 ? last_extra : 0);
  };
  // best[k][e]: the smallest largest-run cost of layers [0, e) in k runs.
  std::vector<std::vector<double>> best(pp + 1, std::vector<double>(layers + 1, inf));
  std::vector<std::vector<int64_t>> cut(pp + 1, std::vector<int64_t>(layers + 1, 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= pp; ++k)
    for (int64_t e = k; e <= layers; ++e)
      for (int64_t b = k - 1; b < e; ++b) {
        const double c = std::max(best[k - 1][b], cost(b, e, k - 1));
        if (c < best[k][e]) {
          best[k][e] = c;
          cut[k][e] = b;
        }
      }
  std::vector<int64_t> out(pp, 0);
  for (int64_t k = pp, e = layers; k > 0; --k) {
    out[k - 1] = e - cut[k][e];
    e = cut[k][e];
  }
  return out;
}

// Ring collectives: bytes each rank sends.
double all_reduce(double bytes, int64_t n) { return n > 1 ? 2.0 * (n - 1) / n * bytes : 0.0; }
double gather_or_scatter(double bytes, int64_t n) { return n > 1 ? 1.0 * (n - 1) / n * bytes : 0.0; }

// LoRA adapter parameters of one block on one tensor-parallel rank: r * (in
// + out) for each targeted linear, with the factor that splits with its
// layer divided by t (a column-parallel layer's B, a row-parallel layer's A;
// the other factor is replicated). A fused q/k/v projection is one target
// (PEFT's default for it); so "q,v" means that projection alone, and the
// MLP's linears count only for all-linear.
int64_t lora_params_per_layer(const ModelSpec& s, int64_t r, LoraTargets targets, int64_t t) {
  const int64_t h = s.hidden_size, I = s.intermediate_size;
  const int64_t hd = s.head_dim > 0 ? s.head_dim : h / s.num_heads;
  const int64_t q_out = s.num_heads * hd, kv_out = (s.num_kv_heads > 0 ? s.num_kv_heads : s.num_heads) * hd;
  int64_t sum = 0;
  auto column = [&](int64_t in, int64_t out) { sum += r * in + ceil_div(r * out, t); };
  auto row = [&](int64_t in, int64_t out) { sum += ceil_div(r * in, t) + r * out; };
  if (s.fused_qkv) {
    column(h, q_out + 2 * kv_out);
    if (targets != LoraTargets::kQv) row(q_out, h);  // o
  } else {
    column(h, q_out);   // q
    column(h, kv_out);  // v
    if (targets != LoraTargets::kQv) { column(h, kv_out); row(q_out, h); }  // k, o
  }
  if (targets == LoraTargets::kAllLinear) {
    column(h, I);
    if (s.gated_mlp) column(h, I);
    row(I, h);
  }
  return sum;
}

// Width of one token's keys (or values): kv heads x head dimension.
double kv_width(const ModelSpec& s) {
  const int64_t hd = s.head_dim > 0 ? s.head_dim : s.hidden_size / s.num_heads;
  return static_cast<double>((s.num_kv_heads > 0 ? s.num_kv_heads : s.num_heads) * hd);
}

// Weights of one block's linear layers (what QLoRA quantizes).
int64_t linear_params_per_layer(const ModelSpec& s) {
  const int64_t h = s.hidden_size, I = s.intermediate_size;
  const int64_t hd = s.head_dim > 0 ? s.head_dim : h / s.num_heads;
  const int64_t q_out = s.num_heads * hd, kv_out = (s.num_kv_heads > 0 ? s.num_kv_heads : s.num_heads) * hd;
  return h * (q_out + 2 * kv_out) + q_out * h + (s.gated_mlp ? 3 : 2) * h * I;
}

bool intra_node(int64_t stride, int64_t size, int64_t gpn) { return gpn <= 0 || stride * size <= gpn; }

}  // namespace

void validate_layout(const ModelSpec& s, const Layout& l) {
  auto degrees = [&] {
    std::ostringstream o;
    o << "(world_size=" << l.world_size << ", tp=" << l.tp << ", pp=" << l.pp;
    if (l.cp != 1) o << ", cp=" << l.cp;
    if (l.gpus_per_node > 0) o << ", gpus_per_node=" << l.gpus_per_node;
    o << ")";
    return o.str();
  };
  auto fail = [&](const std::string& why) { throw UsageError("impossible layout " + degrees() + ": " + why); };
  if (l.world_size < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1) fail("degrees must be >= 1");
  if (l.microbatches < 1 || l.micro_batch < 1 || l.seq_len < 0) fail("micro-batches, micro-batch size must be >= 1");
  if (l.world_size % (l.tp * l.pp * l.cp) != 0)
    fail("world size " + std::to_string(l.world_size) + " is not divisible by tp*pp*cp = " +
         std::to_string(l.tp * l.pp * l.cp));
  // Context parallelism, as the trainer takes it (train/plan/plan.cpp).
  if (l.cp > 1) {
    const std::string cp = "cp=" + std::to_string(l.cp);
    if (s.shapeless()) fail(cp + " needs the model's shapes (give a preset or config.json)");
    if (s.num_experts > 0) fail(cp + " with MoE layers is not available in this build");
    if (l.seq_len > 0 && l.seq_len % (2 * l.cp) != 0)
      fail(cp + " needs a sequence length divisible by 2 x cp = " + std::to_string(2 * l.cp));
  }
  if (l.gpus_per_node > 0 && l.world_size % l.gpus_per_node != 0)
    fail("world size is not a whole number of nodes of " + std::to_string(l.gpus_per_node) + " GPUs");
  if (s.shapeless()) {
    if (l.tp > 1 || l.pp > 1) fail("tensor/pipeline parallelism needs the model's shapes (give a preset or config.json)");
    if (l.lora_rank > 0) fail("LoRA needs the model's shapes (give a preset or config.json)");
  } else {
    const int64_t kv = s.num_kv_heads > 0 ? s.num_kv_heads : s.num_heads;
    if (s.num_heads % l.tp != 0)
      fail("tp=" + std::to_string(l.tp) + " does not divide num_heads=" + std::to_string(s.num_heads));
    if (kv % l.tp != 0)
      fail("tp=" + std::to_string(l.tp) + " does not divide num_kv_heads=" + std::to_string(kv));
    if (l.pp > s.num_layers)
      fail("pp=" + std::to_string(l.pp) + " exceeds num_layers=" + std::to_string(s.num_layers));
  }
  if (l.sequence_parallel && l.tp < 2) fail("sequence parallelism needs tp > 1");
  // Expert parallelism, as the trainer takes it (train/plan/plan.cpp).
  if (l.ep < 1) fail("ep must be >= 1");
  if (l.ep > 1) {
    const int64_t dp = l.world_size / (l.tp * l.pp * l.cp);
    const std::string ep = "ep=" + std::to_string(l.ep);
    if (s.num_experts == 0) fail(ep + " needs a model with MoE layers (num_local_experts in its config)");
    if (s.num_experts % l.ep != 0) fail(ep + " does not divide num_experts=" + std::to_string(s.num_experts));
    if (dp % l.ep != 0) fail(ep + " does not divide the " + std::to_string(dp) + " data-parallel ranks");
    if (l.tp > 1 || l.pp > 1) fail(ep + " with tensor or pipeline parallelism is not available in this build");
    if (l.sharding == Sharding::kHybrid) fail(ep + " with hybrid sharding is not available in this build");
    if (l.lora_rank > 0) fail(ep + " with LoRA is not available in this build");
  }
  if (l.offload_params && l.sharding != Sharding::kZero3 && l.sharding != Sharding::kHybrid)
    fail("parameter offload needs ZeRO-3 / FSDP full or hybrid sharding");
  if (l.lora_rank < 0) fail("LoRA rank must be >= 0");
  if (l.lora_layer_params < 0 || (l.lora_layer_params > 0 && l.lora_rank < 1))
    fail("adapter parameters per block need a LoRA rank > 0 and must be >= 0");
  if (l.qlora && l.lora_rank < 1) fail("QLoRA needs a LoRA rank (--lora-rank > 0)");
  if (l.pp > 1 && l.schedule == Schedule::kInterleaved) {
    if (l.virtual_stages < 1) fail("interleaved schedule needs virtual stages >= 1");
    if (s.num_layers % (l.pp * l.virtual_stages) != 0)
      fail("interleaved schedule needs num_layers divisible by pp*virtual_stages = " +
           std::to_string(l.pp * l.virtual_stages));
    if (l.microbatches % l.pp != 0) fail("interleaved schedule needs micro-batches divisible by pp");
  }
}

double activation_bytes_per_layer(int64_t s_, int64_t b_, const ModelSpec& spec, int64_t t_, bool sp,
                                  Recompute recompute, bool dropout, bool flash, bool fused) {
  const double s = s_, b = b_, h = spec.hidden_size, a = spec.num_heads, t = t_;
  const double sbh = s * b * h;
  const bool split = sp && t_ > 1;
  // Replicated part (Note [Activations of a block]): what the two norms keep,
  // the inputs of attention and MLP, and the residual dropout masks. Split
  // part: q, k, v, the output projection's input, and the MLP's hidden
  // tensors. And the attention scores' factor.
  const double norm = spec.norm == Norm::kLayerNorm || fused ? 1 : 2;
  const double rep = 4 * norm + 4 + (dropout ? 2 : 0);
  // An MoE block runs each token through k experts: k MLPs' hidden tensors.
  const double routes = spec.num_experts > 0 ? static_cast<double>(spec.experts_per_token) : 1.0;
  const double gated = fused ? 6 : 8;  // fused, SwiGLU keeps gate and up only (experts' too)
  const double hidden = routes * (spec.gated_mlp ? gated : 4) * static_cast<double>(spec.intermediate_size) / h;
  const double tp = 8 + hidden, att = dropout ? 5 : 2;
  const double scores = flash ? 2 + 4 * a / h : att * a * s / h;  // per s*b*h, split over tp
  switch (recompute) {
    case Recompute::kNone:
      if (t_ == 1) return sbh * (rep + tp + scores);
      return split ? sbh * (rep + tp + scores) / t : sbh * (rep + tp / t + scores / t);
    case Recompute::kSelective:
      return split ? sbh * (rep + tp) / t : sbh * (rep + tp / t);
    case Recompute::kFull:
      return split ? 2 * sbh / t : 2 * sbh;
  }
  return 0;
}

double fp8_linear_activation_change(int64_t s_, int64_t b_, const ModelSpec& spec, int64_t t_, bool sp,
                                    Recompute recompute, double width, double layer_weights) {
  if (recompute == Recompute::kFull) return 0;
  const double sb = static_cast<double>(s_) * b_, h = spec.hidden_size, t = t_;
  const double I = static_cast<double>(spec.intermediate_size);
  const double rep = sp && t_ > 1 ? t : 1;  // replicated inputs are split under sequence parallelism
  const double attention_in = (spec.fused_qkv ? 1 : 3) - width;  // per s*b*h, replicated
  const double mlp_in = (spec.gated_mlp ? 2 : 1) - width;        // per s*b*h, replicated
  const double out_in = 1 - width;                                // the output projection's input, split
  const double down_in = 1 - width;                               // the MLP's last linear's input (I wide), split
  return sb * h * (attention_in + mlp_in) / rep + sb * h * out_in / t + sb * I * down_in / t + layer_weights;
}

double inflight_microbatches(Schedule schedule, int64_t pp, int64_t stage, int64_t m, int64_t v) {
  if (pp <= 1) return 1;  // gradient accumulation frees each micro-batch before the next
  switch (schedule) {
    case Schedule::kGPipe: return static_cast<double>(m);
    case Schedule::k1F1B: return static_cast<double>(std::min(m, pp - stage));
    case Schedule::kInterleaved:
      // Korthikanti et al. 2022 sec. 4.2.3: the first stage stores
      // (1 + (p-1)/(p*v)) times what 1F1B stores.
      return static_cast<double>(std::min(m, pp - stage)) * (1.0 + (pp - 1.0) / (pp * static_cast<double>(v)));
  }
  return 1;
}

namespace {

// One layer's activations of one micro-batch under recompute policy `r`
// (Note [Activations of a run]); `layer_params`: its weights, for FP8 linears.
double layer_activations(const ModelSpec& spec, const Layout& l, const Widths& w, int64_t s_rank, double layer_params,
                         Recompute r) {
  const int64_t t = l.tp;
  const double act_scale = w.compute / 2.0;  // the formulas assume 16-bit activations
  double bytes = act_scale * activation_bytes_per_layer(s_rank, l.micro_batch, spec, t, l.sequence_parallel, r,
                                                        l.dropout, l.flash_attention, l.fused_blocks);
  if (l.cp > 1 && !l.flash_attention && r != Recompute::kFull && r != Recompute::kSelective) {
    // The ring composed of autograd ops (parallel/context) keeps the
    // scores of the 2 cp + 1 chunk pairs it computes, each (s / 2cp)^2:
    // (2 cp + 1) / 4 times the s_rank^2 counted above.
    const double att = l.dropout ? 5 : 2, a = static_cast<double>(spec.num_heads);
    bytes += act_scale * att * a * static_cast<double>(s_rank) * s_rank * l.micro_batch *
             ((2.0 * l.cp + 1) / 4.0 - 1.0) / static_cast<double>(t);
  }
  if (l.fp8_linears)
    bytes +=
        fp8_linear_activation_change(s_rank, l.micro_batch, spec, t, l.sequence_parallel, r, w.compute, layer_params);
  if (spec.num_experts > 0 && r != Recompute::kFull) {
    // An MoE block (models/moe.h) keeps each token k times as an expert
    // input (the dense count has it once) and k expert outputs for their
    // weighting, and the router's logits and probabilities in fp32.
    const double k = static_cast<double>(spec.experts_per_token);
    const double sb = static_cast<double>(s_rank) * l.micro_batch;
    bytes += sb * spec.hidden_size * (2 * k - 1) * w.compute + 2 * sb * static_cast<double>(spec.num_experts) * 4.0;
  }
  return bytes;
}

// Activations of one micro-batch of a stage with shapes, and the gradients in
// flight in its backward (peak.cpp, Note [The worst moment]).
void set_activations(StageShape& shape, const ModelSpec& spec, const Layout& l, const Widths& w, int64_t stage,
                     int64_t s_rank) {
  const int64_t t = l.tp;
  const double act_scale = w.compute / 2.0;  // the formulas assume 16-bit activations
  const bool first = stage == 0, last = stage == l.pp - 1;
  shape.inflight = inflight_microbatches(l.schedule, l.pp, stage, l.microbatches, l.virtual_stages);
  shape.act_layer = layer_activations(spec, l, w, s_rank, shape.layer_params, l.recompute);
  shape.act_layer_full = layer_activations(spec, l, w, s_rank, shape.layer_params, Recompute::kNone);
  const double sb = static_cast<double>(s_rank) * l.micro_batch;
  const double sbh = sb * spec.hidden_size, sbv = sb * spec.vocab_size;
  const double sp_div = l.sequence_parallel ? static_cast<double>(t) : 1.0;
  if (first && l.dropout) shape.act_first = sbh / sp_div;  // embedding dropout mask, 1 byte per element
  if (last) {
    const double norm_kept = spec.norm == Norm::kLayerNorm || l.fused_blocks ? 1 : 2;  // tensors a norm keeps
    shape.act_last = 2 * norm_kept * sbh * act_scale / sp_div;                         // the final norm
    // Head input (the final norm's output) + the loss's fp32 log-softmax;
    // fused, the head's input and weight gradients formed in forward
    // instead (under tp: this rank's vocabulary rows of the weight's, and
    // hidden's gradient over the whole gathered sequence).
    const double fused = 2 * sbh * act_scale + static_cast<double>(spec.vocab_size) * spec.hidden_size * w.grad / t;
    if (!spec.encoder) shape.act_last += 2 * sbh * act_scale / sp_div + (l.fused_loss ? fused : 4 * sbv / t);
  }
  // Backward of one layer: the residual gradient, the gradient of the
  // MLP's hidden output and of its input less the saved hidden output
  // freed by then, and one weight gradient before it is accumulated.
  // Backward of the loss: two more fp32 log-softmax-sized tensors.
  const double I = static_cast<double>(spec.intermediate_size);
  shape.ws_layer = act_scale * (2 * sbh / sp_div + 2 * sb * I / t) + spec.hidden_size * I / t * w.grad;
  // With an adapter on the MLP's output projection the frozen weight forms
  // no gradient, but its input's gradient comes by two paths (the base and
  // the adapter) that autograd adds into a third tensor; the input the base
  // saved is freed by then, so one more such tensor in all.
  if (l.lora_rank > 0 && l.lora_targets == LoraTargets::kAllLinear)
    shape.ws_layer += sb * I / t * w.compute - spec.hidden_size * I / t * w.grad;
  if (l.qlora) shape.ws_layer += spec.hidden_size * I / t * w.compute;  // one dequantized weight
  // Flash attention's backward (kernels/attention.cpp) holds fp32
  // contiguous copies of q, k, v, its output and the output's gradient,
  // and dq, dk, dv: 8 fp32 tensors of s*b*h/t at once, a moment of its own.
  if (l.flash_attention) shape.ws_layer = std::max(shape.ws_layer, 32 * sbh / t);
  // The ring (parallel/context) adds nothing here: the keys, values and
  // gradients it passes around are smaller than the kernel's workspace
  // above and not alive at its moment (bench/RESULTS.md section 20).
  // FP8 linears: the largest linear's backward decodes its input, weight
  // and output gradient to fp32 (Note [FP8 linears] in precision/fp8.h).
  if (l.fp8_linears) shape.ws_layer += 4 * (sb * I / t + sbh / sp_div + spec.hidden_size * I / t);
  if (last && !spec.encoder) shape.ws_last = l.fused_loss ? 0 : 8 * sbv / t;
}

// Model states of P weights, Tr of them trained, `experts` of them this
// rank's experts, over the sharding group e.shard.
void set_model_states(RankEstimate& e, const Layout& l, const Widths& w, double P, double Tr, double experts) {
  const int64_t N = e.shard;
  const bool shard_opt = l.sharding != Sharding::kNone;
  const bool shard_grad =
      l.sharding == Sharding::kZero2 || l.sharding == Sharding::kZero3 || l.sharding == Sharding::kHybrid;
  const bool shard_weights = l.sharding == Sharding::kZero3 || l.sharding == Sharding::kHybrid;
  auto count = [&](double n, bool sharded) {
    return sharded ? (n + experts * static_cast<double>(l.ep - 1)) / static_cast<double>(N) : n;
  };
  e.params = count(P + (l.lora_rank > 0 ? Tr : 0), shard_weights) * w.weight;
  e.gradients = count(Tr, shard_grad) * w.grad;
  e.master = count(Tr, shard_opt) * w.master;
  if (l.fp16_masters) {  // O3: the trainable shards (or the separate masters) are fp16
    if (w.master > 0)
      e.master = count(Tr, shard_opt) * 2.0;
    else if (shard_weights)
      e.params -= count(Tr, true) * (w.weight - 2.0);
  }
  e.optimizer = count(Tr, shard_opt) * (l.fp8_moments ? 3.0 : w.optimizer);
  if (l.offload_optimizer) {
    e.host += e.master + e.optimizer;
    e.master = e.optimizer = 0;
  }
  if (l.offload_params) {
    e.host += e.params;
    e.params = 0;
  }
}

// Communication of one step (bytes sent per rank) and its time; e.dp and
// e.shard are the layout's.
void add_step_comm(RankEstimate& e, const ModelSpec& spec, const Layout& l, const Widths& w, int64_t stage, int64_t nl,
                   double P, double Tr, int64_t seq) {
  const bool raw = spec.shapeless(), first = stage == 0, last = stage == l.pp - 1;
  const int64_t t = l.tp, pp = l.pp, dp = e.dp, dpc = dp * l.cp, N = e.shard, gpn = l.gpus_per_node;
  const bool shard_weights = l.sharding == Sharding::kZero3 || l.sharding == Sharding::kHybrid;
  const int64_t s_rank = seq / l.cp;  // the tokens of each sequence a rank holds
  const double m = static_cast<double>(l.microbatches);
  const double grad_bytes = Tr * w.grad, gather_bytes = (P + (l.lora_rank > 0 ? Tr : 0)) * w.compute;
  const double trainable_gather = Tr * w.compute;
  // The sharding group (dp ranks, or the intra-node shard group of hybrid)
  // and, for hybrid, the replica group across nodes.
  double group_bytes = 0, replica_bytes = 0;
  switch (l.sharding) {
    case Sharding::kNone:
      group_bytes = all_reduce(grad_bytes, dpc);
      break;
    case Sharding::kZero1:  // reduce-scatter grads, all-gather updated weights: the all-reduce volume
      group_bytes = gather_or_scatter(grad_bytes, dpc) + gather_or_scatter(trainable_gather, dpc);
      break;
    case Sharding::kZero2:  // no full gradient is kept, so every micro-batch is reduce-scattered
      group_bytes = m * gather_or_scatter(grad_bytes, dpc) + gather_or_scatter(trainable_gather, dpc);
      break;
    case Sharding::kZero3:
    case Sharding::kHybrid:  // gather for forward and again for backward, reduce-scatter grads
      group_bytes = m * (2 * gather_or_scatter(gather_bytes, N) + gather_or_scatter(grad_bytes, N));
      replica_bytes = all_reduce(grad_bytes / N, dpc / N);
      break;
  }
  e.dp_comm_bytes = group_bytes + replica_bytes;
  double tp_time_bytes = 0;
  if (!raw && l.cp > 1) {
    // Per layer and micro-batch: cp - 1 hops of this rank's keys and values
    // forward (again under full recompute), and in backward cp - 1 hops of
    // them and cp of their fp32 gradients (parallel/context, Note [Ring backward]).
    const double kv = 2.0 * static_cast<double>(s_rank) * l.micro_batch * kv_width(spec) / t;
    const double cpm1 = static_cast<double>(l.cp - 1), forwards = l.recompute == Recompute::kFull ? 2 : 1;
    e.cp_comm_bytes = nl * m * (forwards * cpm1 * kv * w.compute + cpm1 * kv * w.compute + l.cp * kv * 4.0);
  }
  if (!raw && t > 1) {
    const double act = static_cast<double>(s_rank) * l.micro_batch * spec.hidden_size * w.compute;
    const double per_layer_ops = l.recompute == Recompute::kFull ? 6 : 4;  // fwd 2, bwd 2, recompute 2
    e.tp_comm_bytes = nl * m * per_layer_ops * all_reduce(act, t);
    tp_time_bytes = e.tp_comm_bytes;
  }
  if (!raw && pp > 1) {
    double act = static_cast<double>(s_rank) * l.micro_batch * spec.hidden_size * w.compute;  // this rank's part
    if (l.sequence_parallel) act /= static_cast<double>(t);
    const double directions = (first || last) ? 1 : 2;
    e.pp_comm_bytes = directions * m * act;
  }
  const auto secs = [&](double bytes, bool intra) {
    return bytes / ((intra ? l.intra_node_gbps : l.inter_node_gbps) * 1e9);
  };
  const int64_t group = shard_weights ? N : dp;
  e.comm_seconds = secs(group_bytes, intra_node(t, group, gpn)) +
                   secs(replica_bytes, intra_node(t * group, dp / group, gpn)) +
                   secs(tp_time_bytes, intra_node(1, t, gpn)) + secs(e.pp_comm_bytes, intra_node(t * dp, pp, gpn)) +
                   secs(e.cp_comm_bytes, intra_node(t, l.cp, gpn));
}

// Stage `stage` of the layout, `nl` layers; `e` starts as the largest stage
// so far, with what every stage shares (dp, shard).
RankEstimate estimate_stage(RankEstimate e, const ModelSpec& spec, const Layout& l, const ParamCounts& c, int64_t stage,
                            int64_t nl, int64_t seq) {
  const Widths w = widths(l.precision);
  const bool raw = spec.shapeless();
  const int64_t t = l.tp, pp = l.pp, N = e.shard;
  e.worst_stage = stage;
  e.seq_len = raw ? 0 : seq;
  const bool first = stage == 0, last = stage == pp - 1;
  // Parameters of this stage's TP slice.
  int64_t layer_tp = ceil_div(c.per_layer_tp_split, t) + (c.per_layer - c.per_layer_tp_split);
  if (l.ep > 1) layer_tp -= c.per_layer_experts - ceil_div(c.per_layer_experts, l.ep);  // this rank's experts
  const int64_t emb_tp = ceil_div(c.embedding_tp_split, t) + (c.embedding - c.embedding_tp_split);
  const int64_t head_full = c.head > 0 ? c.head : (spec.tie_word_embeddings && pp > 1 ? c.embedding_tp_split : 0);
  const int64_t head_tp = ceil_div(head_full, t);
  int64_t params = raw ? spec.raw_params : nl * layer_tp;
  if (!raw && first) params += emb_tp;
  if (!raw && last) params += c.final_norm + c.pooler + head_tp;
  e.stage_params = params;
  e.trainable_params = params;
  if (l.lora_rank > 0) {
    e.trainable_params = nl * (l.lora_layer_params > 0 ? l.lora_layer_params
                                                       : lora_params_per_layer(spec, l.lora_rank, l.lora_targets, t));
    e.frozen_params = params;  // base weights stay, frozen
  }
  // QLoRA: the blocks' linear weights count as the weight-width parameters
  // their NF4 bytes equal (Pq of them stand for Q weights).
  const double Q = l.qlora ? static_cast<double>(ceil_div(nl * linear_params_per_layer(spec), t)) : 0.0;
  const double Pq = Q * kNf4BytesPerParam / w.weight;
  const double P = static_cast<double>(params) - Q + Pq, Tr = static_cast<double>(e.trainable_params);

  // Model states (ZeRO paper accounting; frozen LoRA bases have weights only).
  // Under expert parallelism a rank's experts are sharded over the N/ep
  // ranks that hold them (Note [Experts in the sharded engine]), so its
  // share of a sharded state counts them ep times before dividing by N.
  const double experts = l.ep > 1 && !raw ? static_cast<double>(nl * ceil_div(c.per_layer_experts, l.ep)) : 0.0;
  set_model_states(e, l, w, P, Tr, experts);

  // Activations of one micro-batch (Note [Activations of a run]), and what
  // comes and goes around them (peak.cpp, Note [The worst moment]).
  StageShape shape;
  shape.shapes = !raw;
  shape.layers = nl;
  shape.layer_params = static_cast<double>(layer_tp) - (nl > 0 ? (Q - Pq) / static_cast<double>(nl) : 0.0);
  shape.root_params = static_cast<double>((first ? emb_tp : 0) + (last ? c.final_norm + c.pooler + head_tp : 0));
  shape.params = P + (l.lora_rank > 0 ? Tr : 0);
  shape.trainable = Tr;
  shape.largest_tensor = raw ? P : static_cast<double>(ceil_div(c.largest_module, t));
  if (!raw) set_activations(shape, spec, l, w, stage, seq / l.cp);
  StageWidths sw;
  sw.weight = w.weight;
  sw.grad = w.grad;
  sw.compute = w.compute;
  sw.optimizer_state = w.optimizer / 2;
  add_transient_memory(shape, sw, l, N, e);
  e.total = e.params + e.gradients + e.master + e.optimizer + e.gathered + e.comm_buffers + e.activations + e.workspace;
  add_step_comm(e, spec, l, w, stage, nl, P, Tr, seq);
  return e;
}

}  // namespace

RankEstimate estimate_rank(const ModelSpec& spec, const Layout& l) {
  validate_layout(spec, l);
  const ParamCounts c = count_params(spec);
  const bool raw = spec.shapeless();
  const int64_t t = l.tp, pp = l.pp, dp = l.world_size / (t * pp * l.cp);
  // The ranks that hold the same parameters: dp x cp (Note [Context-parallel groups]).
  const int64_t dpc = dp * l.cp;
  const int64_t gpn = l.gpus_per_node;

  RankEstimate best;
  best.dp = dp;
  best.shard = 1;
  if (l.sharding != Sharding::kNone) best.shard = dpc;
  if (l.sharding == Sharding::kHybrid && gpn > 0) {
    // Shard over the dp ranks inside one node (Note [Rank grid]).
    best.shard = std::max<int64_t>(1, std::min(dpc, gpn / t));
    while (dpc % best.shard != 0) --best.shard;
  }
  const int64_t seq = l.seq_len > 0 ? l.seq_len : (spec.max_positions > 0 ? spec.max_positions : 2048);
  if (l.cp > 1 && seq % (2 * l.cp) != 0)
    throw UsageError("impossible layout: cp=" + std::to_string(l.cp) +
                     " needs a sequence length divisible by 2 x cp = " + std::to_string(2 * l.cp) + ", got " +
                     std::to_string(seq));

  best.total = -1;
  std::vector<int64_t> stage_layers(pp, 0);
  if (!raw) {
    const int64_t head = c.head > 0 ? c.head : (spec.tie_word_embeddings && pp > 1 ? c.embedding_tp_split : 0);
    if (pp > 1 && l.schedule != Schedule::kInterleaved)
      stage_layers = layers_per_stage(spec.num_layers, pp, static_cast<double>(c.per_layer),
                                      static_cast<double>(c.embedding), static_cast<double>(c.final_norm + head));
    else
      for (int64_t s = 0; s < pp; ++s) stage_layers[s] = spec.num_layers / pp + (s < spec.num_layers % pp ? 1 : 0);
  }
  for (int64_t stage = 0; stage < pp; ++stage) {
    const RankEstimate e = estimate_stage(best, spec, l, c, stage, raw ? 0 : stage_layers[stage], seq);
    if (e.total > best.total) best = e;
  }
  return best;
}

}  // namespace scaletrain::estimate

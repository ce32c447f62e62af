// Exact parameter and buffer counts from a model's structure. See model_spec.h.
//
// Note [What is counted]
// ----------------------
// Parameters: every nn.Parameter of the Hugging Face reference class, a tied
// LM head counted once (DeepSpeed's model_to_params dedups by data_ptr; a tied
// head has no storage of its own). The training model is the causal LM class
// for decoders and the base model with its pooler for encoders. Accelerate's
// estimate-memory builds `AutoModel.from_config`, i.e. the base model without
// the LM head: `base_model` is that count.
//
// Buffers are what the transformers 4.x classes register, as Accelerate's
// compute_module_sizes sees them (it walks named_module_tensors, persistent or
// not): a per-block causal mask (bool, max_positions^2) with an fp32 scalar, a
// model-level rotary inv_freq (fp32, head_dim/2), int64 position-id vectors in
// the embeddings. Which family registers which is models/spec_catalog.cpp's
// business. Accelerate sizes a bool element at 1/8 byte (its dtype_byte_size),
// so we do.
#include "scaletrain/estimate/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "scaletrain/util/error.h"

namespace scaletrain::estimate {
namespace {

int64_t head_dim_of(const ModelSpec& s) {
  if (s.head_dim > 0) return s.head_dim;
  if (s.num_heads <= 0 || s.hidden_size % s.num_heads != 0)
    throw UsageError("model '" + s.name + "': hidden_size " + std::to_string(s.hidden_size) +
                     " is not divisible by num_heads " + std::to_string(s.num_heads));
  return s.hidden_size / s.num_heads;
}

int64_t max_of(std::initializer_list<int64_t> v) { return *std::max_element(v.begin(), v.end()); }

}  // namespace

ParamCounts count_params(const ModelSpec& s) {
  ParamCounts c;
  if (s.shapeless()) {
    c.total = c.base_model = c.active = s.raw_params;
    return c;
  }
  if (s.hidden_size <= 0 || s.num_layers <= 0 || s.num_heads <= 0 || s.vocab_size <= 0)
    throw UsageError("model '" + s.name + "': hidden_size, num_layers, num_heads and vocab_size must be positive");
  const int64_t h = s.hidden_size, V = s.vocab_size, L = s.num_layers, I = s.intermediate_size;
  const int64_t P = s.max_positions, T = s.type_vocab_size;
  const int64_t hd = head_dim_of(s), nkv = s.num_kv_heads > 0 ? s.num_kv_heads : s.num_heads;
  const int64_t q_out = s.num_heads * hd, kv_out = nkv * hd;
  const int64_t norm = s.norm == Norm::kLayerNorm ? 2 * h : h;  // LayerNorm: weight and bias
  // A linear layer's elements: the weight, and the bias when it has one.
  auto linear = [](int64_t in, int64_t out, bool bias) { return in * out + (bias ? out : 0); };

  // Column-parallel layers (split by output, biases included) and row-parallel
  // ones (split by input; their biases replicate) of one block.
  std::vector<int64_t> column, row;
  if (s.fused_qkv) {
    column.push_back(linear(h, q_out + 2 * kv_out, s.qkv_bias));
  } else {
    column.push_back(linear(h, q_out, s.qkv_bias));
    column.push_back(linear(h, kv_out, s.qkv_bias));
    column.push_back(linear(h, kv_out, s.qkv_bias));
  }
  row.push_back(linear(q_out, h, s.o_bias));
  // The MLP, once per expert in an MoE block.
  const int64_t E = std::max<int64_t>(1, s.num_experts);
  for (int64_t e = 0; e < E; ++e) {
    column.push_back(linear(h, I, s.mlp_bias));
    if (s.gated_mlp) column.push_back(linear(h, I, s.mlp_bias));
    row.push_back(linear(I, h, s.mlp_bias));
  }
  const int64_t mlp = linear(h, I, s.mlp_bias) * (s.gated_mlp ? 2 : 1) + linear(I, h, s.mlp_bias);

  c.per_layer = 2 * norm + (s.num_experts > 0 ? h * s.num_experts : 0);  // an MoE block's router
  for (int64_t x : column) c.per_layer += x, c.per_layer_tp_split += x;
  for (int64_t x : row) c.per_layer += x;
  c.per_layer_tp_split += q_out * h + E * I * h;  // the row-parallel weights
  c.embedding = V * h + (s.learned_positions ? P * h : 0) + T * h + (s.encoder ? norm : 0);
  c.embedding_tp_split = V * h;
  c.final_norm = s.encoder ? 0 : norm;
  c.head = s.encoder || s.tie_word_embeddings ? 0 : V * h;
  c.pooler = s.encoder ? linear(h, h, true) : 0;
  c.largest_module = max_of({V * h, s.learned_positions ? P * h : 0, T * h, c.pooler});
  for (int64_t x : column) c.largest_module = std::max(c.largest_module, x);
  for (int64_t x : row) c.largest_module = std::max(c.largest_module, x);
  c.largest_linear = std::max(h * (s.fused_qkv ? q_out + 2 * kv_out : q_out), h * I);

  const double block_buffers = s.causal_mask_buffers ? static_cast<double>(P * P) / 8.0 + 4.0 : 0.0;
  const int64_t frequencies = hd / 2;  // one per pair of rotated dimensions
  const double rotary = s.rotary_buffer ? 4.0 * static_cast<double>(frequencies) : 0.0;
  const double position_ids = 8.0 * static_cast<double>(s.position_id_buffers * P);
  c.buffer_bytes = block_buffers * static_cast<double>(L) + rotary + position_ids;
  // Accelerate's units: each block (with its buffers), the embeddings as one
  // unit or each table as a leaf, the rotary buffer, the pooler.
  const double embeddings = s.embeddings_unit
                                ? 4.0 * static_cast<double>(c.embedding) + position_ids
                                : 4.0 * static_cast<double>(max_of({V * h, s.learned_positions ? P * h : 0, T * h}));
  c.largest_layer_bytes = std::max({embeddings, 4.0 * static_cast<double>(c.per_layer) + block_buffers, rotary,
                                    4.0 * static_cast<double>(c.pooler)});
  c.total = c.embedding + L * c.per_layer + c.final_norm + c.head + c.pooler;
  c.base_model = c.total - c.head;
  c.active = c.total - (s.num_experts > 0 ? L * (s.num_experts - s.experts_per_token) * mlp : 0);
  c.per_layer_experts = s.num_experts > 0 ? s.num_experts * mlp : 0;
  return c;
}

int64_t parse_param_count(const std::string& text) {
  std::string digits;
  for (char ch : text)
    if (ch != '_' && ch != ',') digits += ch;
  if (digits.empty()) return -1;
  double mult = 1;
  switch (std::tolower(static_cast<unsigned char>(digits.back()))) {
    case 'k': mult = 1e3; break;
    case 'm': mult = 1e6; break;
    case 'b': case 'g': mult = 1e9; break;
    case 't': mult = 1e12; break;
    default: break;
  }
  if (mult != 1) digits.pop_back();
  if (digits.empty() || !(std::isdigit(static_cast<unsigned char>(digits[0])) || digits[0] == '.')) return -1;
  char* end = nullptr;
  const double value = std::strtod(digits.c_str(), &end);
  if (end != digits.c_str() + digits.size() || !(value > 0) || !std::isfinite(value)) return -1;
  return std::llround(value * mult);
}

ModelSpec raw_count(const std::string& name, int64_t n) {
  ModelSpec s;
  s.name = name;
  s.family = "raw";
  s.raw_params = n;
  return s;
}

}  // namespace scaletrain::estimate

#pragma once
// What the estimator knows about a model: its architecture and shapes, and the
// exact parameter (and buffer) counts derived from them.
//
// A ModelSpec is built by the model families (models/spec_catalog.h: presets
// and Hugging Face config.json files) or from a raw parameter count ("7.5B").
// Counts follow from the structure the way the Hugging Face implementations
// build their modules, so they equal `sum(p.numel() for p in
// model.parameters())` of the reference model (see Note [What is counted]).
//
// Pure arithmetic: no libtorch.
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::estimate {

// How the norms of a block are built: LayerNorm has a weight and a bias and
// autograd keeps its input; RMSNorm (computed in fp32 and cast back) has a
// weight only and keeps its input and its normalized output.
enum class Norm { kLayerNorm, kRMSNorm };

// Shapes of a transformer, named after the Hugging Face config fields, and
// its structure: which modules a block has. The estimator counts from these
// alone; which family a model belongs to (and so which structure it has) is
// the model family's business (models/spec_catalog.h: presets, config.json).
struct ModelSpec {
  std::string name;               // preset name, config path or count, for titles
  std::string family;             // a label for titles and JSON; nothing here branches on it
  int64_t vocab_size = 0;         // rows of the token embedding
  int64_t hidden_size = 0;        // model width h
  int64_t num_layers = 0;         // transformer blocks L
  int64_t num_heads = 0;          // query heads a
  int64_t num_kv_heads = 0;       // key/value heads (GQA); equals num_heads for MHA
  int64_t head_dim = 0;           // per-head width; hidden_size / num_heads unless set
  int64_t intermediate_size = 0;  // MLP width
  int64_t max_positions = 0;      // learned position rows, or the context length
  int64_t type_vocab_size = 0;    // token-type embedding rows (0: none)
  bool tie_word_embeddings = false;  // LM head shares the token embedding

  // Structure of a block and of the ends of the model.
  Norm norm = Norm::kLayerNorm;
  bool fused_qkv = false;         // one h -> 3h projection (one module, one LoRA target)
  bool qkv_bias = false;          // biases on the query/key/value projections
  bool o_bias = false;            // bias on the attention output projection
  bool gated_mlp = false;         // gate, up and down projections: down(act(gate x) * up x)
  bool mlp_bias = false;          // biases on the MLP projections
  bool learned_positions = false; // a max_positions x h position table
  bool encoder = false;           // an encoder: embedding norm, a pooler (h x h + h), no final norm, no LM head
  // Sparse Mixture of Experts (Mixtral): each block's MLP is num_experts
  // copies plus a router (h x num_experts, no bias); a token runs
  // experts_per_token of them. 0: dense.
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;

  // Buffers, as Accelerate's size accounting sees them (Note [What is counted]).
  bool causal_mask_buffers = false;  // per block: a bool max_positions^2 mask and an fp32 scalar
  bool rotary_buffer = false;        // one fp32 inv_freq of head_dim/2 at model level
  int64_t position_id_buffers = 0;   // int64 vectors of max_positions inside the embeddings
  bool embeddings_unit = false;      // the embeddings are one no-split unit (else each table is a leaf)

  int64_t raw_params = 0;         // a bare parameter count: no shapes, model states only
  bool shapeless() const { return raw_params > 0; }
};

// Exact counts for a ModelSpec, split the way the sharding and tensor-parallel
// arithmetic needs them. All counts are numbers of elements.
struct ParamCounts {
  int64_t embedding = 0;             // token + position + type embeddings + embedding norm
  int64_t embedding_tp_split = 0;    // part of `embedding` split by tensor parallelism (vocab-parallel)
  int64_t per_layer = 0;             // one transformer block
  int64_t per_layer_tp_split = 0;    // part of a block split by TP (the big matrices, column biases)
  int64_t per_layer_experts = 0;     // part of a block in its MoE experts (split by expert parallelism)
  int64_t final_norm = 0;            // last norm (decoders); 0 for encoders
  int64_t head = 0;                  // untied LM head; 0 when tied or absent (encoders)
  int64_t pooler = 0;                // an encoder's pooler dense
  int64_t total = 0;                 // unique parameters of the training model (tied counted once)
  int64_t active = 0;                // of those, what one token computes with (MoE: k of E experts)
  int64_t base_model = 0;            // what transformers' AutoModel builds (no LM head): Accelerate's model
  int64_t largest_module = 0;        // most direct parameters of one module: DeepSpeed's largest_layer_params
  int64_t largest_linear = 0;        // biggest single matrix inside a block (LoRA / bucket sizing)
  // Buffers in Accelerate's accounting (bool elements count 1/8 byte, as its
  // dtype_byte_size does), fp32 model; see Note [What is counted].
  double buffer_bytes = 0;
  // Accelerate's "Largest Layer" in bytes for the fp32 AutoModel: the largest
  // leaf module or `_no_split_modules` unit, buffers included.
  double largest_layer_bytes = 0;
};

// Counts parameters and buffers. Throws UsageError for an inconsistent spec
// (e.g. hidden_size not divisible by num_heads without an explicit head_dim).
ParamCounts count_params(const ModelSpec& spec);

// "7.5B", "125M", "1.2e9", "350k", "7_000_000" -> element count; -1 if `text`
// is not a count.
int64_t parse_param_count(const std::string& text);

// A spec of `n` parameters and no shapes (a raw count).
ModelSpec raw_count(const std::string& name, int64_t n);

}  // namespace scaletrain::estimate

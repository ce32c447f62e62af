#pragma once
// What the estimator knows about a model: its architecture and shapes, and the
// exact parameter (and buffer) counts derived from them.
//
// A ModelSpec comes from a built-in preset ("gpt2", "llama-2-7b", ...), from a
// Hugging Face config.json, or from a raw parameter count ("7.5B"). Counts are
// derived from the architecture formulas of the Hugging Face implementations,
// so they equal `sum(p.numel() for p in model.parameters())` of the reference
// model (see Note [What is counted]).
//
// Pure arithmetic: no libtorch.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace scaletrain::estimate {

// The families the estimator can count exactly. kRaw is a bare parameter count
// with no shapes: only the model-state figures (not activations) can be derived.
enum class Arch { kGpt2, kLlama, kMistral, kBert, kRaw };

// "gpt2", "llama", "mistral", "bert", "raw".
const char* arch_name(Arch arch);

// Shapes of a transformer, named after the Hugging Face config fields.
struct ModelSpec {
  std::string name;               // preset name, config path or count, for titles
  Arch arch = Arch::kRaw;         // family; decides the counting formulas
  int64_t vocab_size = 0;         // rows of the token embedding
  int64_t hidden_size = 0;        // model width h
  int64_t num_layers = 0;         // transformer blocks L
  int64_t num_heads = 0;          // query heads a
  int64_t num_kv_heads = 0;       // key/value heads (GQA); equals num_heads for MHA
  int64_t head_dim = 0;           // per-head width; hidden_size / num_heads unless set
  int64_t intermediate_size = 0;  // MLP width (GPT-2: n_inner or 4h)
  int64_t max_positions = 0;      // learned position rows (GPT-2, BERT) / rope cache
  int64_t type_vocab_size = 0;    // BERT token-type embedding rows
  bool tie_word_embeddings = false;  // LM head shares the token embedding
  bool attention_bias = false;    // Llama/Mistral option: biases on q,k,v,o
  bool mlp_bias = false;          // Llama option: biases on gate, up, down
  int64_t raw_params = 0;         // kRaw only: the given parameter count
};

// Exact counts for a ModelSpec, split the way the sharding and tensor-parallel
// arithmetic needs them. All counts are numbers of elements.
struct ParamCounts {
  int64_t embedding = 0;             // token + position + type embeddings + embedding norm
  int64_t embedding_tp_split = 0;    // part of `embedding` split by tensor parallelism (vocab-parallel)
  int64_t per_layer = 0;             // one transformer block
  int64_t per_layer_tp_split = 0;    // part of a block split by TP (the big matrices, column biases)
  int64_t final_norm = 0;            // last norm (decoders); 0 for BERT
  int64_t head = 0;                  // untied LM head; 0 when tied or absent (BERT)
  int64_t pooler = 0;                // BERT pooler dense
  int64_t total = 0;                 // unique parameters of the training model (tied counted once)
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

// Built-in presets, canonical lower-case names ("gpt2", "llama-2-7b", ...).
std::vector<std::string> preset_names();

// A preset by name. Case-insensitive; a hub id ("meta-llama/Llama-2-7b-hf") is
// reduced to its last path part without "-hf". Throws UsageError listing the
// known presets when the name is unknown.
ModelSpec preset(const std::string& name);

// A spec from a parsed Hugging Face config.json. Throws UsageError naming the
// known architectures when model_type is unknown, or when a field is missing.
ModelSpec from_hf_config(const nlohmann::json& config, const std::string& name);

// Reads and parses a config.json file (UsageError if unreadable or malformed).
ModelSpec load_hf_config(const std::string& path);

// "7.5B", "125M", "1.2e9", "350k", "7_000_000" -> element count; -1 if `text`
// is not a count.
int64_t parse_param_count(const std::string& text);

// The MODEL argument of `estimate-memory`: a preset, a path to a config.json
// (or a directory holding one), or a raw count. UsageError otherwise.
ModelSpec resolve_model(const std::string& model);

}  // namespace scaletrain::estimate

#pragma once
// The typed configuration of a training run. Every field has its default here
// and a comment; config files (YAML) and `--section.key=value` overrides only
// fill these structs, and an unknown key is an error, never ignored.
//
// This folder is torch-free (it is built into scaletrain_core, which has no
// libtorch on its include path): the readers know a model only through its
// model.* keys, and what they need of the model itself comes in as a
// ModelWidth (train/plan/config.h passes the width train/plan/model_config.h resolves).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/precision/options.h"

namespace scaletrain::config {

struct ModelOptions {
  // tiny | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | llama-tiny | smollm2-135m | smollm2-360m |
  // tinyllama-1.1b | llama-2-7b | llama-3-8b | llama-3.1-8b | mixtral-tiny | mixtral-8x7b
  // (models::model_preset_names())
  std::string preset = "tiny";
  // A Hugging Face config.json (or a directory holding one) of model_type gpt2,
  // llama, mistral, qwen2 or mixtral (no sliding window): the architecture instead of the preset
  // ("" = the preset). The n_* keys below may only repeat its values;
  // block_size may shorten the sequence.
  std::string config;
  int64_t n_layer = 0;  // transformer blocks; 0 keeps the preset's value (same for the next six)
  int64_t n_head = 0;             // attention heads
  int64_t n_kv_head = 0;          // key/value heads (llama family: grouped-query attention)
  int64_t intermediate_size = 0;  // MLP width (llama family)
  int64_t n_embd = 0;             // hidden (embedding) width
  int64_t block_size = 0;  // sequence length trained on
  int64_t vocab_size = 0;         // token ids the embedding and head cover
  double dropout = 0.0;  // dropout probability
  // Mixture of Experts (model family mixtral, e.g. model.preset=mixtral-tiny;
  // Note [MoE routing] in models/moe.h). 0 (-1 for the aux coefficient)
  // keeps the preset's or the config.json's value.
  int64_t num_local_experts = 0;     // experts per MoE layer
  int64_t num_experts_per_tok = 0;   // experts each token runs (k)
  double router_aux_loss_coef = -1;  // load-balancing loss coefficient
  double router_z_loss_coef = 0.0;   // router z-loss coefficient
  double capacity_factor = 0.0;      // > 0: each expert takes at most ceil(cf * T * k / E) slots of a sequence; unset: dropless
  std::string moe_drop_policy = "probs";  // probs | position: which slots over capacity are dropped

  // Hugging Face weights to start from: a GPT-2 safetensors file, or a Hub directory (config.json +
  // safetensors) of a model_type model.config reads ("" = random init)
  std::string init_from;
  // A module library instead of a family: a shared library built against the
  // package that exports SCALETRAIN_MODULE_TASK (train/module_task.h), whose
  // module, loss and samples the module trainer trains with the other keys
  // ("" = the families). docs/own-model.md, "The CLI trains your module".
  std::string library;
  std::string library_args;  // text handed to the library's task function as it is
  // none | full: full keeps only each block's input for backward and
  // recomputes the block there (less activation memory, one more forward).
  std::string activation_checkpointing = "none";
  // flash | naive: how attention is computed (Note [Attention paths] in
  // models/attention.h); model.dropout > 0 needs naive.
  std::string attention = "flash";
  // true: the CPU kernels of kernels/: the head and its cross-entropy in one
  // chunked pass that never holds the [tokens, vocab] logits, the norms (with
  // the residual add) and activations in one pass each way, and AdamW in one
  // pass per element; false: the unfused ATen ops, for comparison.
  bool fused = true;
};

struct DataOptions {
  std::string path;  // token file written by `scaletrain prepare`, or its --shard-tokens directory (required)
  // Instead of path: several token files or shard directories with weights,
  // "PATH=WEIGHT,PATH=WEIGHT" or a YAML list of PATH=WEIGHT (Note [Mixture] in data/mixture.h).
  std::string mixture;
  // Tokenizer that prepared `path` (`prepare --tokenizer`): a tokenizer.json, or a
  // directory with one; the text sample encodes and decodes with it ("" = bytes).
  std::string tokenizer;
  // Which tokens the loss averages over (Note [Masked loss] in train/batches.h):
  // all | completion (prompt/completion records) | assistant (messages records).
  // The last two need a file `prepare` wrote from JSONL records of that kind.
  std::string loss_on = "all";
  // true: samples are block_size windows over the concatenated documents;
  // false: one record per sample, cut to block_size and padded (pads are
  // never targets). false needs a file prepared from JSONL records.
  bool packing = true;
  // concat | documents: with documents (and packing), attention stays inside
  // each document of a sample and the token after a boundary is no target
  // (Note [Packed documents] in models/attention.h). The boundaries are the
  // file's document index (files from JSONL records) or data.document_separator.
  std::string pack = "concat";
  // With pack: documents, positions restart at 0 at each document's first token.
  bool position_reset = true;
  // A token id that ends each document of a file without a document index
  // (e.g. the tokenizer's end-of-text id); -1: none.
  int64_t document_separator = -1;
};

struct TrainOptions {
  int64_t steps = 100;                         // optimizer steps
  int64_t global_batch = 32;                   // sequences per optimizer step, over all data-parallel ranks
  int64_t micro_batch = 8;                     // sequences per forward/backward; accumulation = global / (micro x dp)
  double lr = 1e-3;                            // peak learning rate
  int64_t warmup_steps = 10;                   // warmup (warmup_type), then lr_schedule's decay to min_lr_ratio x lr
  double min_lr_ratio = 0.1;                   // the decay's floor, as a fraction of lr
  double weight_decay = 0.1;                   // AdamW decoupled decay on matrices
  double beta1 = 0.9;                          // AdamW first-moment decay
  double beta2 = 0.95;                         // AdamW second-moment decay
  double eps = 1e-8;                           // AdamW denominator epsilon
  double grad_clip = 1.0;                      // max global gradient norm; 0 disables clipping
  std::string lr_schedule = "cosine";          // cosine | linear | constant: decay after warmup, to min_lr_ratio x lr
  std::string warmup_type = "linear";          // linear | log (DeepSpeed's log-shaped ramp)
  double warmup_start_ratio = 0;               // warmup starts from this fraction of lr (0: from ~0)
  uint64_t seed = 1337;                        // model init and sample order
  int64_t sample_tokens = 200;                 // length of the text sample printed at the end (0: none)
  std::string sample_prompt = "And God said";  // prompt of that sample
  // true: the prompt is one user message rendered with data.tokenizer's chat
  // template and its generation prompt (tokenizer_config.json's chat_template).
  bool sample_chat = false;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N (auto: the GPU numbered LOCAL_RANK if any, else CPU)
  int64_t stop_at = 0;  // stop after this step, as if preempted (the schedule still spans `steps`); 0 = steps
};

// parallel.fsdp: PyTorch FSDP's knobs, with its names and defaults.
struct FsdpOptions {
  // FULL_SHARD | SHARD_GRAD_OP | NO_SHARD (= DDP) | HYBRID_SHARD (shards within a
  // node, replicas across nodes: set parallel.dp_replicate to the node count)
  std::string sharding_strategy = "FULL_SHARD";
  std::string auto_wrap_policy = "transformer";    // transformer | size | none: what becomes an FSDP unit
  std::string transformer_layer_cls;               // class wrapped by the transformer policy; "": the model's blocks
  int64_t min_num_params = 100000000;              // size policy: wrap a subtree once it has this many parameters
  std::string backward_prefetch = "BACKWARD_PRE";  // BACKWARD_PRE | BACKWARD_POST | NONE: PyTorch FSDP's prefetch in backward
  bool forward_prefetch = false;                   // all-gather the next unit's parameters during this unit's forward
  bool limit_all_gathers = true;                   // at most two all-gathers in flight (bounds memory)
  bool offload_params = false;                     // keep parameter shards (and their gradients) in CPU memory
  bool sync_module_states = true;                  // broadcast rank 0's parameters and buffers at wrap time
  // No rank builds the whole model: each initializes only its shards, or reads only their
  // element ranges from model.init_from (what zero3 always does; Accelerate's name)
  bool cpu_ram_efficient_loading = false;
  std::string state_dict_type = "SHARDED_STATE_DICT";  // FULL_STATE_DICT | SHARDED_STATE_DICT: checkpoint layout
};

// parallel.zero: DeepSpeed ZeRO's knobs (sizes in MiB rather than elements).
struct ZeroOptions {
  double reduce_bucket_mb = 25;              // gradient reduce(-scatter) bucket size
  double allgather_bucket_mb = 25;           // parameter all-gather bucket size (stages 1-2)
  bool overlap_comm = true;                  // reduce gradients while backward still runs
  bool contiguous_gradients = true;          // copy gradients into one flat buffer as they are produced
  bool reduce_scatter = true;                // reduce gradients with reduce-scatter (false: all-reduce, keep own part)
  bool allgather_partitions = true;          // gather updated partitions with all-gather (false: one broadcast each)
  std::string offload_optimizer = "none";    // none | cpu | nvme: where optimizer states live
  std::string offload_param = "none";        // none | cpu | nvme: where parameter shards live (stage 3)
  std::string offload_dir;                   // directory of nvme offload files (required by nvme)
  bool offload_pin_memory = false;           // DeepSpeed's pin_memory: refused (offloaded state is page-locked on a GPU run, and a CPU run has nothing to pin)
  double prefetch_bucket_mb = 50;            // stage 3: parameters fetched ahead of use
  int64_t max_live_parameters = 1000000000;  // stage 3: gathered parameters kept before releasing
};

struct ParallelOptions {
  std::string strategy = "ddp";         // ddp | zero1 | zero2 | zero3 | fsdp: data parallelism, replicated or sharded
  int dp_replicate = 1;                 // mesh: outer data-parallel degree
  int dp_shard = -1;                    // mesh: inner data-parallel degree; -1 = the rest of the world
  int tp = 1;                           // tensor-parallel degree (Megatron style; with pp > 1, under ddp only)
  int pp = 1;                           // pipeline stages (parallel/pipeline)
  int ep = 1;                           // expert-parallel degree: MoE experts split over this many data-parallel ranks
  int cp = 1;                           // context-parallel degree: each sequence split over this many ranks
  std::string cp_mode = "ring";         // with cp > 1: ring | all_to_all (parallel/context)
  std::string schedule = "1f1b";        // with pp > 1: gpipe | 1f1b | interleaved
  int microbatches = 0;                 // with pp > 1: micro-batches per step; 0 = global / (micro_batch x dp)
  int virtual_stages = 1;               // model chunks per stage (interleaved only)
  std::string pp_balance = "params";    // cut blocks into stages by params | time (measured on rank 0)
  double bucket_cap_mb = 25;            // DDP bucket size in MiB
  double first_bucket_mb = 1;           // DDP's (and ZeRO-1/2's) first bucket size in MiB
  double last_bucket_mb = 1;            // DDP's (and ZeRO-1/2's) last bucket in MiB, growing 1.5x back; 0 = off
  bool find_unused_parameters = false;  // tolerate parameters without gradients
  bool sequence_parallel = false;       // with tp > 1: shard LayerNorm/dropout regions along the sequence
  std::string comm_dtype = "fp32";      // fp32 | bf16 | fp8 (Note [FP8 on the wire]): dtype gradients travel in
  std::string backend = "auto";         // auto | gloo | nccl (auto: NCCL for a CUDA device, Gloo for CPU)
  double timeout_s = 300;               // deadline of every collective and of the rendezvous
  bool debug_collectives = false;       // compare every collective's fingerprint across ranks first (slow)
  FsdpOptions fsdp;                     // used by strategy fsdp
  ZeroOptions zero;                     // used by strategies zero1..zero3
};

using precision::PrecisionOptions;

struct MetricsOptions {
  std::string path;       // JSON lines written by rank 0 ("" = none); a resumed run adds to the file
  double peak_flops = 0;  // per-rank peak FLOP/s for MFU; 0 = measure a GEMM at start
  int64_t log_every = 1;  // steps between log lines
  bool progress = true;   // progress bar when stdout is a terminal
  // Steps to trace (1-based, inclusive: {first, last}); empty: none. YAML
  // `[3, 4]` or a single step, `--metrics.trace_steps=3,4` (observe/tracing.h).
  std::vector<int64_t> trace_steps;
  std::string trace_dir = "trace";  // rank<N>.json per rank, trace.json merged (rank 0)
};

// checkpoint: sharded checkpoints (checkpoint/sharded.h).
struct CheckpointingOptions {
  std::string dir;              // root of the step-N directories ("" = no checkpoints)
  int64_t every = 0;            // steps between saves (0: only at the end of the run, when dir is set)
  int64_t keep = 0;             // complete checkpoints kept, newest first (0 = all)
  std::string resume = "auto";  // auto (newest complete checkpoint in dir, if any) | never | PATH of a step directory
  bool async = false;           // write in a background thread after a host copy
};

// What trains: the whole model, or low-rank adapters (LoRA, models/lora.h)
// on chosen linear layers with everything else frozen, as PEFT does it.
struct FinetuneOptions {
  std::string method = "full";  // full | lora | qlora
  int64_t r = 8;                // adapter rank
  double alpha = 8;             // the adapter's output is scaled by alpha / r (alpha / sqrt(r) with rslora)
  bool rslora = false;          // rank-stabilized scaling alpha / sqrt(r)
  double dropout = 0;           // dropout on the adapter's input, in training
  // Layer names ("q_proj,v_proj", or a YAML list), or all-linear (every
  // linear layer but the output head); "": the family's default, PEFT's.
  std::string target_modules;
  std::string init = "kaiming";  // kaiming | gaussian: A's initialization (B starts at zero)
  std::string bias = "none";     // none: biases stay frozen (the only choice)
  // qlora: the frozen base weights of every linear layer are kept in NF4
  // (blocks of 64, precision/nf4.h); with double_quant their per-block
  // scales are quantized to 8 bits too (bitsandbytes' bnb_4bit_use_double_quant).
  bool double_quant = true;
  // A PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
  // to start the adapters from instead of their initialization.
  std::string adapter_from;
};

struct Config {
  ModelOptions model;
  DataOptions data;
  TrainOptions train;
  ParallelOptions parallel;
  MetricsOptions metrics;
  PrecisionOptions precision;
  CheckpointingOptions checkpoint;
  FinetuneOptions finetune;
  // Not a key: "accepted, no effect on this build" lines that the config-file
  // readers (DeepSpeed JSON, Accelerate YAML) append, one per key, and that
  // rank 0 prints once at start ("scaletrain: note: ...").
  std::vector<std::string> notices;
};

// The width (n_embd) of the model that `model.*` describe. DeepSpeed files
// size their "auto" buckets from it, as the Hugging Face trainer does once it
// has the model (Note [DeepSpeed mapping]); it is called only for those.
using ModelWidth = std::function<int64_t(const ModelOptions&)>;

// Reads a YAML file of sections (model, data, train, parallel, metrics,
// precision, checkpoint, finetune) of scalar keys, with nested sub-sections (parallel: {fsdp: {...}})
// and the keys of Accelerate config files (accelerate_config.cpp, Note
// [Accelerate keys]; also the file named by SCALETRAIN_ACCELERATE_CONFIG, as
// `scaletrain launch --config_file` sets it), then applies overrides of the form
// "section.key=value" or "section.sub.key=value". Malformed YAML, unknown
// sections or keys, ill-typed values and values outside a key's choices throw
// UsageError naming the file, every such key and its problem. Without a
// `model_width`, a DeepSpeed "auto" size that needs it is a UsageError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {},
                   const ModelWidth& model_width = {});
// Applies one "section.key=value" to `config` (enum-like keys are checked here).
void apply_override(Config& config, const std::string& assignment);
// Checks values and their combinations; load_config calls it last.
void validate_config(const Config& config);
// Every known key, "section.key", for help texts and error messages.
std::vector<std::string> config_keys();
// The value of a key as text (numbers in full precision, bools true/false);
// comparing with a default Config tells which keys a run changed.
std::string config_value(const Config& config, const std::string& key);
// One row of the key table, as `scaletrain config keys` prints it and
// scripts/gen-config-doc.py writes docs/config.md from it.
struct ConfigKeyInfo {
  std::string key;                   // "section.key"
  std::string type;                  // int | float | bool | string | steps | choice
  std::string default_value;         // the value in a default Config, as text ("" = empty)
  std::vector<std::string> choices;  // a choice's values ("" may be one of them)
};
// Every key of the table, sorted by key.
std::vector<ConfigKeyInfo> config_key_table();

}  // namespace scaletrain::config

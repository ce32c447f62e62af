#pragma once
// The typed configuration of a training run. Every field has its default here
// and a comment; config files (YAML) and `--section.key=value` overrides only
// fill these structs, and an unknown key is an error, never ignored.
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::train {

struct ModelOptions {
  std::string preset = "tiny";  // tiny | gpt2 | gpt2-medium | gpt2-large | gpt2-xl
  int64_t n_layer = 0;          // 0 keeps the preset's value (same for the next four)
  int64_t n_head = 0;
  int64_t n_embd = 0;
  int64_t block_size = 0;       // sequence length trained on
  int64_t vocab_size = 0;
  double dropout = 0.0;         // dropout probability
};

struct DataOptions {
  std::string path;             // token file written by `scaletrain prepare` (required)
};

struct TrainOptions {
  int64_t steps = 100;          // optimizer steps
  int64_t global_batch = 32;    // sequences per optimizer step, over all data-parallel ranks
  int64_t micro_batch = 8;      // sequences per forward/backward; accumulation = global / (micro x dp)
  double lr = 1e-3;             // peak learning rate
  int64_t warmup_steps = 10;    // linear warmup, then cosine decay to min_lr_ratio x lr
  double min_lr_ratio = 0.1;
  double weight_decay = 0.1;    // AdamW decoupled decay on matrices
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;       // max global gradient norm; 0 disables clipping
  uint64_t seed = 1337;         // model init and sample order
  int64_t sample_tokens = 200;  // length of the text sample printed at the end (0: none)
  std::string sample_prompt = "And God said";  // prompt of that sample
};

struct ParallelOptions {
  std::string strategy = "ddp"; // ddp (later: zero1, zero2, zero3, fsdp)
  int dp_replicate = 1;         // mesh: outer data-parallel degree
  int dp_shard = -1;            // mesh: inner data-parallel degree; -1 = the rest of the world
  int tp = 1;                   // tensor-parallel degree (not yet supported: must be 1)
  int pp = 1;                   // pipeline stages (not yet supported: must be 1)
  double bucket_cap_mb = 25;    // DDP bucket size in MiB
  double first_bucket_mb = 1;   // DDP first bucket size in MiB
  bool find_unused_parameters = false;  // tolerate parameters without gradients
  std::string comm_dtype = "fp32";      // fp32 | bf16: dtype gradients travel in
  std::string backend = "auto"; // auto | gloo | nccl
  double timeout_s = 300;       // deadline of every collective and of the rendezvous
};

struct MetricsOptions {
  std::string path;             // JSON lines written by rank 0 ("" = none)
  double peak_flops = 0;        // per-rank peak FLOP/s for MFU; 0 = measure a GEMM at start
  int64_t log_every = 1;        // steps between log lines
  bool progress = true;         // progress bar when stdout is a terminal
};

struct Config {
  ModelOptions model;
  DataOptions data;
  TrainOptions train;
  ParallelOptions parallel;
  MetricsOptions metrics;
};

// Reads a YAML file of sections (model, data, train, parallel, metrics) of
// scalar keys, then applies overrides of the form "section.key=value".
// Malformed YAML, unknown sections or keys and ill-typed values throw
// UsageError naming the file, the key and the problem.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Applies one "section.key=value" to `config`.
void apply_override(Config& config, const std::string& assignment);
// Every known key, "section.key", for help texts and error messages.
std::vector<std::string> config_keys();

}  // namespace scaletrain::train

#pragma once
// The index of a sharded checkpoint and the directory it lives in.
//
// Note [Checkpoint directory]
// A checkpoint root holds one directory per saved step:
//
//   ROOT/step-000100/rank-00000.safetensors   what rank 0 owned (pieces, below)
//                    rank-00000.json          that file's pieces and checksum (a "part")
//                    rank-00001.safetensors   ...
//                    index.json               written last: the commit marker
//
// A step directory is complete exactly when index.json exists: rank 0 writes
// it only after every rank's files are durable (Note [Checkpoint commit] in
// sharded.h), through a temp file, fsync, rename and an fsync of the
// directory, so a crash at any point leaves either no index (the directory is
// ignored, and replaced by the next save of that step) or a whole one.
//
// Note [Checkpoint pieces]
// Every tensor (model parameter, or AdamW state of one) is stored flattened,
// in row-major order, as pieces: contiguous ranges [begin, begin + numel) of
// its flattened elements, each held by one file under the key
// "KIND/NAME@BEGIN" (KIND = model | exp_avg | exp_avg_sq), as a 1-D tensor. A
// DDP rank 0 saves each parameter as one piece; a sharded rank saves the
// parameter ranges its flat shards cover. The pieces of a tensor tile its
// flattened range exactly, whatever the layout that saved it, so any layout
// can load it by copying the overlap of each piece with what it owns now.
// Tensor- and pipeline-parallel layouts fit the same scheme: a TP shard is a
// set of flattened ranges of the full tensor (one per q/k/v block of a row
// split, one per row of a column split; tensor_parallel_layout in train/checkpoint_layout.h),
// a parameter replicated across tp is saved by tp rank 0 only, and a PP stage
// simply holds the pieces of its own parameters.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace scaletrain::checkpoint {

constexpr int kIndexVersion = 1;

// One contiguous range of a tensor's flattened elements, in one file.
struct PieceEntry {
  int file = 0;        // position in Index::files
  std::string key;     // tensor name inside that safetensors file
  int64_t begin = 0;   // first flattened element covered
  int64_t numel = 0;   // elements covered
  uint32_t crc32 = 0;  // of the piece's bytes (verified on load)
};

// One logical tensor of the checkpoint.
struct TensorEntry {
  std::vector<int64_t> shape;      // global shape
  std::string dtype = "F32";       // safetensors dtype name of the stored pieces
  std::vector<PieceEntry> pieces;  // sorted by begin; tile [0, numel) exactly
  int64_t numel() const;
};

// One file of the checkpoint, relative to its step directory.
struct FileEntry {
  std::string name;    // e.g. rank-00003.safetensors
  int rank = 0;        // the rank that wrote it
  int64_t bytes = 0;   // file size
  uint32_t crc32 = 0;  // of the whole file
};

// The model's shape, so a checkpoint can be consolidated without a config.
struct ModelShape {
  int64_t vocab_size = 0, block_size = 0, n_layer = 0, n_head = 0, n_embd = 0;
  bool bias = true;
  std::string family;  // models::ModelConfig::family; empty in indexes from before it was recorded (models::recorded_family)
  // The model's Hugging Face config.json (models::config_to_hf), as
  // compact JSON text: every dimension of any family, so `checkpoint export`
  // needs no run config. Empty in indexes written before it was recorded.
  std::string hf_config;
  // A finetune run's adapters (hub/peft_adapter.h): compact JSON of the
  // method and the adapters' settings, and the base model they apply to.
  // Such a checkpoint holds the adapters (and their optimizer state) only.
  // Empty for a run that trains every parameter.
  std::string finetune;
};

// Non-tensor training state (saved by rank 0; the same on every rank).
struct RunState {
  int64_t step = 0;                           // optimizer steps completed; also the LR schedule and sampler position
  int64_t optimizer_steps = 0;                // AdamW's bias-correction count (steps minus skipped overflow steps)
  std::map<std::string, double> loss_scaler;  // LossScalerState::to_map(); empty without loss scaling
  std::string rng_cpu;                        // hex of torch's default CPU generator state (rank 0's)
  std::vector<double> fp8_scaling;            // precision::fp8_scaling_state(); empty without delayed FP8 scaling
};

struct Index {
  int version = kIndexVersion;
  int64_t step = 0;
  int world_size = 1;
  std::string strategy;  // e.g. "zero3", "fsdp FULL_SHARD", "ddp"
  std::string mesh;      // Mesh dims description
  ModelShape model;
  RunState state;
  std::vector<FileEntry> files;
  std::map<std::string, TensorEntry> tensors;  // "model/NAME", "exp_avg/NAME", "exp_avg_sq/NAME" by parameter name
};

// JSON text of an index, and back. Parsing checks the version, that every
// piece names an existing file, and that each tensor's pieces tile its
// flattened range; errors are UsageError "checkpoint SOURCE: PROBLEM".
std::string index_to_json(const Index& index);
Index index_from_json(const std::string& text, const std::string& source);

// Reads DIR/index.json (UsageError when absent or malformed).
Index read_index(const std::string& step_dir);
// Writes DIR/index.json atomically and durably (Note [Checkpoint directory]).
void write_index(const std::string& step_dir, const Index& index);

// Writes `text` to `path` through a temp file, fsync, rename and an fsync of
// the directory. Throws UsageError naming the path.
void write_file_durably(const std::string& path, const std::string& text);

// "ROOT/step-000100".
std::string step_dir(const std::string& root, int64_t step);
// Complete step directories under `root` (those with index.json), oldest
// first; incomplete ones are never listed. Empty when root does not exist.
std::vector<std::string> complete_checkpoints(const std::string& root);
// The newest complete checkpoint under `root`, if any.
std::optional<std::string> newest_checkpoint(const std::string& root);
// Removes complete checkpoints beyond the newest `keep` (keep <= 0: none
// removed) and incomplete directories older than the newest complete one.
// Returns the removed directories.
std::vector<std::string> prune_checkpoints(const std::string& root, int keep);

// CRC-32 (zlib's) of bytes, incrementally: pass the previous value.
uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size);
// CRC-32 of a whole file (read in chunks).
uint32_t crc32_file(const std::string& path, int64_t* bytes = nullptr);

}  // namespace scaletrain::checkpoint

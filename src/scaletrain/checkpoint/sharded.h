#pragma once
// Sharded checkpoints: every rank saves only what it owns, any layout loads
// any checkpoint (Note [Checkpoint pieces] in index.h).
//
// Note [Full state dict]
// With CheckpointOptions::full (FSDP's FULL_STATE_DICT), step 2 below is
// replaced: every rank describes the pieces it would have written (tensor,
// range, dtype) and the descriptions are all-gathered, so every rank knows
// every tensor and who holds which range. Then, tensor by tensor in the
// file's data order, each holder sends its ranges to rank 0, which assembles
// the whole tensor and streams it into rank-00000.safetensors. Rank 0 holds
// one whole tensor (and one received buffer) at a time, never the model.
// The file's pieces are whole tensors, so loading (which copies overlaps of
// pieces) needs nothing new, under any layout.
//
// Note [Checkpoint commit]
// save(step), a collective over the world group:
//   1. rank 0 empties ROOT/step-N (a leftover of a crashed save) and creates
//      it; barrier.
//   2. each rank that owns state (DDP: rank 0; sharded: replica 0 of each
//      shard) writes rank-R.safetensors (temp file, fsync, rename) and then
//      rank-R.json, its part: pieces, per-piece CRC-32, the file's CRC-32.
//   3. barrier: every part is durable. Rank 0 reads the parts, writes
//      index.json (temp, fsync, rename, fsync of the directory) — the commit
//      marker — and prunes to the last `keep` complete checkpoints.
// With async, step 2 runs on a background thread over host copies (clones)
// of the tensors, and save() returns as soon as the copies are taken; step 3
// for that save is done at the start of the next save() or in finish(), after
// joining the thread (so rank R's files are durable) and a barrier (so every
// rank's are). A crash before step 3 leaves a directory without index.json,
// which loading never picks. The destructor only joins the thread: it never
// commits, because a barrier in a destructor (during unwinding) could hang.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/checkpoint/index.h"
#include "scaletrain/comm/group.h"

namespace scaletrain::checkpoint {

// Part of one parameter held in a slot's tensor.
struct SlotPiece {
  std::string name;            // the model's parameter name
  std::vector<int64_t> shape;  // the parameter's whole shape
  int64_t param_offset = 0;    // first flattened element of the parameter held
  int64_t local_offset = 0;    // where it sits in the slot's flattened tensor
  int64_t numel = 0;           // elements held
  // false: an identical copy on another rank is saved (a parameter replicated
  // across tensor parallelism); this rank still loads it.
  bool saved = true;
};

// One tensor this rank holds: a whole parameter (DDP) or a flat shard.
struct Slot {
  at::Tensor tensor;     // contiguous; written in place on load
  int optim_index = -1;  // its AdamW state index (-1: frozen, no state)
  std::vector<SlotPiece> pieces;
};

// What this rank holds and whether it saves it.
struct Layout {
  std::vector<Slot> slots;
  bool writer = true;    // false: an identical replica on another rank saves it
  std::string strategy;  // recorded in the index ("ddp", "zero3", "fsdp FULL_SHARD")
  std::string mesh;      // recorded in the index
};

// Whole parameters (DDP, one process): slot i is model->parameters()[i]; its
// optimizer state is its position among the parameters that require grad
// (frozen ones have none). `writer`: this rank saves.
Layout replicated_layout(const torch::nn::Module& model, bool writer);
// The engines describe what they hold with these types; the functions that
// build a Layout from an engine live with the training glue
// (train/checkpoint_layout.h), so checkpoints never depend on the engines.

struct CheckpointOptions {
  std::string root;    // directory of step-N directories
  int keep = 0;        // complete checkpoints kept (older ones removed by rank 0); 0 = all
  bool async = false;  // write in a background thread (Note [Checkpoint commit])
  // Rank 0 writes every tensor whole into one file, gathered from the ranks
  // one tensor at a time (Note [Full state dict]); false: each rank writes
  // what it owns. Both load under any layout. Not with async.
  bool full = false;
  // Files copied by rank 0 into every step directory when it commits, as
  // (name inside the step directory, source path): the run's tokenizer
  // files, so a checkpoint is self-contained (Note [Checkpoint assets]).
  std::vector<std::pair<std::string, std::string>> assets;
};

// Note [Checkpoint assets]
// A run's files that are not tensors (its tokenizer: tokenizer.json and the
// tokenizer_config.json / special_tokens_map.json beside it) are copied into
// the step directory under "tokenizer/" by rank 0 at commit, before
// index.json, and listed in the index's files (rank 0, size, CRC-32) like
// the rank files: verify_files checks them, and `checkpoint export` writes
// them beside the weights. A copy, not a path: the checkpoint stays whole
// when the run's files move or change, and costs a few MB at most.

// Non-tensor state passed through save and load.
struct SaveState {
  RunState run;      // step, optimizer steps, loss scaler, RNG
  ModelShape model;  // for consolidation
};

// What a checkpoint saves and restores of an optimizer: per layout slot
// (Slot::optim_index) one tensor of each kind the optimizer keeps (Adam's
// "exp_avg" and "exp_avg_sq", SGD's "momentum_buffer", ...), each the
// slot's size, and the step count. A checkpoint's tensors are named by
// kind, so one saved by another optimizer does not load ("has no tensor
// momentum_buffer/..."). OptimizerMoments adapts any optimizer with Adam's
// two moments as members (optim::AdamW), so this layer does not depend on
// optim/.
class OptimizerState {
 public:
  virtual ~OptimizerState() = default;
  virtual std::vector<std::string> kinds() const = 0;
  // Slot i's tensor of kinds()[kind]; values to load are written into it
  // and then handed to set_values (a copy where the optimizer stores
  // another form: Note [FP8 moments] in optim/adamw.h).
  virtual at::Tensor value(size_t kind, size_t i) const = 0;
  virtual void set_values(size_t i, const std::vector<at::Tensor>& values) = 0;
  virtual void set_steps(int64_t steps) = 0;
};

template <class Optimizer>
class OptimizerMoments final : public OptimizerState {
 public:
  explicit OptimizerMoments(Optimizer& o) : o_(o) {}
  std::vector<std::string> kinds() const override { return {"exp_avg", "exp_avg_sq"}; }
  at::Tensor value(size_t kind, size_t i) const override {
    return kind == 0 ? o_.exp_avg_value(i) : o_.exp_avg_sq_value(i);
  }
  void set_values(size_t i, const std::vector<at::Tensor>& v) override { o_.set_moments(i, v.at(0), v.at(1)); }
  void set_steps(int64_t steps) override { o_.set_steps(steps); }

 private:
  Optimizer& o_;
};

class Checkpointer {
 public:
  // `group`: every rank of the job (barriers); rank 0 of it commits.
  Checkpointer(comm::Group& group, CheckpointOptions options);
  ~Checkpointer();  // joins a background write; never commits
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective. Saves `layout`'s tensors and `opt`'s states (may be null)
  // for step state.run.step (Note [Checkpoint commit]).
  void save(const Layout& layout, const OptimizerState* opt, const SaveState& state);
  // Collective. Commits a pending asynchronous save.
  void finish();
  // Seconds the last save() blocked the caller.
  double last_stall_s() const { return last_stall_s_; }

 private:
  struct Pending;
  void commit_pending();  // join, barrier, rank 0 writes the index
  void write_full(const Layout& layout, const OptimizerState* opt, const std::string& dir);

  comm::Group& group_;
  CheckpointOptions options_;
  std::unique_ptr<Pending> pending_;
  double last_stall_s_ = 0;
};

// Note [One checkpoint directory]: every rank writes its part into ROOT and
// rank 0 reads them all to commit, so ROOT must be one directory on every
// node (a shared filesystem); a node with a local directory of the same
// name would write parts rank 0 never sees, and the first save would hang
// or fail far from the cause. Checked at the start (collective): rank 0
// writes a marker file with a fresh token into ROOT, and every rank reads
// it back; a rank that sees another file, or none, is named with its host
// on every rank (UsageError).
void check_shared_directory(comm::Group& group, const std::string& root);

// Writes a checkpoint of one process that holds everything (no group, no
// barrier): ROOT/step-N with rank 0's file and the index, as save() would on
// a world of one. For checkpoints made outside a run (an import). Returns the
// step directory; UsageError when it exists already (nothing is replaced).
std::string save_alone(const std::string& root, const Layout& layout, const OptimizerState* opt,
                       const SaveState& state);

// Loads the checkpoint in `step_dir` into `layout`'s tensors and `opt`'s
// states (may be null: model only). Each rank reads, from memory-mapped
// files, only the pieces that overlap what it holds, and verifies their
// checksums. Throws UsageError (one line naming the file or tensor) for a
// corrupt file, a missing tensor, or a shape mismatch. Replicated sharded
// strategies must call after_step() afterwards. Returns the index.
Index load_checkpoint(const std::string& step_dir, const Layout& layout, OptimizerState* opt);

// Reads whole tensors of a checkpoint ("model/" + parameter name) into the given
// tensors (numel must match; any dtype), one at a time; verifies checksums.
void read_tensors(const std::string& step_dir, const Index& index,
                  const std::vector<std::pair<std::string, at::Tensor>>& outs);

// Checks every file's size and CRC-32 against the index, and that each
// safetensors file parses and holds the pieces the index places in it;
// returns one line per bad file (empty: all good).
std::vector<std::string> verify_files(const std::string& step_dir, const Index& index);

// torch's default CPU generator state, as hex, and back.
std::string cpu_rng_state();
void set_cpu_rng_state(const std::string& hex);

}  // namespace scaletrain::checkpoint

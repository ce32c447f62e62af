#pragma once
// Fixed-length training samples over a memory-mapped token file.
//
// Sample i covers tokens [i*block, i*block + block + 1): the first `block`
// tokens are the model input and the same window shifted by one is the target
// (next-token prediction). Consecutive samples share one boundary token (the
// last target of sample i is the first input of sample i+1), so no token is
// wasted as a pure target, and num_samples = (count - 1) / block. The tail that
// does not fill a whole sample is dropped.
//
// Note [Loss targets]
// A version 2 token file (Note [Token file records]) marks which tokens are
// targets. With `use_mask`, a target position whose token is not marked gets
// kIgnoreIndex instead of its id, and the loss skips it (the trainer's loss
// averages over the targets of the global batch, Note [Masked loss] in
// train/trainer.cpp). Without `packing`, sample i is document i alone: its
// first block + 1 tokens, padded with pad_id inputs and kIgnoreIndex targets,
// so a pad is never a target and no attention crosses into another record;
// num_samples = the number of documents.
//
// This layer deliberately knows nothing about libtorch: it copies ids into
// caller-owned int64_t buffers, and the trainer wraps those buffers in tensors
// (int64 because that is what embedding lookups and cross-entropy targets take).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/data/token_file.h"

namespace scaletrain::data {

struct DatasetOptions {
  // Tokens per sample (the model's context length). Must be >= 1.
  int64_t block_size = 1024;
  // Targets not marked in the file's mask are ignored (Note [Loss targets]).
  bool use_mask = false;
  // false: one document per sample, padded (needs a version 2 file).
  bool packing = true;
  // Input id of padding (unpacked samples); a target pad is kIgnoreIndex.
  int64_t pad_id = 0;
};

// The target id the loss skips (as torch's cross_entropy ignore_index).
inline constexpr int64_t kIgnoreIndex = -100;

class TokenDataset {
 public:
  // Takes ownership of the mapped file. Throws UsageError if block_size < 1 or
  // the file holds fewer than block_size + 1 tokens (not even one sample).
  TokenDataset(TokenFile file, DatasetOptions options);
  // Convenience: opens `path` as a TokenFile (which validates it) first.
  TokenDataset(const std::string& path, DatasetOptions options);

  int64_t num_samples() const { return num_samples_; }
  int64_t block_size() const { return options_.block_size; }
  uint32_t vocab() const { return file_.vocab(); }
  const TokenFile& file() const { return file_; }

  // Copies sample `index` into inputs[0..block) and targets[0..block).
  // Either pointer may be null to skip that half. Throws std::out_of_range for
  // an index outside [0, num_samples()) (a caller bug, not user input), and
  // UsageError naming the file and offset if a token is >= vocab() (a corrupt
  // file: better to stop here than to index past an embedding table).
  void copy_sample(int64_t index, int64_t* inputs, int64_t* targets) const;

  // Copies the samples in `indices` as consecutive rows of a row-major
  // [indices.size(), block_size] matrix in each buffer; this is the shape a
  // micro-batch tensor wants, filled straight from DistributedSampler output.
  void copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const;

  // The number of targets (not kIgnoreIndex) in the samples `indices`,
  // without copying them: the loss's normalizer (Note [Masked loss]).
  int64_t count_targets(const std::vector<int64_t>& indices) const;
  // Unpacked: the documents longer than block_size + 1 (cut to it).
  int64_t truncated_documents() const { return truncated_; }

 private:
  template <typename T>
  void copy_window(const T* window, int64_t begin, int64_t length, int64_t* inputs, int64_t* targets) const;
  // Sample `index`'s first token and its length in tokens (inputs + 1).
  std::pair<int64_t, int64_t> span(int64_t index) const;

  TokenFile file_;
  DatasetOptions options_;
  int64_t num_samples_ = 0;
  int64_t truncated_ = 0;
};

}  // namespace scaletrain::data

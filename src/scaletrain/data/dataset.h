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
// This layer deliberately knows nothing about libtorch: it copies ids into
// caller-owned int64_t buffers, and the trainer wraps those buffers in tensors
// (int64 because that is what embedding lookups and cross-entropy targets take).
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/data/token_file.h"

namespace scaletrain::data {

struct DatasetOptions {
  // Tokens per sample (the model's context length). Must be >= 1.
  int64_t block_size = 1024;
};

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

 private:
  template <typename T>
  void copy_window(const T* window, int64_t index, int64_t* inputs, int64_t* targets) const;

  TokenFile file_;
  DatasetOptions options_;
  int64_t num_samples_ = 0;
};

}  // namespace scaletrain::data

#pragma once
// Fixed-length training samples over a memory-mapped token file.
//
// Note [Document segments]
// With DatasetOptions::documents a packed window knows where its documents
// begin: from the file's document index (files of JSONL records), or, in a
// file of text, after each occurrence of a separator id (the tokenizer's
// end-of-text). Token j of a window gets the segment id of its document
// (0 for the document the window starts in, counting up) and its position
// inside the document as far as the window sees it (the document the window
// starts in starts at 0 there); the target of the last token of a document,
// the next document's first token, is kIgnoreIndex. The model attends within
// segments (Note [Packed documents] in models/attention.h).
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
// train/batches.h). Without `packing`, sample i is document i alone: its
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
  // Packed documents (Note [Document segments]): each token of a window gets
  // the id of its document, and the token after a boundary is no target.
  bool documents = false;
  // With documents, for a file without a document index: the token id that
  // ends each document (-1: none; such a file is then refused).
  int64_t separator = -1;
};

// The target id the loss skips (as torch's cross_entropy ignore_index).
inline constexpr int64_t kIgnoreIndex = -100;

// What the trainer reads its samples from: one dataset (TokenDataset) or a
// weighted mixture of several (data/mixture.h). Sample i is a pure function of
// i, so the sampler's order (Note [Sampler invariant]) decides everything.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t num_samples() const = 0;
  virtual uint32_t vocab() const = 0;
  // As TokenDataset's below.
  virtual void copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const = 0;
  virtual int64_t count_targets(const std::vector<int64_t>& indices) const = 0;
  // With documents (Note [Document segments]): segment ids and positions of
  // the samples' input tokens, rows of [indices.size(), block_size]; either
  // pointer may be null.
  virtual void copy_layout(const std::vector<int64_t>& indices, int64_t* segments, int64_t* positions) const = 0;
  // One line for the run's log: what the samples are.
  virtual std::string describe() const = 0;
};

// Samples over one token file, or over the shards of a directory read as one
// stream of tokens and one list of documents (Note [Token shards]).
class TokenDataset : public SampleSource {
 public:
  // Takes ownership of the mapped file(s), all of one vocabulary, kind and
  // version. Throws UsageError if block_size < 1, the tokens are fewer than
  // block_size + 1 (not even one sample), or the options need what the file
  // lacks (a mask, documents).
  TokenDataset(TokenFile file, DatasetOptions options);
  TokenDataset(std::vector<TokenFile> shards, DatasetOptions options);
  // Convenience: opens `path`, a token file or a shard directory (which
  // validates it), first.
  TokenDataset(const std::string& path, DatasetOptions options);

  int64_t num_samples() const override { return num_samples_; }
  int64_t block_size() const { return options_.block_size; }
  uint32_t vocab() const override { return files_.front().vocab(); }
  std::string describe() const override;
  // The file, or the directory of the shards, for messages.
  const std::string& path() const { return path_; }
  // What the file(s) hold (Note [Token file records]).
  bool has_mask() const { return files_.front().has_mask(); }
  bool has_documents() const { return files_.front().has_documents(); }
  std::size_t documents() const { return static_cast<std::size_t>(doc_base_.back()); }
  RecordKind kind() const { return files_.front().kind(); }
  uint64_t tokens() const { return token_base_.back(); }

  // Copies sample `index` into inputs[0..block) and targets[0..block).
  // Either pointer may be null to skip that half. Throws std::out_of_range for
  // an index outside [0, num_samples()) (a caller bug, not user input), and
  // UsageError naming the file and offset if a token is >= vocab() (a corrupt
  // file: better to stop here than to index past an embedding table).
  void copy_sample(int64_t index, int64_t* inputs, int64_t* targets) const;

  // Copies the samples in `indices` as consecutive rows of a row-major
  // [indices.size(), block_size] matrix in each buffer; this is the shape a
  // micro-batch tensor wants, filled straight from DistributedSampler output.
  void copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const override;

  // The number of targets (not kIgnoreIndex) in the samples `indices`,
  // without copying them: the loss's normalizer (Note [Masked loss]).
  int64_t count_targets(const std::vector<int64_t>& indices) const override;
  void copy_layout(const std::vector<int64_t>& indices, int64_t* segments, int64_t* positions) const override;
  // The same for one sample (rows of block_size).
  void copy_sample_layout(int64_t index, int64_t* segments, int64_t* positions) const;
  // Unpacked: the documents longer than block_size + 1 (cut to it).
  int64_t truncated_documents() const { return truncated_; }

 private:
  // Sample `index`'s first token and its length in tokens (inputs + 1).
  std::pair<int64_t, int64_t> span(int64_t index) const;
  // Tokens [begin, begin + n) of the stream into out, checked against vocab().
  void read_tokens(int64_t begin, int64_t n, int64_t* out) const;
  // Whether token `at` of the stream is a target, and where document d starts.
  bool is_target(uint64_t at) const;
  uint64_t document_begin(std::size_t d) const;
  // Segment ids of the `length` tokens of `window`, read from stream
  // position `begin` (Note [Document segments]).
  std::vector<int64_t> segments(int64_t begin, int64_t length, const std::vector<int64_t>& window) const;
  std::size_t shard_of_token(uint64_t at) const;

  std::vector<TokenFile> files_;
  std::vector<uint64_t> token_base_{0};  // shard i is tokens [token_base_[i], token_base_[i + 1])
  std::vector<uint64_t> doc_base_{0};    // and documents [doc_base_[i], doc_base_[i + 1])
  std::string path_;
  DatasetOptions options_;
  int64_t num_samples_ = 0;
  int64_t truncated_ = 0;
};

}  // namespace scaletrain::data

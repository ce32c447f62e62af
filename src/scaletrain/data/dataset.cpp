#include "scaletrain/data/dataset.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "scaletrain/util/error.h"

namespace scaletrain::data {

TokenDataset::TokenDataset(TokenFile file, DatasetOptions options)
    : file_(std::move(file)), options_(options) {
  const int64_t block = options_.block_size;
  if (block < 1) {
    throw UsageError("token dataset " + file_.path() + ": block_size must be >= 1, got " +
                     std::to_string(block));
  }
  if (options_.use_mask && !file_.has_mask())
    throw UsageError("token dataset " + file_.path() +
                     ": has no target mask (prepared from plain text); data.loss_on must be all");
  if (options_.pad_id < 0 || options_.pad_id >= static_cast<int64_t>(file_.vocab()))
    throw UsageError("token dataset " + file_.path() + ": pad id " + std::to_string(options_.pad_id) +
                     " is not below the vocab size " + std::to_string(file_.vocab()));
  if (!options_.packing) {
    if (!file_.has_documents())
      throw UsageError("token dataset " + file_.path() +
                       ": data.packing=false needs records (prepare from JSONL); this file is plain text");
    num_samples_ = static_cast<int64_t>(file_.documents());
    for (std::size_t d = 0; d < file_.documents(); ++d)
      if (file_.document_begin(d + 1) - file_.document_begin(d) > static_cast<uint64_t>(block + 1)) ++truncated_;
    if (num_samples_ < 1) throw UsageError("token dataset " + file_.path() + ": holds no documents");
    return;
  }
  const auto count = static_cast<int64_t>(file_.size());
  if (count < block + 1) {
    throw UsageError("token dataset " + file_.path() + ": " + std::to_string(count) +
                     " tokens is too few for one sample of block_size " + std::to_string(block) +
                     " (needs " + std::to_string(block + 1) + ")");
  }
  num_samples_ = (count - 1) / block;
}

TokenDataset::TokenDataset(const std::string& path, DatasetOptions options)
    : TokenDataset(TokenFile(path), options) {}

std::pair<int64_t, int64_t> TokenDataset::span(int64_t index) const {
  if (index < 0 || index >= num_samples_) {
    throw std::out_of_range("TokenDataset: sample " + std::to_string(index) + " outside [0, " +
                            std::to_string(num_samples_) + ")");
  }
  const int64_t block = options_.block_size;
  if (options_.packing) return {index * block, block + 1};
  const auto d = static_cast<std::size_t>(index);
  const auto begin = static_cast<int64_t>(file_.document_begin(d));
  const auto length = static_cast<int64_t>(file_.document_begin(d + 1)) - begin;
  return {begin, std::min(length, block + 1)};
}

void TokenDataset::copy_sample(int64_t index, int64_t* inputs, int64_t* targets) const {
  const auto [begin, length] = span(index);
  file_.check_intact();
  if (file_.dtype() == kDtypeUint16) {
    copy_window(file_.data() + begin, begin, length, inputs, targets);
  } else {
    copy_window(file_.data32() + begin, begin, length, inputs, targets);
  }
}

// `window` holds `length` tokens from file position `begin`: inputs are all
// but the last, targets all but the first; the rest of the block is padding.
template <typename T>
void TokenDataset::copy_window(const T* window, int64_t begin, int64_t length, int64_t* inputs,
                               int64_t* targets) const {
  const int64_t block = options_.block_size;
  const uint32_t vocab = file_.vocab();
  for (int64_t j = 0; j < length; ++j) {
    if (window[j] >= vocab) {
      throw UsageError("token file " + file_.path() + ": token " + std::to_string(window[j]) +
                       " at position " + std::to_string(begin + j) +
                       " is not below the vocab size " + std::to_string(vocab));
    }
  }
  if (inputs != nullptr) {
    for (int64_t j = 0; j < block; ++j) inputs[j] = j + 1 < length ? window[j] : options_.pad_id;
  }
  if (targets != nullptr) {
    for (int64_t j = 0; j < block; ++j) {
      const bool real = j + 1 < length;
      const bool target = real && (!options_.use_mask || file_.is_target(static_cast<std::size_t>(begin + j + 1)));
      targets[j] = target ? static_cast<int64_t>(window[j + 1]) : kIgnoreIndex;
    }
  }
}

void TokenDataset::copy_batch(const std::vector<int64_t>& indices, int64_t* inputs,
                              int64_t* targets) const {
  const int64_t block = options_.block_size;
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const int64_t offset = static_cast<int64_t>(row) * block;
    copy_sample(indices[row], inputs ? inputs + offset : nullptr,
                targets ? targets + offset : nullptr);
  }
}

int64_t TokenDataset::count_targets(const std::vector<int64_t>& indices) const {
  int64_t n = 0;
  for (int64_t index : indices) {
    const auto [begin, length] = span(index);
    if (!options_.use_mask) {
      n += length - 1;
      continue;
    }
    for (int64_t j = 1; j < length; ++j) n += file_.is_target(static_cast<std::size_t>(begin + j)) ? 1 : 0;
  }
  return n;
}

}  // namespace scaletrain::data

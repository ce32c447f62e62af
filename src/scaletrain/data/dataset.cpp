#include "scaletrain/data/dataset.h"

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

void TokenDataset::copy_sample(int64_t index, int64_t* inputs, int64_t* targets) const {
  if (index < 0 || index >= num_samples_) {
    throw std::out_of_range("TokenDataset::copy_sample: index " + std::to_string(index) +
                            " outside [0, " + std::to_string(num_samples_) + ")");
  }
  const int64_t block = options_.block_size;
  file_.check_intact();
  if (file_.dtype() == kDtypeUint16) {
    copy_window(file_.data() + index * block, index, inputs, targets);
  } else {
    copy_window(file_.data32() + index * block, index, inputs, targets);
  }
}

template <typename T>
void TokenDataset::copy_window(const T* window, int64_t index, int64_t* inputs,
                               int64_t* targets) const {
  const int64_t block = options_.block_size;  // the window holds block + 1 tokens
  const uint32_t vocab = file_.vocab();
  for (int64_t j = 0; j <= block; ++j) {
    if (window[j] >= vocab) {
      throw UsageError("token file " + file_.path() + ": token " + std::to_string(window[j]) +
                       " at position " + std::to_string(index * block + j) +
                       " is not below the vocab size " + std::to_string(vocab));
    }
  }
  if (inputs != nullptr) {
    for (int64_t j = 0; j < block; ++j) inputs[j] = window[j];
  }
  if (targets != nullptr) {
    for (int64_t j = 0; j < block; ++j) targets[j] = window[j + 1];
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

}  // namespace scaletrain::data

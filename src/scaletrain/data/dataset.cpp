#include "scaletrain/data/dataset.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>
#include <utility>

#include "scaletrain/data/token_shards.h"
#include "scaletrain/util/error.h"

namespace scaletrain::data {
namespace {

std::vector<TokenFile> one(TokenFile f) {
  std::vector<TokenFile> v;
  v.push_back(std::move(f));
  return v;
}

std::vector<TokenFile> open_path(const std::string& path) {
  std::error_code ec;
  // Any directory is read as shards, so one without its index is named as such.
  if (std::filesystem::is_directory(path, ec)) return open_token_shards(path);
  return one(TokenFile(path));
}

}  // namespace

TokenDataset::TokenDataset(TokenFile file, DatasetOptions options) : TokenDataset(one(std::move(file)), options) {}

TokenDataset::TokenDataset(const std::string& path, DatasetOptions options) : TokenDataset(open_path(path), options) {
  path_ = path;
}

TokenDataset::TokenDataset(std::vector<TokenFile> shards, DatasetOptions options)
    : files_(std::move(shards)), options_(options) {
  if (files_.empty()) throw std::invalid_argument("TokenDataset: no token files");
  path_ = files_.size() == 1 ? files_.front().path() : files_.front().path() + " and its sibling shards";
  for (const TokenFile& f : files_) {
    if (f.vocab() != files_.front().vocab() || f.has_mask() != has_mask() || f.has_documents() != has_documents() ||
        f.kind() != kind())
      throw UsageError("token dataset " + f.path() + ": differs from " + files_.front().path() +
                       " in vocabulary, record kind or format");
    token_base_.push_back(token_base_.back() + f.size());
    doc_base_.push_back(doc_base_.back() + f.documents());
  }
  const int64_t block = options_.block_size;
  if (block < 1) throw UsageError("token dataset " + path_ + ": block_size must be >= 1, got " + std::to_string(block));
  if (options_.use_mask && !has_mask())
    throw UsageError("token dataset " + path_ +
                     ": has no target mask (prepared from plain text); data.loss_on must be all");
  if (options_.pad_id < 0 || options_.pad_id >= static_cast<int64_t>(vocab()))
    throw UsageError("token dataset " + path_ + ": pad id " + std::to_string(options_.pad_id) +
                     " is not below the vocab size " + std::to_string(vocab()));
  if (options_.separator < -1)
    throw UsageError("data.document_separator=" + std::to_string(options_.separator) + " is not a token id (-1: none)");
  if (options_.documents) {
    if (!options_.packing)
      throw UsageError("data.pack=documents needs data.packing=true (an unpacked sample is one document already)");
    if (has_documents() && options_.separator >= 0)
      throw UsageError("token dataset " + path_ + ": has a document index; data.document_separator=" +
                       std::to_string(options_.separator) + " would not be read (leave it unset)");
    if (!has_documents() && options_.separator < 0)
      throw UsageError("token dataset " + path_ +
                       ": plain text without a document index; data.pack=documents needs "
                       "data.document_separator, the token id that ends each document");
    if (options_.separator >= static_cast<int64_t>(vocab()))
      throw UsageError("data.document_separator=" + std::to_string(options_.separator) +
                       " is not below the vocab size " + std::to_string(vocab()));
  }
  if (!options_.packing) {
    if (!has_documents())
      throw UsageError("token dataset " + path_ +
                       ": data.packing=false needs records (prepare from JSONL); this file is plain text");
    num_samples_ = static_cast<int64_t>(documents());
    for (std::size_t d = 0; d < documents(); ++d)
      if (document_begin(d + 1) - document_begin(d) > static_cast<uint64_t>(block + 1)) ++truncated_;
    if (num_samples_ < 1) throw UsageError("token dataset " + path_ + ": holds no documents");
    return;
  }
  const auto count = static_cast<int64_t>(tokens());
  if (count < block + 1) {
    throw UsageError("token dataset " + path_ + ": " + std::to_string(count) +
                     " tokens is too few for one sample of block_size " + std::to_string(block) + " (needs " +
                     std::to_string(block + 1) + ")");
  }
  num_samples_ = (count - 1) / block;
}

std::string TokenDataset::describe() const {
  std::string out = path_ + ": ";
  if (!has_documents()) return out + std::to_string(tokens()) + " tokens of text, in windows";
  out += std::to_string(documents()) + " " + record_kind_name(kind()) + " records, ";
  if (options_.packing) return out + "packed into windows";
  return out + "one per sample (" + std::to_string(truncated_) + " cut to block_size + 1 tokens)";
}

std::size_t TokenDataset::shard_of_token(uint64_t at) const {
  return static_cast<std::size_t>(std::upper_bound(token_base_.begin(), token_base_.end(), at) - token_base_.begin()) -
         1;
}

bool TokenDataset::is_target(uint64_t at) const {
  const std::size_t s = files_.size() == 1 ? 0 : shard_of_token(at);
  return files_[s].is_target(static_cast<std::size_t>(at - token_base_[s]));
}

uint64_t TokenDataset::document_begin(std::size_t d) const {
  if (files_.size() == 1) return files_.front().document_begin(d);
  if (d >= documents()) return tokens();
  const auto s =
      static_cast<std::size_t>(std::upper_bound(doc_base_.begin(), doc_base_.end(), d) - doc_base_.begin()) - 1;
  return token_base_[s] + files_[s].document_begin(d - doc_base_[s]);
}

std::pair<int64_t, int64_t> TokenDataset::span(int64_t index) const {
  if (index < 0 || index >= num_samples_) {
    throw std::out_of_range("TokenDataset: sample " + std::to_string(index) + " outside [0, " +
                            std::to_string(num_samples_) + ")");
  }
  const int64_t block = options_.block_size;
  if (options_.packing) return {index * block, block + 1};
  const auto d = static_cast<std::size_t>(index);
  const auto begin = static_cast<int64_t>(document_begin(d));
  const auto length = static_cast<int64_t>(document_begin(d + 1)) - begin;
  return {begin, std::min(length, block + 1)};
}

void TokenDataset::read_tokens(int64_t begin, int64_t n, int64_t* out) const {
  const uint32_t vocab = this->vocab();
  for (int64_t done = 0; done < n;) {
    const auto at = static_cast<uint64_t>(begin + done);
    const std::size_t s = files_.size() == 1 ? 0 : shard_of_token(at);
    const TokenFile& f = files_[s];
    f.check_intact();
    const std::size_t local = static_cast<std::size_t>(at - token_base_[s]);
    if (local >= f.size())
      throw std::logic_error("TokenDataset: token " + std::to_string(at) + " is not in shard " + std::to_string(s));
    const int64_t take = std::min<int64_t>(n - done, static_cast<int64_t>(f.size() - local));
    for (int64_t j = 0; j < take; ++j) {
      const uint32_t id = f.at(local + static_cast<std::size_t>(j));
      if (id >= vocab)
        throw UsageError("token file " + f.path() + ": token " + std::to_string(id) + " at position " +
                         std::to_string(local + static_cast<std::size_t>(j)) + " is not below the vocab size " +
                         std::to_string(vocab));
      out[done + j] = id;
    }
    done += take;
  }
}

// The window of `length` tokens from stream position `begin`: inputs are all
// but the last, targets all but the first; the rest of the block is padding.
void TokenDataset::copy_sample(int64_t index, int64_t* inputs, int64_t* targets) const {
  const auto [begin, length] = span(index);
  const int64_t block = options_.block_size;
  std::vector<int64_t> window(static_cast<std::size_t>(length));
  read_tokens(begin, length, window.data());
  if (inputs != nullptr) {
    for (int64_t j = 0; j < block; ++j)
      inputs[j] = j + 1 < length ? window[static_cast<std::size_t>(j)] : options_.pad_id;
  }
  if (targets != nullptr) {
    std::vector<int64_t> seg;
    if (options_.documents) seg = segments(begin, length, window);
    for (int64_t j = 0; j < block; ++j) {
      const bool real = j + 1 < length;
      bool target = real && (!options_.use_mask || is_target(static_cast<uint64_t>(begin + j + 1)));
      if (target && !seg.empty()) target = seg[static_cast<std::size_t>(j)] == seg[static_cast<std::size_t>(j + 1)];
      targets[j] = target ? window[static_cast<std::size_t>(j + 1)] : kIgnoreIndex;
    }
  }
}

std::vector<int64_t> TokenDataset::segments(int64_t begin, int64_t length, const std::vector<int64_t>& window) const {
  std::vector<int64_t> seg(static_cast<std::size_t>(length), 0);
  if (!has_documents()) {  // a new document after each separator
    for (int64_t j = 1; j < length; ++j)
      seg[static_cast<std::size_t>(j)] =
          seg[static_cast<std::size_t>(j - 1)] + (window[static_cast<std::size_t>(j - 1)] == options_.separator);
    return seg;
  }
  // The document holding token `begin`: the last whose first token is <= begin.
  std::size_t lo = 0, hi = documents();
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (document_begin(mid) <= static_cast<uint64_t>(begin) ? lo : hi) = mid;
  }
  uint64_t next = document_begin(lo + 1);
  int64_t id = 0;
  for (int64_t j = 0; j < length; ++j) {
    while (static_cast<uint64_t>(begin + j) >= next && next < tokens()) next = document_begin(lo + 1 + ++id);
    seg[static_cast<std::size_t>(j)] = id;
  }
  return seg;
}

void TokenDataset::copy_sample_layout(int64_t index, int64_t* segments_out, int64_t* positions) const {
  if (!options_.documents) throw std::logic_error("TokenDataset: copy_layout without data.pack=documents");
  const auto [begin, length] = span(index);
  std::vector<int64_t> window(static_cast<std::size_t>(length));
  if (!has_documents()) read_tokens(begin, length, window.data());
  const std::vector<int64_t> seg = segments(begin, length, window);
  int64_t start = 0;  // first token of the current segment
  for (int64_t j = 0; j < options_.block_size; ++j) {
    const int64_t s = seg[static_cast<std::size_t>(std::min(j, length - 1))];
    if (j > 0 && s != seg[static_cast<std::size_t>(std::min(j - 1, length - 1))]) start = j;
    if (segments_out != nullptr) segments_out[j] = s;
    if (positions != nullptr) positions[j] = j - start;
  }
}

void TokenDataset::copy_layout(const std::vector<int64_t>& indices, int64_t* segments_out, int64_t* positions) const {
  const int64_t block = options_.block_size;
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const int64_t offset = static_cast<int64_t>(row) * block;
    copy_sample_layout(indices[row], segments_out ? segments_out + offset : nullptr,
                       positions ? positions + offset : nullptr);
  }
}

void TokenDataset::copy_batch(const std::vector<int64_t>& indices, int64_t* inputs, int64_t* targets) const {
  const int64_t block = options_.block_size;
  for (std::size_t row = 0; row < indices.size(); ++row) {
    const int64_t offset = static_cast<int64_t>(row) * block;
    copy_sample(indices[row], inputs ? inputs + offset : nullptr, targets ? targets + offset : nullptr);
  }
}

int64_t TokenDataset::count_targets(const std::vector<int64_t>& indices) const {
  int64_t n = 0;
  for (int64_t index : indices) {
    const auto [begin, length] = span(index);
    if (options_.documents) {  // as copy_sample decides
      std::vector<int64_t> targets(static_cast<std::size_t>(options_.block_size));
      copy_sample(index, nullptr, targets.data());
      for (int64_t t : targets) n += t != kIgnoreIndex ? 1 : 0;
      continue;
    }
    if (!options_.use_mask) {
      n += length - 1;
      continue;
    }
    for (int64_t j = 1; j < length; ++j) n += is_target(static_cast<uint64_t>(begin + j)) ? 1 : 0;
  }
  return n;
}

}  // namespace scaletrain::data

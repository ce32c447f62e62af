#include "scaletrain/data/bpe.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "scaletrain/data/utf8.h"
#include "scaletrain/util/error.h"

namespace scaletrain::data {
namespace {

constexpr uint32_t kNone = UINT32_MAX;
constexpr uint64_t kEmptyKey = UINT64_MAX;

uint64_t pair_key(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

std::string byte_token(unsigned b) {
  char name[8];
  std::snprintf(name, sizeof(name), "<0x%02X>", b);
  return name;
}

}  // namespace

// ------------------------------------------------------------------ PairTable

void BpeModel::PairTable::reserve(std::size_t n) {
  std::size_t cap = 16;
  while (cap < 2 * n) cap <<= 1;  // load factor <= 1/2 keeps probe chains short
  keys_.assign(cap, kEmptyKey);
  values_.assign(cap, Merge{0, 0});
  mask_ = cap - 1;
}

std::size_t BpeModel::PairTable::slot(uint64_t key) const {
  // Fibonacci hashing: the ids in a key are small and dense, so mix them.
  return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ULL) >> 20) & mask_;
}

bool BpeModel::PairTable::insert(uint32_t a, uint32_t b, Merge m) {
  const uint64_t key = pair_key(a, b);
  for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
    if (keys_[i] == key) return false;
    if (keys_[i] == kEmptyKey) {
      keys_[i] = key;
      values_[i] = m;
      return true;
    }
  }
}

const BpeModel::Merge* BpeModel::PairTable::find(uint32_t a, uint32_t b) const {
  if (keys_.empty()) return nullptr;
  const uint64_t key = pair_key(a, b);
  for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
    if (keys_[i] == key) return &values_[i];
    if (keys_[i] == kEmptyKey) return nullptr;
  }
}

// ------------------------------------------------------------------ BpeModel

BpeModel::BpeModel(std::unordered_map<std::string, uint32_t> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
                   const std::string& source)
    : vocab_(std::move(vocab)), options_(options) {
  auto id_of = [&](const std::string& t) -> uint32_t {
    auto it = vocab_.find(t);
    return it == vocab_.end() ? kNone : it->second;
  };
  pairs_.reserve(merges.size());
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const uint32_t ia = id_of(a), ib = id_of(b), merged = id_of(a + b);
    if (ia == kNone || ib == kNone || merged == kNone) {
      const std::string& missing = ia == kNone ? a : ib == kNone ? b : a + b;
      throw UsageError(source + ": merge " + std::to_string(rank) + " needs the token '" + missing +
                       "', which is not in the vocabulary");
    }
    // A repeated merge keeps its first (lowest) rank, as the references do.
    if (pairs_.insert(ia, ib, Merge{static_cast<uint32_t>(rank), merged})) ++merge_count_;
  }
  for (unsigned b = 0; b < 256; ++b) {
    byte_ids_[b] = id_of(std::string(1, static_cast<char>(b)));
    fallback_ids_[b] = id_of(byte_token(b));
  }
}

std::optional<uint32_t> BpeModel::find(std::string_view bytes) const {
  auto it = vocab_.find(std::string(bytes));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::encode(std::string_view word, std::vector<uint32_t>& out) {
  if (word.empty()) return;
  const bool cacheable = options_.cache_words > 0 && word.size() <= options_.cache_max_word_bytes;
  if (cacheable) {
    key_.assign(word.data(), word.size());
    auto hit = cache_.find(key_);
    if (hit != cache_.end()) {
      const auto [offset, count] = hit->second;
      out.insert(out.end(), cache_ids_.begin() + offset, cache_ids_.begin() + offset + count);
      return;
    }
  }
  const std::size_t first = out.size();
  std::optional<uint32_t> whole;
  if (options_.ignore_merges) whole = find(word);
  if (whole) {
    out.push_back(*whole);
  } else {
    initial_symbols(word);
    merge_symbols(out);
  }
  if (cacheable) {
    if (cache_.size() >= options_.cache_words) {
      cache_.clear();
      cache_ids_.clear();
    }
    const auto offset = static_cast<uint32_t>(cache_ids_.size());
    cache_ids_.insert(cache_ids_.end(), out.begin() + first, out.end());
    cache_.emplace(key_, std::make_pair(offset, static_cast<uint32_t>(out.size() - first)));
  }
}

void BpeModel::initial_symbols(std::string_view word) {
  symbols_.clear();
  auto add = [&](uint32_t id) {
    const auto i = static_cast<int32_t>(symbols_.size());
    symbols_.push_back(Symbol{id, i - 1, -1});
    if (i > 0) symbols_[i - 1].next = i;
  };
  auto unknown = [&](std::string_view what) {
    if (!options_.unk_id) {
      std::string hex;
      for (unsigned char c : what) hex += byte_token(c);
      throw UsageError("the tokenizer has no token for the text " + hex + " (and no unknown token)");
    }
    // fuse_unk: a run of unknown characters is one unknown token.
    if (options_.fuse_unk && !symbols_.empty() && symbols_.back().id == *options_.unk_id) return;
    add(*options_.unk_id);
  };
  if (options_.byte_level) {
    for (std::size_t i = 0; i < word.size(); ++i) {
      const uint32_t id = byte_ids_[static_cast<unsigned char>(word[i])];
      if (id != kNone) {
        add(id);
      } else {
        unknown(word.substr(i, 1));
      }
    }
    return;
  }
  for (std::size_t i = 0; i < word.size();) {
    const std::size_t len = std::min(utf8::char_len(static_cast<unsigned char>(word[i])), word.size() - i);
    const std::string_view ch = word.substr(i, len);
    uint32_t id = len == 1 ? byte_ids_[static_cast<unsigned char>(ch[0])] : kNone;
    if (id == kNone && len > 1) {
      if (auto found = find(ch)) id = *found;
    }
    if (id != kNone) {
      add(id);
    } else if (options_.byte_fallback && std::all_of(ch.begin(), ch.end(), [&](char c) {
                 return fallback_ids_[static_cast<unsigned char>(c)] != kNone;
               })) {
      for (char c : ch) add(fallback_ids_[static_cast<unsigned char>(c)]);
    } else {
      unknown(ch);
    }
    i += len;
  }
}

void BpeModel::push_candidate(int32_t left) {
  const int32_t right = symbols_[left].next;
  if (right < 0) return;
  const Merge* m = pairs_.find(symbols_[left].id, symbols_[right].id);
  if (m == nullptr) return;
  heap_.push_back(Candidate{m->rank, left, symbols_[left].id, symbols_[right].id});
  std::push_heap(heap_.begin(), heap_.end(), std::greater<>());
}

// Note [BPE merge order].
void BpeModel::merge_symbols(std::vector<uint32_t>& out) {
  heap_.clear();
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols_.size()); ++i) push_candidate(i);
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), std::greater<>());
    const Candidate c = heap_.back();
    heap_.pop_back();
    Symbol& left = symbols_[c.left];
    if (left.id != c.left_id || left.next < 0) continue;  // stale: the left half merged away
    Symbol& right = symbols_[left.next];
    if (right.id != c.right_id) continue;  // stale: the right half changed
    left.id = pairs_.find(c.left_id, c.right_id)->result;
    left.next = right.next;
    if (right.next >= 0) symbols_[right.next].prev = c.left;
    right.id = kNone;  // dead; no live symbol points at it any more
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(c.left);
  }
  for (int32_t i = symbols_.empty() ? -1 : 0; i >= 0; i = symbols_[i].next) out.push_back(symbols_[i].id);
}

}  // namespace scaletrain::data

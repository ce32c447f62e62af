#pragma once
// The byte-pair-encoding merge engine behind the tokenizer.json tokenizers
// (data/hf_tokenizer.h): a vocabulary of byte strings, a ranked list of
// merges, and a word -> ids function with a cache.
//
// Note [BPE merge order]
// A word starts as a sequence of symbols (one per byte for byte-level
// models, one per UTF-8 character otherwise). The merge with the lowest rank
// among all adjacent pairs is applied, at its leftmost occurrence first, and
// this repeats until no adjacent pair has a merge. That is the order of the
// reference implementations (GPT-2's encoder, Hugging Face tokenizers): the
// classic loop "find the lowest-ranked pair, merge every occurrence left to
// right" gives the same result, because a merge's output only ever takes part
// in merges of higher rank (a merge can only be learned once its inputs
// exist). We keep the symbols in a linked list and the candidate pairs in a
// min-heap keyed by (rank, position), so a word of n symbols costs O(n log n);
// that matters for SentencePiece-style files, whose normalizer makes a whole
// line (or a whole file, for `prepare`) a single word. Heap entries are not
// removed when a neighbour merges; an entry is checked when popped and skipped
// if its two symbols are no longer there.
//
// Note [Byte-level vocabularies]
// GPT-2-style vocabularies spell every byte as a printable character (the
// "byte-level alphabet": 'Ġ' is the space byte). We decode the keys back to
// raw bytes once at load, so the engine works on the input bytes directly and
// the text is never transcoded into that alphabet.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace scaletrain::data {

struct BpeOptions {
  // Symbols start as single bytes (byte-level BPE); otherwise as UTF-8 characters.
  bool byte_level = false;
  // A character missing from the vocabulary becomes its UTF-8 bytes as the
  // tokens "<0xXX>" (SentencePiece's byte fallback) instead of the unknown token.
  bool byte_fallback = false;
  // A word that is itself in the vocabulary is one token, merges or not (Llama 3).
  bool ignore_merges = false;
  // Id of the unknown token, if the model has one.
  std::optional<uint32_t> unk_id;
  // Consecutive unknown characters become one unknown token.
  bool fuse_unk = false;
  // Words remembered with their ids; the cache is emptied when it is full (0 = no cache).
  std::size_t cache_words = 1 << 18;
  // Longer words are not cached (they rarely repeat and would crowd the cache).
  std::size_t cache_max_word_bytes = 128;
};

// Not thread-safe: encode() updates the word cache and reuses scratch buffers.
// Use one object per thread.
class BpeModel {
 public:
  // `vocab`: token bytes -> id (byte-level keys already decoded, Note
  // [Byte-level vocabularies]). `merges`: pairs of token byte strings, rank =
  // index. Problems (a merge naming a token that is not in the vocabulary, or
  // whose result is not) throw UsageError prefixed with `source`.
  BpeModel(std::unordered_map<std::string, uint32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
           const std::string& source);

  // Appends the ids of one pre-tokenized word to `out`. Throws UsageError if
  // a character has no token and the model has neither byte fallback nor an
  // unknown token.
  void encode(std::string_view word, std::vector<uint32_t>& out);

  // Id of the token whose bytes are exactly `bytes`, if there is one.
  std::optional<uint32_t> find(std::string_view bytes) const;

  std::size_t num_merges() const { return merge_count_; }
  const BpeOptions& options() const { return options_; }

 private:
  struct Merge {
    uint32_t rank;
    uint32_t result;
  };
  // Open-addressing map from an ordered id pair to its merge.
  class PairTable {
   public:
    void reserve(std::size_t n);
    // False if the pair was already there (the first, lowest rank, wins).
    bool insert(uint32_t a, uint32_t b, Merge m);
    const Merge* find(uint32_t a, uint32_t b) const;

   private:
    std::size_t slot(uint64_t key) const;
    std::vector<uint64_t> keys_;
    std::vector<Merge> values_;
    std::size_t mask_ = 0;
  };
  struct Symbol {
    uint32_t id;
    int32_t prev, next;  // neighbours in the linked list (-1: none)
  };
  struct Candidate {
    uint32_t rank;
    int32_t left;  // symbol index of the pair's left half
    uint32_t left_id, right_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };

  void initial_symbols(std::string_view word);
  void push_candidate(int32_t left);
  void merge_symbols(std::vector<uint32_t>& out);

  std::unordered_map<std::string, uint32_t> vocab_;
  PairTable pairs_;
  std::size_t merge_count_ = 0;
  BpeOptions options_;
  uint32_t byte_ids_[256];      // byte-level: id of each single byte (kNone if absent)
  uint32_t fallback_ids_[256];  // byte fallback: id of "<0xXX>" (kNone if absent)
  // Scratch reused across calls (no allocation per word once warm).
  std::vector<Symbol> symbols_;
  std::vector<Candidate> heap_;
  std::string key_;
  // Word cache: bytes -> (offset, count) into cache_ids_.
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>> cache_;
  std::vector<uint32_t> cache_ids_;
};

}  // namespace scaletrain::data

#pragma once
// A dataset larger than one file: a directory of token files and an index.
//
// Note [Token shards]
// `prepare --shard-tokens N` writes DIR/shard-00000.tok, shard-00001.tok, ...
// (each a version 2 token file, Note [Token file records], of whole
// documents, about N tokens each) and then DIR/index.json:
//   {"format": "scaletrain token shards", "version": 1, "vocab": V,
//    "kind": "text" | "prompt/completion" | "messages",
//    "tokens": total, "documents": total,
//    "shards": [{"file": "shard-00000.tok", "bytes": B, "tokens": n,
//                "documents": d, "crc32": c}, ...]}
// The index is written last, by rename, after every shard is on disk, and an
// old index is removed before the first shard is written: a directory whose
// index exists is complete, and a crashed prepare leaves none. Readers open
// the shards the index names, in its order, as one stream of tokens and one
// list of documents: a sample may span two shards, and the sampler's order
// is that of one file holding them all (Note [Sampler invariant]).
// Opening checks every shard's size and CRC-32 against the index (one read
// of each file), so a shard cut short, replaced or damaged is named before
// training starts.
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/data/token_file.h"

namespace scaletrain::data {

inline constexpr const char* kShardIndexName = "index.json";

// Writes `records` as shards of about `shard_tokens` tokens (whole documents;
// a document longer than that is a shard of its own) into `dir` (created if
// missing). Returns the number of shards. Throws UsageError for
// shard_tokens < 1 or a directory that cannot be written.
std::size_t write_token_shards(const std::string& dir, const TokenRecords& records, uint32_t vocab,
                               uint64_t shard_tokens);

// Whether `path` is a directory holding a shard index.
bool is_token_shard_dir(const std::string& path);

// The shards of `dir`, opened and checked against its index (Note [Token
// shards]). Throws UsageError "token shards DIR: ..." naming the shard for a
// missing index, a malformed index, a missing shard, a size or checksum that
// differs, or shards that disagree with the index (vocab, kind, counts).
std::vector<TokenFile> open_token_shards(const std::string& dir);

}  // namespace scaletrain::data

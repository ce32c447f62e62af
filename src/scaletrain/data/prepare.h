#pragma once
// JSONL records to documents on several threads (`scaletrain prepare
// --threads N`).
//
// The inputs' non-blank lines, in input order, are cut into N runs of about
// equal bytes; each thread encodes one run with its own tokenizer and
// encoder (neither is thread-safe) and the runs are joined in order. The
// result is therefore the same for every N: the same tokens, mask and
// document index, and for bad input the same one-line error (the first bad
// line in input order, as one thread would report it).
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/data/records.h"
#include "scaletrain/data/token_file.h"

namespace scaletrain::data {

struct PrepareStats {
  std::size_t files = 0;    // JSONL files read (directories expanded)
  std::size_t bytes = 0;    // their decompressed size
  double read_s = 0;        // reading and decompressing
  double encode_s = 0;      // parsing, rendering and tokenizing
  int threads = 1;          // threads that encoded
};

// Encodes `inputs` (files or directories, jsonl_inputs()) with `threads`
// workers, each with a tokenizer loaded from options.tokenizer. Throws
// UsageError as RecordEncoder::add does, naming FILE:LINE; "the inputs hold
// no records" when every line is blank.
// progress(done, total), if given, is called about every 0.2 s while the
// threads encode, and once at the end (done == total): bytes of JSONL.
using PrepareProgress = std::function<void(std::size_t done, std::size_t total)>;
TokenRecords encode_jsonl(const std::vector<std::string>& inputs, const RecordOptions& options, int threads,
                          PrepareStats* stats = nullptr, const PrepareProgress& progress = nullptr);

}  // namespace scaletrain::data

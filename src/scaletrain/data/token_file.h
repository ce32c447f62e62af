#pragma once
// The on-disk token format and a read-only memory-mapped view of it.
//
// Note [Token file layout]
// A token file is a 32-byte header followed by the tokens, all little-endian:
//
//   offset  size  field
//   0       8     magic "STTOKENS" (no terminator)
//   8       4     u32 format version (kTokenFileVersion = 1)
//   12      4     u32 dtype code (kDtypeUint16 = 1: each token is a u16;
//                 kDtypeUint32 = 2: each token is a u32)
//   16      8     u64 token count
//   24      4     u32 vocabulary size (every token id is < this)
//   28      4     zero padding, so the header is 32 bytes
//   32      2*N   the tokens (4*N for u32)
//
// Why this shape: the header is fixed-size so the data starts at a constant
// offset and a mapped file can be indexed directly (32 keeps the u16 and u32
// data aligned). The writer picks the dtype from the vocabulary: u16 up to
// 65,536 ids (byte tokens, GPT-2, Mistral), u32 above (Llama 3's 128,256), so
// every u16 file written before u32 existed reads back bit for bit.
// The count is stored, not inferred from the file size, so a file cut short by
// a crashed writer or a partial copy is detected instead of silently training
// on fewer tokens. write_token_file() renames a finished temp file into place,
// so readers never observe a half-written file under the final name.
//
// Note [Token file records]
// Version 2 adds what fine-tuning records need (data/records.h): which tokens
// are targets of the loss, and where each document (one JSONL record) starts.
// The header is the same except the version (2) and the u32 at offset 28:
//   bit 0   a target mask follows the tokens
//   bit 1   a document index follows (after the mask, if any)
//   bits 8-15  the record kind (RecordKind: text, prompt/completion, messages)
// After the tokens, each section starts at the next multiple of 8 bytes from
// the start of the file:
//   mask    ceil(N / 8) bytes; bit (i % 8) of byte i / 8 is 1 when token i
//           is a target (a completion or assistant token)
//   index   u64 document count D, then D + 1 u64 offsets: document d is
//           tokens [offset[d], offset[d + 1]); offset[0] = 0, offset[D] = N,
//           non-decreasing
// The file size must equal the end of the last section exactly, and every
// offset is checked when the file is opened. Plain text is still written as
// version 1, so files from before version 2 and files of text read the same.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::data {

inline constexpr char kTokenFileMagic[8] = {'S', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr uint32_t kTokenFileVersionRecords = 2;  // Note [Token file records]
inline constexpr uint32_t kDtypeUint16 = 1;
inline constexpr uint32_t kDtypeUint32 = 2;
inline constexpr std::size_t kTokenFileHeaderBytes = 32;
// Largest vocabulary a u16 token file can describe (ids 0..65535).
inline constexpr uint32_t kMaxUint16Vocab = 65536;

// The dtype write_token_file() uses for a vocabulary of `vocab` ids.
inline uint32_t dtype_for_vocab(uint32_t vocab) { return vocab <= kMaxUint16Vocab ? kDtypeUint16 : kDtypeUint32; }

// What a record of a fine-tuning set was (Note [Token file records]):
// `data.loss_on` checks that the mask means what it asks for.
enum class RecordKind : uint32_t { Text = 0, PromptCompletion = 1, Messages = 2 };
const char* record_kind_name(RecordKind kind);

// Documents with a target mask, as `prepare` builds them from records.
struct TokenRecords {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> target;                 // one per token: 1 = a target of the loss
  std::vector<uint64_t> doc_offsets{0};        // document d is [doc_offsets[d], doc_offsets[d + 1])
  RecordKind kind = RecordKind::Text;
  // Appends one document; `target` has one entry per token of `ids`.
  void add(const std::vector<uint32_t>& ids, const std::vector<uint8_t>& targets);
  std::size_t documents() const { return doc_offsets.size() - 1; }
};

// Writes `records` as a version 2 file (mask and document index) with the
// same atomic rename and the same checks as the token overloads below.
void write_token_file(const std::string& path, const TokenRecords& records, uint32_t vocab);

// Writes `tokens` to `path` in the format above. The data goes to a temp file
// next to `path` (same directory, so the rename is atomic on POSIX), is
// flushed to disk, and is then renamed over `path`; on any failure the temp
// file is removed and `path` is untouched. Throws UsageError if vocab is 0 (or
// above kMaxUint16Vocab for the u16 overloads), if a token is >= vocab, or if
// the file cannot be written (message names the path and the OS error).
void write_token_file(const std::string& path, const uint16_t* tokens, std::size_t count,
                      uint32_t vocab);
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens,
                      uint32_t vocab);
// 32-bit ids: stored as u16 when vocab <= kMaxUint16Vocab, else as u32
// (dtype_for_vocab).
void write_token_file(const std::string& path, const uint32_t* tokens, std::size_t count,
                      uint32_t vocab);
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens,
                      uint32_t vocab);

// A validated, read-only, memory-mapped token file. Opening checks the header
// and that the file size matches the stored count exactly; any problem throws
// UsageError with a one-line message "token file PATH: PROBLEM". Token values
// are NOT scanned against vocab() on open (that would touch every page of a
// multi-GB file); TokenDataset checks each token as it copies it out.
//
// The mapping lives exactly as long as the object (RAII); it is move-only, and
// pointers from data() are invalidated when the object is destroyed or moved
// from. Concurrent reads from many threads are safe.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  // Number of tokens in the file.
  std::size_t size() const { return count_; }
  // kDtypeUint16 or kDtypeUint32.
  uint32_t dtype() const { return dtype_; }
  // The tokens of a u16 file (host byte order; only little-endian hosts are
  // supported); null for a u32 file. Never null for an open u16 file, even
  // when size() == 0.
  const uint16_t* data() const {
    return dtype_ == kDtypeUint16 ? static_cast<const uint16_t*>(tokens_) : nullptr;
  }
  // The tokens of a u32 file; null for a u16 file.
  const uint32_t* data32() const {
    return dtype_ == kDtypeUint32 ? static_cast<const uint32_t*>(tokens_) : nullptr;
  }
  // Token i of either dtype (no bounds check).
  uint32_t at(std::size_t i) const {
    return dtype_ == kDtypeUint16 ? static_cast<const uint16_t*>(tokens_)[i]
                                  : static_cast<const uint32_t*>(tokens_)[i];
  }
  // Version 2 files (Note [Token file records]): the target mask, the
  // document index and the record kind. A version 1 file has neither; every
  // token is then a target and the whole file is one document.
  bool has_mask() const { return mask_ != nullptr; }
  bool is_target(std::size_t i) const { return mask_ == nullptr || ((mask_[i >> 3] >> (i & 7)) & 1) != 0; }
  bool has_documents() const { return docs_ != nullptr; }
  std::size_t documents() const { return docs_ == nullptr ? 1 : num_docs_; }
  // Document d is tokens [document_begin(d), document_begin(d + 1)).
  uint64_t document_begin(std::size_t d) const { return docs_ == nullptr ? (d == 0 ? 0 : count_) : docs_[d]; }
  RecordKind kind() const { return kind_; }

  // Vocabulary size recorded by the writer.
  uint32_t vocab() const { return vocab_; }
  // The path the file was opened from, for error messages upstream.
  const std::string& path() const { return path_; }
  // Throws UsageError ("token file PATH: truncated to N bytes while in use")
  // if the open file has shrunk below its mapping since it was opened: a
  // read of a page past the new end would raise SIGBUS and kill the process
  // without a word. One fstat; TokenDataset calls it before every sample.
  // (A truncation between this check and the read still faults; the window
  // is that of one sample's copy.) Replacing the file by a rename is safe:
  // the mapping keeps the old file.
  void check_intact() const;

 private:
  void unmap() noexcept;

  std::string path_;
  void* map_ = nullptr;            // start of the mapping (the header), or null
  std::size_t map_bytes_ = 0;      // length passed to mmap, for munmap
  int fd_ = -1;                    // kept open for check_intact()
  const void* tokens_ = nullptr;   // u16 or u32 data inside the mapping
  std::size_t count_ = 0;
  uint32_t vocab_ = 0;
  uint32_t dtype_ = kDtypeUint16;
  const unsigned char* mask_ = nullptr;  // version 2 target bits, or null
  const uint64_t* docs_ = nullptr;       // version 2 document offsets (num_docs_ + 1), or null
  std::size_t num_docs_ = 0;
  RecordKind kind_ = RecordKind::Text;

  void open_sections(const unsigned char* h, uint64_t file_bytes, uint64_t data_end);
};

}  // namespace scaletrain::data

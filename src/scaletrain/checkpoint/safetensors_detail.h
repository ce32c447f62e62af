#pragma once
// Helpers shared by safetensors.cpp (reading) and safetensors_write.cpp; not
// part of the public API.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/checkpoint/safetensors.h"

namespace scaletrain::checkpoint::detail {

// The Rust implementation's MAX_HEADER_SIZE.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// The reserved top-level key of the header.
inline constexpr const char* kMetadataKey = "__metadata__";

// Throws SafetensorsError("safetensors SOURCE: PROBLEM").
[[noreturn]] void fail(const std::string& source, const std::string& problem);
// strerror(err).
std::string os_error(int err);
// A name for an error message: quoted, control bytes escaped (the message stays
// one line), cut at 80 bytes (a hostile name may be 100 MB long).
std::string quote_name(const std::string& s);
// Offset of the first byte that is not well-formed UTF-8 (RFC 3629: no
// overlong forms, no surrogates, nothing above U+10FFFF), or n if all are.
std::size_t utf8_error_offset(const unsigned char* s, std::size_t n);
bool is_utf8(const std::string& s);
// "[2, 3]".
std::string shape_string(const std::vector<int64_t>& shape);
// product(shape) * dtype_size(dtype) into *out; false on a negative dimension
// or on uint64 overflow at any step (like the Rust implementation, even when a
// later dimension is 0).
bool shape_bytes(const std::vector<int64_t>& shape, Dtype dtype, uint64_t* out);

}  // namespace scaletrain::checkpoint::detail

#pragma once
// NF4 storage of frozen weights (QLoRA), in the layout bitsandbytes uses for
// quantize_4bit(quant_type="nf4"), and a linear layer that computes on it.
//
// Note [NF4 format]:
// - The weight is read as fp32 and flattened (row-major). It is cut into
//   blocks of `block_size` values (64 by default); the last block is short
//   when numel is not a multiple. Each block keeps absmax = max |w| (fp32).
// - Each value is scaled by the reciprocal of its absmax, in fp32
//   (s = w * (1/absmax)), and stored as the index of the nearest of the 16
//   NF4 code values (nf4_code()). "Nearest" is decided by the fp32 midpoints
//   (a + b) / 2 of consecutive codes, the thresholds of bitsandbytes'
//   decision tree: the index is the number of midpoints strictly below s, so
//   a value exactly on a midpoint takes the LOWER code.
// - Two indices per byte, the first value in the high nibble. An odd numel
//   pads the last low nibble with the index of 0 (7).
// - A block whose absmax is 0 stores index 7 (zero) for all its values.
//   bitsandbytes computes 0 * inf = NaN there and stores index 0 (-1); both
//   dequantize to 0 (theirs to -0), so only the bytes differ.
// - Double quantization (bitsandbytes' compress_statistics=True, QLoRA's
//   "double quant"): offset = mean of the per-block absmax, and absmax -
//   offset is quantized to 8 bits blockwise in blocks of `absmax_block_size`
//   (256) with the same scheme (per-256 absmax in fp32, nearest code by fp32
//   midpoints, ties to the lower code) on bitsandbytes' signed dynamic map
//   (dynamic_map()). The offset is the mean taken in fp64 and rounded to
//   fp32 (bitsandbytes takes an fp32 mean, whose last bit depends on the
//   summation order); it is stored, so dequantization is self-consistent.
// - Dequantization: absmax' = dynamic_map[q] * scale + offset (fp32), then
//   w' = nf4_code[i] * absmax' in fp32, rounded to the requested dtype
//   (bf16: the fp32 product rounded, as bitsandbytes does); fp64 output takes
//   the exact product of the two fp32 factors.
//
// Every function here works on the device the tensors live on.
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

namespace scaletrain::precision {

struct NF4Options {
  int64_t block_size = 64;          // values per absmax (bitsandbytes' blocksize); positive and even
  bool double_quant = true;         // quantize the absmax values to 8 bits (compress_statistics)
  int64_t absmax_block_size = 256;  // absmax values per fp32 scale when double_quant is on
};

// A quantized weight. Either `absmax` (double quant off) or the triple
// `absmax_q`, `absmax_scale`, `absmax_offset` (double quant on) is set.
struct NF4Weight {
  at::Tensor packed;          // uint8 [ceil(numel / 2)]: two code indices per byte, first in the high nibble
  at::Tensor absmax;          // fp32 [n_blocks]; undefined when double_quant
  at::Tensor absmax_q;        // uint8 [n_blocks]: indices into dynamic_map(); undefined unless double_quant
  at::Tensor absmax_scale;    // fp32 [ceil(n_blocks / absmax_block_size)]: absmax of (absmax - offset) per block
  float absmax_offset = 0;    // mean of the per-block absmax, subtracted before the 8-bit quantization
  std::vector<int64_t> shape;  // shape of the original weight
  int64_t block_size = 64;
  int64_t absmax_block_size = 256;

  bool double_quant() const { return absmax_q.defined(); }
  int64_t numel() const;
  int64_t n_blocks() const;
  // Bytes this weight occupies: packed codes + absmax storage (the offset
  // counts as 4 bytes). The shared code books are not counted.
  int64_t nbytes() const;
};

// The 16 NF4 code values, ascending, from -1 to 1 (0 at index 7).
const std::array<float, 16>& nf4_code_values();
// The same as an fp32 tensor on `device`.
at::Tensor nf4_code(at::Device device = at::kCPU);  // host: by default
// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)):
// 256 fp32 values, ascending: 127 negatives, 0 at index 127, 127 positives,
// 1 at index 255 (the smallest value is -0.99296875, not -1).
at::Tensor dynamic_map(at::Device device = at::kCPU);  // host: by default

// Blockwise 8-bit quantization on an ascending code book (the double-quant
// step, exposed for tests): per-block fp32 absmax and the code indices.
struct Blockwise8 {
  at::Tensor codes;   // uint8 [numel]
  at::Tensor absmax;  // fp32 [ceil(numel / block_size)]
};
Blockwise8 quantize_blockwise(const at::Tensor& values, const at::Tensor& code, int64_t block_size);
// code[codes] * absmax of its block, fp32, flat.
at::Tensor dequantize_blockwise(const Blockwise8& q, const at::Tensor& code, int64_t block_size);

// Quantizes `weight` (any floating dtype, read as fp32). Throws
// std::invalid_argument, one line, for an empty or non-floating tensor,
// non-finite values (or values beyond the fp32 range), or bad options.
NF4Weight nf4_quantize(const at::Tensor& weight, const NF4Options& options = {});

// The fp32 per-block absmax that dequantization multiplies by (the stored
// absmax, or its double-quantized reconstruction).
at::Tensor nf4_block_absmax(const NF4Weight& w);

// The weight in `dtype` (kFloat, kDouble, kBFloat16 or kHalf), in its
// original shape. Throws std::invalid_argument for another dtype.
at::Tensor nf4_dequantize(const NF4Weight& w, at::ScalarType dtype = at::kFloat);

// y = x W^T (+ bias) for a frozen NF4 weight W [out, in] and x [..., in]:
// W is dequantized to x's dtype for the matmul and dropped. Backward
// dequantizes again and gives dx = dy W; W gets no gradient, the bias one
// when it requires grad. Only `w` (the quantized form) is kept for backward.
// `bias` may be undefined. Throws std::invalid_argument on shape or dtype
// mismatch.
at::Tensor nf4_linear(const at::Tensor& x, const NF4Weight& w, const at::Tensor& bias = {});

}  // namespace scaletrain::precision

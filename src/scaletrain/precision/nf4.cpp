#include "scaletrain/precision/nf4.h"

#include <torch/torch.h>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace scaletrain::precision {

namespace {

// The NF4 data type of the QLoRA paper: quantiles of N(0, 1) normalized to
// [-1, 1], with an exact 0 and one more positive value than negative ones.
// These are the fp32 values bitsandbytes stores.
constexpr std::array<float, 16> kNF4Code = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};
constexpr uint8_t kNF4Zero = 7;  // index of 0 in kNF4Code: pads an odd numel

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument(what); }

std::string shape_of(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

at::Tensor build_dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for
  // exponent i = 0..6, 2^i + 1 boundaries evenly spaced over [0.1, 1] (fp32
  // linspace), the means of neighbouring boundaries scaled by 10^(i-6), with
  // both signs; then 0 and 1; ascending. 2 * 127 + 2 = 256 values. The fp32
  // arithmetic is the one bitsandbytes' torch code does, so the values agree
  // to the bit.
  static constexpr double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    at::Tensor b = at::linspace(0.1, 1.0, (int64_t{1} << i) + 1, at::kFloat);
    at::Tensor means = (b.slice(0, 0, b.size(0) - 1) + b.slice(0, 1)) / 2.0;
    at::Tensor scaled = means * kDecade[i];
    parts.push_back(scaled);
    parts.push_back(-scaled);
  }
  parts.push_back(at::tensor({0.0f, 1.0f}));
  at::Tensor map = std::get<0>(at::sort(at::cat(parts)));
  TORCH_INTERNAL_ASSERT(map.numel() == 256);
  return map;
}

// fp32 midpoints (a + b) / 2 of consecutive values of an ascending code book.
at::Tensor midpoints(const at::Tensor& code) {
  return (code.slice(0, 0, code.size(0) - 1) + code.slice(0, 1)) * 0.5;
}

// Per-block absmax (fp32) and nearest-code indices (uint8) of a flat fp32
// tensor: Note [NF4 format], shared by the 4-bit and the 8-bit steps.
std::pair<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& flat, const at::Tensor& code, int64_t block) {
  const int64_t n = flat.numel();
  const int64_t n_blocks = (n + block - 1) / block;
  // Zeros complete the short last block without changing its absmax; their
  // codes are cut off below.
  at::Tensor blocks = at::constant_pad_nd(flat, {0, n_blocks * block - n}, 0).view({n_blocks, block});
  at::Tensor absmax = blocks.abs().amax(1);
  // Multiply by the fp32 reciprocal, as bitsandbytes' kernels do (x / absmax
  // can differ in the last bit). A zero block scales by 0: all its values are 0.
  at::Tensor inv = at::reciprocal(absmax).masked_fill_(absmax == 0, 0);
  at::Tensor scaled = blocks * inv.unsqueeze(1);
  // bucketize (right=false) counts the midpoints strictly below each value:
  // the nearest code, the lower one on an exact tie.
  at::Tensor idx = at::bucketize(scaled, midpoints(code), /*out_int32=*/true, /*right=*/false);
  return {idx.view(-1).slice(0, 0, n).to(at::kByte), absmax};
}

// code[values] * per-block scale, flat fp32 (or fp64 for an exact product).
at::Tensor scale_blocks(const at::Tensor& values, const at::Tensor& absmax, int64_t block, at::ScalarType dtype) {
  const int64_t n = values.numel();
  const int64_t n_blocks = absmax.numel();
  at::Tensor v = at::constant_pad_nd(values.to(dtype), {0, n_blocks * block - n}, 0).view({n_blocks, block});
  return (v * absmax.to(dtype).unsqueeze(1)).view(-1).slice(0, 0, n);
}

void check_weight(const NF4Weight& w) {
  if (!w.packed.defined() || w.shape.empty()) refuse("NF4Weight: not initialized (use nf4_quantize)");
  if (w.double_quant() ? !w.absmax_scale.defined() : !w.absmax.defined())
    refuse("NF4Weight: absmax storage is incomplete");
}

// Keeps the quantized weight alive for backward (a capsule in saved_data).
struct NF4Holder : torch::CustomClassHolder {
  explicit NF4Holder(NF4Weight weight) : w(std::move(weight)) {}
  NF4Weight w;
};

struct NF4LinearFunction : torch::autograd::Function<NF4LinearFunction> {
  // Autograd inputs: x (edge 0), the bias (edge 1 when present; an optional,
  // since CppNode cannot record an undefined tensor), and the capsule. Each
  // gets a slot in backward's result; only tensors get edges.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const c10::optional<at::Tensor>& bias, const c10::intrusive_ptr<NF4Holder>& holder) {
    // Only the quantized form is saved; the dense weight lives for this matmul only.
    ctx->saved_data["weight"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["has_bias"] = bias.has_value();
    return at::linear(x, nf4_dequantize(holder->w, x.scalar_type()), bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto holder = c10::static_intrusive_pointer_cast<NF4Holder>(ctx->saved_data["weight"].toCapsule());
    const at::Tensor& dy = grad_out[0];
    at::Tensor dx, dbias;
    if (ctx->needs_input_grad(0)) dx = at::matmul(dy, nf4_dequantize(holder->w, dy.scalar_type()));
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(1))
      dbias = dy.reshape({-1, dy.size(-1)}).sum(0);
    return {dx, dbias, at::Tensor()};
  }
};

bool is_compute_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

int64_t NF4Weight::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t NF4Weight::n_blocks() const { return (numel() + block_size - 1) / block_size; }

int64_t NF4Weight::nbytes() const {
  int64_t bytes = packed.numel();
  if (double_quant())
    bytes += absmax_q.numel() + absmax_scale.numel() * 4 + 4;
  else
    bytes += absmax.numel() * 4;
  return bytes;
}

const std::array<float, 16>& nf4_code_values() { return kNF4Code; }

at::Tensor nf4_code(at::Device device) {
  static const at::Tensor code = at::tensor(std::vector<float>(kNF4Code.begin(), kNF4Code.end()));
  return code.to(device);
}

at::Tensor dynamic_map(at::Device device) {
  static const at::Tensor map = build_dynamic_map();
  return map.to(device);
}

Blockwise8 quantize_blockwise(const at::Tensor& values, const at::Tensor& code, int64_t block_size) {
  if (block_size <= 0) refuse("quantize_blockwise: block_size must be positive, got " + std::to_string(block_size));
  if (!values.defined() || values.numel() == 0) refuse("quantize_blockwise: the input is empty");
  auto [codes, absmax] = quantize_blocks(values.reshape(-1).to(at::kFloat), code.to(values.device(), at::kFloat),
                                         block_size);
  return {codes, absmax};
}

at::Tensor dequantize_blockwise(const Blockwise8& q, const at::Tensor& code, int64_t block_size) {
  const at::Tensor vals = code.to(q.codes.device(), at::kFloat).index_select(0, q.codes.reshape(-1).to(at::kInt));
  return scale_blocks(vals, q.absmax, block_size, at::kFloat);
}

NF4Weight nf4_quantize(const at::Tensor& weight, const NF4Options& o) {
  if (!weight.defined() || weight.numel() == 0)
    refuse("nf4_quantize: the weight is empty" + (weight.defined() ? " (shape " + shape_of(weight.sizes()) + ")" : ""));
  if (!at::isFloatingType(weight.scalar_type()))
    refuse(std::string("nf4_quantize: the weight must be floating point, got ") + c10::toString(weight.scalar_type()));
  // Even, so that a byte never holds values of two blocks (a row shard of
  // whole blocks is then a byte range).
  if (o.block_size <= 0 || o.block_size % 2 != 0)
    refuse("nf4_quantize: block_size must be positive and even, got " + std::to_string(o.block_size));
  if (o.double_quant && o.absmax_block_size <= 0)
    refuse("nf4_quantize: absmax_block_size must be positive, got " + std::to_string(o.absmax_block_size));

  const at::Tensor flat = weight.detach().reshape(-1).to(at::kFloat).contiguous();
  const int64_t bad = at::logical_not(at::isfinite(flat)).sum().item<int64_t>();
  if (bad > 0)
    refuse("nf4_quantize: the weight " + shape_of(weight.sizes()) + " has " + std::to_string(bad) +
           " non-finite value(s) (NaN, inf, or beyond the fp32 range)");

  NF4Weight w;
  w.shape = weight.sizes().vec();
  w.block_size = o.block_size;
  w.absmax_block_size = o.absmax_block_size;

  auto [codes, absmax] = quantize_blocks(flat, nf4_code(flat.device()), o.block_size);
  if (codes.numel() % 2 != 0) codes = at::constant_pad_nd(codes, {0, 1}, kNF4Zero);
  const at::Tensor pairs = codes.view({-1, 2});
  w.packed = at::bitwise_or(at::bitwise_left_shift(pairs.select(1, 0), 4), pairs.select(1, 1)).contiguous();

  if (!o.double_quant) {
    w.absmax = absmax;
    return w;
  }
  // Offset: the mean in fp64, rounded to fp32 (Note [NF4 format]).
  w.absmax_offset = static_cast<float>(absmax.to(at::kDouble).mean().item<double>());
  auto [qcodes, qscale] = quantize_blocks(absmax - w.absmax_offset, dynamic_map(flat.device()), o.absmax_block_size);
  w.absmax_q = qcodes;
  w.absmax_scale = qscale;
  return w;
}

at::Tensor nf4_block_absmax(const NF4Weight& w) {
  check_weight(w);
  if (!w.double_quant()) return w.absmax;
  return dequantize_blockwise({w.absmax_q, w.absmax_scale}, dynamic_map(w.absmax_q.device()), w.absmax_block_size) +
         w.absmax_offset;
}

at::Tensor nf4_dequantize(const NF4Weight& w, at::ScalarType dtype) {
  check_weight(w);
  if (!is_compute_dtype(dtype))
    refuse(std::string("nf4_dequantize: dtype must be fp32, fp64, bf16 or fp16, got ") + c10::toString(dtype));
  const at::Device device = w.packed.device();
  // Each byte value decodes to a pair (high nibble, low nibble): one
  // 256-row lookup instead of unpacking nibbles into an index per value.
  const at::Tensor byte = at::arange(256, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor code = nf4_code(device);
  const at::Tensor pair_table = at::stack({code.index_select(0, at::bitwise_right_shift(byte, 4)),
                                           code.index_select(0, at::bitwise_and(byte, 15))},
                                          1);
  const at::Tensor values = pair_table.index_select(0, w.packed.to(at::kInt)).view(-1).slice(0, 0, w.numel());
  // fp64: the exact product of the two fp32 factors; otherwise the fp32
  // product, rounded to the requested dtype.
  const at::ScalarType work = dtype == at::kDouble ? at::kDouble : at::kFloat;
  return scale_blocks(values, nf4_block_absmax(w), w.block_size, work).view(w.shape).to(dtype);
}

at::Tensor nf4_linear(const at::Tensor& x, const NF4Weight& w, const at::Tensor& bias) {
  check_weight(w);
  if (w.shape.size() != 2) refuse("nf4_linear: the weight must be 2-D [out, in], got " + shape_of(w.shape));
  if (!x.defined() || x.dim() < 1 || x.size(-1) != w.shape[1])
    refuse("nf4_linear: x must be [..., " + std::to_string(w.shape[1]) + "], got " +
           (x.defined() ? shape_of(x.sizes()) : std::string("undefined")));
  if (!is_compute_dtype(x.scalar_type()))
    refuse(std::string("nf4_linear: x must be fp32, fp64, bf16 or fp16, got ") + c10::toString(x.scalar_type()));
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != w.shape[0] || bias.scalar_type() != x.scalar_type()))
    refuse("nf4_linear: bias must be [" + std::to_string(w.shape[0]) + "] in x's dtype " +
           c10::toString(x.scalar_type()) + ", got " + shape_of(bias.sizes()) + " " + c10::toString(bias.scalar_type()));
  const c10::optional<at::Tensor> b = bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  return NF4LinearFunction::apply(x, b, c10::make_intrusive<NF4Holder>(w));
}

}  // namespace scaletrain::precision

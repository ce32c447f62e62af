#include "scaletrain/precision/fp8.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace scaletrain::precision {
namespace {

// Every finite positive value of `format`, ascending, and each one's code.
struct Table {
  at::Tensor values;  // double
  at::Tensor codes;   // long
  at::Tensor decode;  // float, the 256 values in code order
};

Table make_table(Fp8Format f) {
  std::vector<double> values;
  std::vector<int64_t> codes;
  std::vector<float> decode(256);
  for (int c = 0; c < 256; ++c) decode[c] = fp8_decode(static_cast<uint8_t>(c), f);
  for (int c = 1; c < 128; ++c) {  // codes 1..127 ascend with their values, up to inf / NaN
    if (!std::isfinite(decode[c])) break;
    values.push_back(decode[c]);
    codes.push_back(c);
  }
  return {torch::tensor(values, torch::kDouble), torch::tensor(codes, torch::kLong), torch::tensor(decode, torch::kFloat)};
}

const Table& table(Fp8Format format) {
  static const Table tables[2] = {make_table(Fp8Format::E4M3), make_table(Fp8Format::E5M2)};
  return tables[format == Fp8Format::E4M3 ? 0 : 1];
}

}  // namespace

at::Tensor fp8_quantize(const at::Tensor& x, Fp8Format format, double scale, bool saturate) {
  torch::NoGradGuard no_grad;
  const Fp8Spec s = fp8_spec(format);
  const Table& t = table(format);
  const auto dev = x.device();
  // The product in fp32 (Note [FP8 tensors]), then exact arithmetic in double.
  const at::Tensor y = x.to(at::kFloat) * static_cast<float>(scale);
  const at::Tensor a = y.abs().to(at::kDouble);
  // The spacing of representable values around each |y| (Note [FP8 rounding]):
  // frexp's exponent is floor(log2 a) + 1; subnormals share the smallest normal's.
  const at::Tensor exponent = (std::get<1>(at::frexp(a)) - 1).clamp_min(1 - s.bias);
  const at::Tensor quantum = at::exp2((exponent - s.mantissa_bits).to(at::kDouble));
  const at::Tensor rounded = at::round(a / quantum) * quantum;  // round: half to even
  // Representable now: its position in the table of positive values gives the code.
  const at::Tensor values = t.values.to(dev), codes = t.codes.to(dev);
  const at::Tensor index = at::searchsorted(values, rounded.flatten()).clamp_max(values.numel() - 1);
  at::Tensor code = codes.index_select(0, index).view(y.sizes());
  code = at::where(rounded == 0, at::zeros_like(code), code);
  const int64_t largest = format == Fp8Format::E4M3 ? 0x7E : 0x7B;
  const int64_t overflowed = saturate ? largest : (s.has_inf ? 0x7C : 0x7F);
  code = at::where(rounded > fp8_max(format), at::full_like(code, overflowed), code);
  code = at::where(y.isinf(), at::full_like(code, saturate ? largest : overflowed), code);
  code = at::where(y.isnan(), at::full_like(code, 0x7F), code);
  code = code + at::signbit(y).to(at::kLong) * 0x80;
  return code.to(at::kByte);
}

at::Tensor fp8_dequantize(const at::Tensor& codes, Fp8Format format, double scale, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(codes.scalar_type() == at::kByte, "fp8_dequantize: codes must be uint8, got ", codes.scalar_type());
  const at::Tensor lut = table(format).decode.to(codes.device());
  return (lut.index_select(0, codes.flatten().to(at::kLong)).view(codes.sizes()) / static_cast<float>(scale))
      .to(dtype);
}

double fp8_scale(double amax, Fp8Format format, int margin, double previous) {
  if (!(amax > 0) || !std::isfinite(amax)) return previous;
  return fp8_max(format) / amax / std::ldexp(1.0, margin);
}

Fp8Format fp8_format(Fp8Mix mix, bool gradient) {
  return mix == Fp8Mix::Hybrid && gradient ? Fp8Format::E5M2 : Fp8Format::E4M3;
}

DelayedScaling::DelayedScaling(Fp8Format format, int64_t history, int margin)
    : format_(format), length_(history), margin_(margin) {
  if (history < 1)
    throw std::invalid_argument("FP8 amax history length must be at least 1, got " + std::to_string(history));
}

void DelayedScaling::record(double amax) {
  if (std::isfinite(amax)) {  // a non-finite amax would hold the scale down for the whole history
    if (static_cast<int64_t>(history_.size()) < length_)
      history_.push_back(amax);
    else
      history_[next_] = amax;
    next_ = (next_ + 1) % static_cast<size_t>(length_);
  }
  const double largest = history_.empty() ? 0.0 : *std::max_element(history_.begin(), history_.end());
  scale_ = fp8_scale(largest, format_, margin_, scale_);
}

double reduce_amax(const at::Tensor& x, const std::vector<comm::Group*>& groups) {
  torch::NoGradGuard no_grad;
  at::Tensor a = x.numel() == 0 ? at::zeros({1}, x.options().dtype(at::kFloat))
                                : x.detach().abs().max().to(at::kFloat).reshape({1});
  for (comm::Group* g : groups)
    if (g != nullptr && g->size() > 1) g->all_reduce(a, comm::ReduceOp::Max).wait();
  return a.item<double>();
}

}  // namespace scaletrain::precision

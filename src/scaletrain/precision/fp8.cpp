#include "scaletrain/precision/fp8.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include "scaletrain/precision/autocast_compat.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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

// Note [FP8 rounding] on fp32 bits, for host tensors: one pass instead of the
// thirty the tensor expression below makes. A normal result rounds the fp32
// significand to m bits, ties to even (adding half a step minus one, plus the
// kept last bit, carries exactly when rounding up), and re-biases the
// exponent; a subnormal one (and fp32 subnormals) counts steps of
// 2^(1 - bias - m) with nearbyint, exact because the product is a power-of-two
// rescaling. Same codes as fp8_encode() (tests/unit/torch/fp8_test.cpp).
struct HostEncoder {
  int m;
  uint32_t rebias;     // (127 - bias) << m
  int min_exponent;    // 1 - bias
  float subnormal;     // 2^(bias - 1 + m)
  uint32_t largest;    // the largest finite code (no sign)
  uint8_t overflowed;  // the code of an overflow, finite or infinite (no sign)

  HostEncoder(Fp8Format f, bool saturate) {
    const Fp8Spec s = fp8_spec(f);
    m = s.mantissa_bits;
    rebias = static_cast<uint32_t>(127 - s.bias) << m;
    min_exponent = 1 - s.bias;
    subnormal = std::ldexp(1.0f, s.bias - 1 + m);
    largest = f == Fp8Format::E4M3 ? 0x7E : 0x7B;
    overflowed = static_cast<uint8_t>(saturate ? largest : (s.has_inf ? 0x7C : 0x7F));
  }

  uint8_t operator()(float y) const {
    uint32_t u;
    std::memcpy(&u, &y, sizeof u);
    const auto sign = static_cast<uint8_t>((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7F;        // NaN
    if (u == 0x7F800000u) return sign | overflowed;  // +-inf
    uint32_t code;
    if (static_cast<int>(u >> 23) - 127 < min_exponent) {
      float a;
      std::memcpy(&a, &u, sizeof a);
      code = static_cast<uint32_t>(std::nearbyint(a * subnormal));
    } else {
      const uint32_t r = u + ((1u << (22 - m)) - 1) + ((u >> (23 - m)) & 1u);
      code = (r >> (23 - m)) - rebias;
    }
    return static_cast<uint8_t>(sign | (code > largest ? overflowed : code));
  }
};

at::Tensor host_quantize(const at::Tensor& x, Fp8Format format, double scale, bool saturate) {
  const at::Tensor y = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(at::kByte));
  const float* src = y.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const float s = static_cast<float>(scale);
  const HostEncoder encode(format, saturate);
  at::parallel_for(0, y.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = encode(src[i] * s);
  });
  return out;
}

at::Tensor host_dequantize(const at::Tensor& codes, Fp8Format format, double scale) {
  float lut[256];
  for (int c = 0; c < 256; ++c) lut[c] = fp8_decode(static_cast<uint8_t>(c), format);
  const at::Tensor in = codes.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kFloat));
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, in.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = lut[src[i]] / s;
  });
  return out;
}

}  // namespace

at::Tensor fp8_quantize(const at::Tensor& x, Fp8Format format, double scale, bool saturate) {
  torch::NoGradGuard no_grad;
  if (x.device().is_cpu()) return host_quantize(x, format, scale, saturate);  // host: tensors already there
  return fp8_quantize_by_tensor_ops(x, format, scale, saturate);
}

at::Tensor fp8_quantize_by_tensor_ops(const at::Tensor& x, Fp8Format format, double scale, bool saturate) {
  torch::NoGradGuard no_grad;
  const Fp8Spec s = fp8_spec(format);
  const int m = s.mantissa_bits;
  // The product in fp32 (Note [FP8 tensors]); every step after it is exact in
  // fp32 and int32 arithmetic, as fp8_encode's are in double.
  const at::Tensor y = x.to(at::kFloat) * static_cast<float>(scale);
  const at::Tensor a = y.abs();
  // The spacing of representable values around each |y| (Note [FP8 rounding]):
  // frexp's exponent is floor(log2 a) + 1; subnormals share the smallest
  // normal's. 2^k is built from its bits (k stays in fp32's normal range for
  // every finite input), so no exp2 rounding can creep in.
  const at::Tensor exponent = (std::get<1>(at::frexp(a)) - 1).clamp_min(1 - s.bias);
  const at::Tensor k = (exponent - m).clamp(-126, 127);
  const at::Tensor quantum = (k + 127).to(at::kInt).__lshift__(23).view(at::kFloat);
  const at::Tensor rounded = at::round(a / quantum) * quantum;  // round: half to even
  // A representable value's code from its fp32 bits: biased exponent and the
  // top m mantissa bits for normals, the count of smallest steps for subnormals.
  const at::Tensor bits = rounded.view(at::kInt);
  const at::Tensor e = bits.__rshift__(23) - 127;
  const at::Tensor normal_code = (e + s.bias).__lshift__(m) | (bits.__rshift__(23 - m) & ((1 << m) - 1));
  const float smallest = std::ldexp(1.0f, 1 - s.bias - m);
  const at::Tensor subnormal_code = (rounded / smallest).to(at::kInt);
  at::Tensor code = at::where(e >= 1 - s.bias, normal_code, subnormal_code);
  const int64_t largest = format == Fp8Format::E4M3 ? 0x7E : 0x7B;
  const int64_t overflowed = saturate ? largest : (s.has_inf ? 0x7C : 0x7F);
  code = at::where(rounded > static_cast<float>(fp8_max(format)), at::full_like(code, overflowed), code);
  code = at::where(y.isinf(), at::full_like(code, saturate ? largest : overflowed), code);
  code = at::where(y.isnan(), at::full_like(code, 0x7F), code);
  code = code + at::signbit(y).to(at::kInt) * 0x80;
  return code.to(at::kByte);
}

at::Tensor fp8_dequantize(const at::Tensor& codes, Fp8Format format, double scale, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(codes.scalar_type() == at::kByte, "fp8_dequantize: codes must be uint8, got ", codes.scalar_type());
  if (codes.device().is_cpu()) return host_dequantize(codes, format, scale).to(dtype);  // host: as in fp8_quantize
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

double DelayedScaling::at_age(size_t age) const {
  const size_t n = history_.size();
  return history_.at((next_ + n - 1 - age) % n);
}

void DelayedScaling::restore(size_t count, double scale, const std::vector<std::pair<size_t, double>>& entries) {
  const size_t n = std::min(count, static_cast<size_t>(length_));
  history_.assign(n, 0.0);
  next_ = n % static_cast<size_t>(length_);
  for (const auto& [age, amax] : entries)
    if (age < n) history_[(next_ + n - 1 - age) % n] = amax;
  scale_ = scale;
}

double reduce_amax(const at::Tensor& x, const std::vector<comm::Group*>& groups) {
  torch::NoGradGuard no_grad;
  at::Tensor a = x.numel() == 0 ? at::zeros({1}, x.options().dtype(at::kFloat))
                                : x.detach().abs().max().to(at::kFloat).reshape({1});
  for (comm::Group* g : groups)
    if (g != nullptr && g->size() > 1) g->all_reduce(a, comm::ReduceOp::Max).wait();
  return a.item<double>();
}

namespace {

// The largest |value| of x (0 when empty), exactly.
double amax_of(const at::Tensor& x) {
  torch::NoGradGuard no_grad;
  return x.numel() == 0 ? 0.0 : x.detach().abs().max().item<double>();
}

// The values of FP8 codes, unscaled, in fp32 (exact).
at::Tensor values_of(const at::Tensor& codes, Fp8Format f) { return fp8_dequantize(codes, f, 1.0, at::kFloat); }

// Note [FP8 linears]. Saves the operands' codes, not their values.
struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            Fp8Linear* layer) {
    const at::DeviceType device = x.device().type();
    const at::ScalarType out_dtype =
        compat::autocast_enabled(device) ? compat::autocast_dtype(device) : x.scalar_type();
    // The arithmetic below is the emulated GEMM's own: fp32, whatever autocast says.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const Fp8Format fx = layer->format(Fp8Linear::Input), fw = layer->format(Fp8Linear::Weight);
    const double sx = layer->cast_scale(Fp8Linear::Input, amax_of(x));
    const double sw = layer->cast_scale(Fp8Linear::Weight, amax_of(w));
    const at::Tensor xq = fp8_quantize(x, fx, sx), wq = fp8_quantize(w, fw, sw);
    at::Tensor y = at::matmul(values_of(xq, fx), values_of(wq, fw).t()) * static_cast<float>(1.0 / (sx * sw));
    ctx->save_for_backward({xq, wq});
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(layer);
    ctx->saved_data["sx"] = sx;
    ctx->saved_data["sw"] = sw;
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return y.to(out_dtype);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    auto* layer = reinterpret_cast<Fp8Linear*>(ctx->saved_data["layer"].toInt());
    const double sx = ctx->saved_data["sx"].toDouble(), sw = ctx->saved_data["sw"].toDouble();
    const Fp8Format fx = layer->format(Fp8Linear::Input), fw = layer->format(Fp8Linear::Weight);
    const Fp8Format fg = layer->format(Fp8Linear::Grad);
    const at::Tensor& g = grads[0];
    const double m = layer->loss_multiplier();
    const double sg = layer->cast_scale(Fp8Linear::Grad, amax_of(g) / m) / m;
    const at::Tensor gv = values_of(fp8_quantize(g, fg, sg), fg);  // [..., out]
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0))
      dx = (at::matmul(gv, values_of(saved[1], fw)) * static_cast<float>(1.0 / (sg * sw)))
               .to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt()));
    if (ctx->needs_input_grad(1)) {
      const at::Tensor xv = values_of(saved[0], fx);
      dw = (gv.reshape({-1, gv.size(-1)}).t().mm(xv.reshape({-1, xv.size(-1)})) * static_cast<float>(1.0 / (sg * sx)))
               .to(static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    }
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

Fp8LinearOptions fp8_linear_options(const PrecisionOptions& p) {
  Fp8LinearOptions o;
  o.mix = p.fp8_format == "e4m3" ? Fp8Mix::E4M3 : Fp8Mix::Hybrid;
  o.delayed = p.fp8_recipe == "delayed";
  o.history = p.fp8_amax_history;
  o.margin = static_cast<int>(p.fp8_margin);
  return o;
}

Fp8Linear::Fp8Linear(const Fp8LinearOptions& o)
    : o_(o),
      scaling_{DelayedScaling(fp8_format(o.mix, false), o.history, o.margin),
               DelayedScaling(fp8_format(o.mix, false), o.history, o.margin),
               DelayedScaling(fp8_format(o.mix, true), o.history, o.margin)} {
  if (o.margin < 0) throw std::invalid_argument("FP8 scaling margin must be >= 0, got " + std::to_string(o.margin));
}

at::Tensor Fp8Linear::matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "scaletrain: FP8 linear of input ", x.sizes(), " and weight ",
              w.sizes());
  return Fp8LinearFunction::apply(x, w, this);
}

double Fp8Linear::cast_scale(Operand which, double amax) {
  if (std::isfinite(amax)) step_amax_[which] = std::max(step_amax_[which], amax);
  if (o_.delayed) return scaling_[which].scale();
  last_scale_[which] = fp8_scale(amax, format(which), o_.margin, last_scale_[which]);
  return last_scale_[which];
}

void Fp8Linear::end_step(const std::array<double, 3>& amax) {
  for (int i = 0; i < 3; ++i) scaling_[i].record(amax[i]);
  step_amax_ = {0, 0, 0};
}

void fp8_end_step(const std::vector<Fp8LinearPtr>& layers, const std::vector<comm::Group*>& groups) {
  if (layers.empty() || !layers.front()->options().delayed) return;
  // One tensor of every amax, reduced and read back the same way on one rank
  // as on many, so a single process records exactly what a group would.
  std::vector<double> local;
  for (const auto& l : layers) local.insert(local.end(), l->step_amax().begin(), l->step_amax().end());
  at::Tensor a = torch::tensor(local, torch::kDouble);  // host: a few scalars per layer
  for (comm::Group* g : groups)
    if (g != nullptr && g->size() > 1) g->all_reduce(a, comm::ReduceOp::Max).wait();
  const double* v = a.data_ptr<double>();
  for (size_t i = 0; i < layers.size(); ++i) layers[i]->end_step({v[3 * i], v[3 * i + 1], v[3 * i + 2]});
}

namespace {

constexpr int64_t kScaleBytes = sizeof(double);

// The scale a wire cast of `x` takes (Note [FP8 on the wire]).
double wire_scale(const at::Tensor& x, Fp8Format f) {
  const double amax = amax_of(x);
  return fp8_scale(amax, f, 0, 1.0);
}

// Rows of codes with the scale's bytes appended: [rows, c + 8] uint8.
at::Tensor pack(const at::Tensor& codes, int64_t rows, double scale) {
  const int64_t c = codes.numel() / rows;
  at::Tensor out = at::empty({rows, c + kScaleBytes}, codes.options());
  out.narrow(1, 0, c).copy_(codes.view({rows, c}));
  const at::Tensor s = torch::full({1}, scale, torch::kDouble).view(at::kByte);  // host: 8 bytes
  out.narrow(1, c, kScaleBytes).copy_(s.view({1, kScaleBytes}).expand({rows, kScaleBytes}));
  return out;
}

// The scale stored at the end of a packed row.
double row_scale(const at::Tensor& row, int64_t c) {
  const at::Tensor bytes = row.narrow(0, c, kScaleBytes).to(at::kCPU).contiguous();  // host: 8 bytes
  double v;
  std::memcpy(&v, bytes.data_ptr<uint8_t>(), sizeof v);
  return v;
}

// Decodes packed rows [rows, c + 8] into fp32 values [rows, c], each row divided by its scale.
at::Tensor unpack(const at::Tensor& rows_bytes, Fp8Format f) {
  const int64_t rows = rows_bytes.size(0), c = rows_bytes.size(1) - kScaleBytes;
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < rows; ++i) {
    const at::Tensor row = rows_bytes[i];
    out.push_back(fp8_dequantize(row.narrow(0, 0, c).contiguous(), f, 1.0, at::kFloat) /
                  static_cast<float>(row_scale(row, c)));
  }
  return at::stack(out);
}

// Phase 1 of both collectives: cast `full`, all_to_all the chunks; the
// returned Work's stage sums them into `chunk` (c elements, fp32) divided by W.
comm::Work fp8_sum_chunks(comm::Group& group, const at::Tensor& full, at::Tensor chunk, Fp8Format f) {
  torch::NoGradGuard no_grad;
  const int w = group.size();
  const int64_t c = group.shard_numel(full.numel());
  at::Tensor padded = full.reshape({-1});
  if (padded.numel() != c * w) padded = at::constant_pad_nd(padded, {0, c * w - padded.numel()});
  const double scale = wire_scale(padded, f);
  const at::Tensor send = pack(fp8_quantize(padded, f, scale, /*saturate=*/false), w, scale);
  at::Tensor recv = at::empty_like(send);
  comm::Work work = group.all_to_all(send, recv);
  work.and_then([send, recv, chunk, f, w]() mutable {
    torch::NoGradGuard no_grad;
    chunk.copy_(unpack(recv, f).sum(0) / static_cast<float>(w));
    return comm::Work();
  });
  return work;
}

}  // namespace

comm::Work fp8_reduce_scatter_avg(comm::Group& group, at::Tensor full, at::Tensor shard, Fp8Format format) {
  TORCH_CHECK(full.scalar_type() == at::kFloat && shard.scalar_type() == at::kFloat,
              "scaletrain: FP8 reduce-scatter takes fp32 tensors");
  TORCH_CHECK(shard.numel() == group.shard_numel(full.numel()), "scaletrain: FP8 reduce-scatter shard of ",
              shard.numel(), " elements for ", full.numel(), " over ", group.size());
  if (group.size() == 1) {
    shard.copy_(full.reshape({-1}));
    return comm::Work();
  }
  return fp8_sum_chunks(group, full, shard, format);
}

comm::Work fp8_all_reduce_avg(comm::Group& group, at::Tensor flat, Fp8Format format) {
  TORCH_CHECK(flat.scalar_type() == at::kFloat && flat.is_contiguous(), "scaletrain: FP8 all-reduce takes a contiguous fp32 tensor");
  if (group.size() == 1) return comm::Work();
  const int w = group.size();
  const int64_t c = group.shard_numel(flat.numel());
  at::Tensor chunk = at::empty({c}, flat.options());
  comm::Work work = fp8_sum_chunks(group, flat, chunk, format);
  comm::Group* g = &group;
  auto gathered = std::make_shared<at::Tensor>();
  work.and_then([g, chunk, format, w, c, gathered]() {
    torch::NoGradGuard no_grad;
    const double scale = wire_scale(chunk, format);
    const at::Tensor piece = pack(fp8_quantize(chunk, format, scale, /*saturate=*/false), 1, scale).view({-1});
    *gathered = at::empty({w * (c + kScaleBytes)}, piece.options());
    return g->all_gather(piece, *gathered);
  });
  work.and_then([flat, gathered, format, w, c]() mutable {
    torch::NoGradGuard no_grad;
    const at::Tensor all = unpack(gathered->view({w, c + kScaleBytes}), format).view({-1});
    flat.copy_(all.narrow(0, 0, flat.numel()).view(flat.sizes()));
    gathered->reset();
    return comm::Work();
  });
  return work;
}

int64_t fp8_all_reduce_bytes(int64_t numel, int world) {
  if (world <= 1) return 0;
  const int64_t c = (numel + world - 1) / world;
  return 2 * world * (c + kScaleBytes);  // the all_to_all's input and the all_gather's piece x world
}

std::vector<double> fp8_scaling_state(const std::vector<Fp8LinearPtr>& layers, const std::vector<comm::Group*>& groups) {
  if (layers.empty() || !layers.front()->options().delayed) return {};
  // Dense first: per layer and operand [scale if this rank's history has a
  // nonzero entry else 0, count, amax by age], reduced with MAX.
  const size_t h = static_cast<size_t>(layers.front()->options().history);
  const size_t row = 2 + h;
  std::vector<double> dense(layers.size() * 3 * row, 0.0);
  for (size_t l = 0; l < layers.size(); ++l)
    for (int op = 0; op < 3; ++op) {
      const DelayedScaling& d = layers[l]->history(static_cast<Fp8Linear::Operand>(op));
      double* r = &dense[(l * 3 + op) * row];
      bool seen = false;
      for (size_t a = 0; a < d.history().size(); ++a) {
        r[2 + a] = d.at_age(a);
        seen = seen || r[2 + a] > 0;
      }
      r[0] = seen ? d.scale() : 0.0;
      r[1] = static_cast<double>(d.history().size());
    }
  at::Tensor t = torch::tensor(dense, torch::kDouble);  // host: the scaling state is a few numbers per layer
  for (comm::Group* g : groups)
    if (g != nullptr && g->size() > 1) g->all_reduce(t, comm::ReduceOp::Max).wait();
  const double* v = t.data_ptr<double>();
  std::vector<double> out;
  for (size_t i = 0; i < layers.size() * 3; ++i) {
    const double* r = v + i * row;
    const size_t count = static_cast<size_t>(r[1]);
    std::vector<std::pair<size_t, double>> kept;  // entries larger than every younger one
    double younger = -1;
    for (size_t a = 0; a < count; ++a)
      if (r[2 + a] > younger) {
        kept.emplace_back(a, r[2 + a]);
        younger = r[2 + a];
      }
    out.push_back(r[0] > 0 ? r[0] : 1.0);
    out.push_back(static_cast<double>(count));
    out.push_back(static_cast<double>(kept.size()));
    for (const auto& [a, amax] : kept) {
      out.push_back(static_cast<double>(a));
      out.push_back(amax);
    }
  }
  return out;
}

void fp8_restore_scaling(const std::vector<Fp8LinearPtr>& layers, const std::vector<double>& state) {
  size_t at = 0;
  auto next = [&](const char* what) {
    if (at >= state.size())
      throw std::invalid_argument("FP8 scaling state ends early (at " + std::string(what) + "): it is for another model");
    const double x = state[at++];
    if (!std::isfinite(x) || x < 0) throw std::invalid_argument(std::string("FP8 scaling state has a bad ") + what);
    return x;
  };
  auto whole = [&](const char* what) {
    const double x = next(what);
    if (x != std::floor(x) || x > 1e12) throw std::invalid_argument(std::string("FP8 scaling state has a bad ") + what);
    return static_cast<size_t>(x);
  };
  for (const auto& layer : layers)
    for (int op = 0; op < 3; ++op) {
      const double scale = next("scale");
      if (!(scale > 0)) throw std::invalid_argument("FP8 scaling state has a scale of 0");
      const size_t count = whole("count"), k = whole("entry count");
      std::vector<std::pair<size_t, double>> entries;
      for (size_t e = 0; e < k; ++e) {
        const size_t age = whole("age");
        entries.emplace_back(age, next("amax"));
      }
      layer->history(static_cast<Fp8Linear::Operand>(op)).restore(count, scale, entries);
    }
  if (at != state.size())
    throw std::invalid_argument("FP8 scaling state has " + std::to_string(state.size() - at) +
                                " numbers left over: it is for another model");
}

}  // namespace scaletrain::precision

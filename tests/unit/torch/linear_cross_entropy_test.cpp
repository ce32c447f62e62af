// Parity tests of the chunked linear + cross-entropy kernel against the
// unfused matmul + cross_entropy reference: loss sum, count and gradients for
// odd shapes, chunk sizes that do not divide the token count, ignored
// targets, tied and frozen weights, 3-D inputs, reduced precision, the
// per-token variant, a vocabulary split across threads standing in for tensor
// parallel ranks, and the messages of bad input.
//
// Error measure: err(a, ref) = max|a - ref| / max(1, max|ref|), i.e. absolute
// for values of magnitude up to 1 and relative above. Bounds: 1e-10 (fp64),
// 1e-5 (fp32), 2e-2 (bf16).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/kernels/linear_cross_entropy.h"
#include "scaletrain/util/error.h"

namespace linear_cross_entropy_test {

using scaletrain::kernels::LinearCrossEntropyOptions;
using torch::Tensor;
namespace k = scaletrain::kernels;

struct Case {
  int64_t n = 7, c = 3, v = 5;
  at::ScalarType dtype = at::kDouble;
  bool bias = true;
  double ignored = 0.25;  // fraction of targets set to ignore_index
  int64_t chunk = 0;
};

struct Inputs {
  Tensor hidden, weight, bias, targets;
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  Inputs in;
  in.hidden = (torch::randn({c.n, c.c}, torch::kDouble) * 2).to(c.dtype);
  in.weight = (torch::randn({c.v, c.c}, torch::kDouble) / std::sqrt(double(c.c))).to(c.dtype);
  if (c.bias) in.bias = (torch::randn({c.v}, torch::kDouble) * 0.5).to(c.dtype);
  in.targets = torch::randint(0, c.v, {c.n}, torch::kLong);
  in.targets.masked_fill_(torch::rand({c.n}) < c.ignored, -100);
  return in;
}

enum class Reduce { kScaledSum, kMean };

struct Result {
  Tensor sum, count, grad_hidden, grad_weight, grad_bias;
};

using LossFn = std::function<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                                        const LinearCrossEntropyOptions&)>;

Tensor leaf(const Tensor& t, bool grad) { return t.defined() ? t.detach().clone().requires_grad_(grad) : t; }

// Runs fn on fresh leaves, forms the scalar loss as the model would, and
// returns the gradients of every leaf that asked for one.
Result run(const LossFn& fn, const Inputs& in, const LinearCrossEntropyOptions& o, Reduce reduce, double upstream,
           bool grad_hidden = true, bool grad_weight = true) {
  auto h = leaf(in.hidden, grad_hidden), w = leaf(in.weight, grad_weight), b = leaf(in.bias, true);
  auto [sum, count] = fn(h, w, b, in.targets, o);
  auto loss = reduce == Reduce::kMean ? sum / count.clamp_min(1).to(sum.scalar_type()) : sum * upstream;
  if (loss.requires_grad()) loss.backward();
  return {sum.detach(), count, h.grad(), w.grad(), b.defined() ? b.grad() : Tensor()};
}

double err(const Tensor& a, const Tensor& ref) {
  const auto r = ref.to(torch::kDouble);
  const double scale = std::max(1.0, r.numel() ? r.abs().max().item<double>() : 0.0);
  return a.numel() ? (a.to(torch::kDouble) - r).abs().max().item<double>() / scale : 0.0;
}

double tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : t == at::kFloat ? 1e-5 : 2e-2; }

void expect_close(const Tensor& a, const Tensor& ref, double tol, const char* what) {
  ASSERT_EQ(a.defined(), ref.defined()) << what;
  if (!ref.defined()) return;
  ASSERT_EQ(a.sizes(), ref.sizes()) << what;
  EXPECT_EQ(a.scalar_type(), ref.scalar_type()) << what;
  EXPECT_FALSE(a.isnan().any().item<bool>()) << what;
  EXPECT_LE(err(a, ref), tol) << what;
}

void expect_same(const Result& fused, const Result& ref, double tol) {
  expect_close(fused.sum, ref.sum, tol, "loss sum");
  EXPECT_EQ(fused.count.item<int64_t>(), ref.count.item<int64_t>());
  EXPECT_EQ(fused.count.scalar_type(), at::kLong);
  EXPECT_EQ(fused.count.dim(), 0);
  EXPECT_EQ(fused.sum.dim(), 0);
  expect_close(fused.grad_hidden, ref.grad_hidden, tol, "grad hidden");
  expect_close(fused.grad_weight, ref.grad_weight, tol, "grad weight");
  expect_close(fused.grad_bias, ref.grad_bias, tol, "grad bias");
}

void compare(const Case& c, Reduce reduce, uint64_t seed, const LinearCrossEntropyOptions& base = {}) {
  SCOPED_TRACE("N=" + std::to_string(c.n) + " C=" + std::to_string(c.c) + " V=" + std::to_string(c.v) +
               " chunk=" + std::to_string(c.chunk) + " bias=" + std::to_string(c.bias) + " dtype=" +
               std::string(c10::toString(c.dtype)));
  const auto in = make_inputs(c, seed);
  auto o = base;
  o.chunk_tokens = c.chunk;
  const double upstream = 0.5 + torch::rand({1}).item<double>();
  const auto ref = run(k::linear_cross_entropy_unfused, in, o, reduce, upstream);
  const auto fused = run(k::linear_cross_entropy, in, o, reduce, upstream);
  expect_same(fused, ref, tolerance(c.dtype));
}

TEST(LinearCrossEntropy, OddShapesMatchReferenceInDouble) {
  uint64_t seed = 1;
  for (int64_t n : {1, 7, 130})
    for (int64_t v : {1, 5, 1000})
      for (int64_t c : {1, 3, 48})
        for (int64_t chunk : {0, 3, 64}) compare({n, c, v, at::kDouble, (n + v) % 2 == 0, 0.25, chunk}, Reduce::kScaledSum, seed++);
}

TEST(LinearCrossEntropy, FloatAndMeanOverCount) {
  uint64_t seed = 100;
  for (auto dtype : {at::kFloat, at::kDouble})
    for (int64_t chunk : {0, 1, 5, 17}) {
      compare({130, 48, 1000, dtype, true, 0.3, chunk}, Reduce::kMean, seed++);
      compare({130, 48, 1000, dtype, false, 0.3, chunk}, Reduce::kScaledSum, seed++);
    }
  EXPECT_EQ(std::get<0>(k::linear_cross_entropy(torch::randn({2, 3}), torch::randn({4, 3}), {},
                                                 torch::zeros({2}, torch::kLong))).scalar_type(),
            at::kFloat);
}

TEST(LinearCrossEntropy, ReducedPrecisionIsCloseAndKeepsInputDtypes) {
  for (bool upcast : {true, false})
    for (auto dtype : {at::kBFloat16, at::kHalf}) {
      if (dtype == at::kHalf && !upcast) continue;  // libtorch 1.13 has no fp16 matmul on CPU
      LinearCrossEntropyOptions o;
      o.upcast = upcast;
      compare({130, 48, 1000, dtype, true, 0.2, 7}, Reduce::kMean, 7, o);
    }
  const auto in = make_inputs({9, 8, 50, at::kBFloat16}, 3);
  auto [sum, count] = k::linear_cross_entropy(in.hidden, in.weight, in.bias, in.targets);
  EXPECT_EQ(sum.scalar_type(), at::kFloat);
}

TEST(LinearCrossEntropy, AllTargetsIgnored) {
  const Case c{7, 3, 5, at::kDouble, true, 1.0, 3};
  const auto in = make_inputs(c, 11);
  ASSERT_TRUE(in.targets.eq(-100).all().item<bool>());
  for (auto reduce : {Reduce::kMean, Reduce::kScaledSum}) {
    const auto r = run(k::linear_cross_entropy, in, {}, reduce, 1.5);
    EXPECT_EQ(r.sum.item<double>(), 0.0);
    EXPECT_EQ(r.count.item<int64_t>(), 0);
    for (const auto& g : {r.grad_hidden, r.grad_weight, r.grad_bias}) {
      EXPECT_FALSE(g.isnan().any().item<bool>());
      EXPECT_EQ(g.abs().max().item<double>(), 0.0);
    }
  }
}

TEST(LinearCrossEntropy, TiedWeightGradientsAddUp) {
  const auto in = make_inputs({130, 48, 1000, at::kDouble, false, 0.1, 17}, 21);
  auto tied = [&](const LossFn& fn) {
    auto h = leaf(in.hidden, true), w = leaf(in.weight, true);
    LinearCrossEntropyOptions o;
    o.chunk_tokens = 17;
    auto [sum, count] = fn(h, w, {}, in.targets, o);
    (sum / count.clamp_min(1) + (w * w).sum() + (h.matmul(w.t())).sum()).backward();
    return std::make_pair(h.grad(), w.grad());
  };
  const auto ref = tied(k::linear_cross_entropy_unfused);
  const auto fused = tied(k::linear_cross_entropy);
  expect_close(fused.first, ref.first, 1e-10, "grad hidden");
  expect_close(fused.second, ref.second, 1e-10, "grad weight");
}

TEST(LinearCrossEntropy, FrozenHeadOrFrozenHidden) {
  const auto in = make_inputs({40, 16, 200, at::kDouble, true, 0.2, 6}, 31);
  for (bool hidden_grad : {true, false}) {
    SCOPED_TRACE(hidden_grad ? "frozen weight" : "frozen hidden");
    LinearCrossEntropyOptions o;
    o.chunk_tokens = 6;
    const auto ref = run(k::linear_cross_entropy_unfused, in, o, Reduce::kMean, 1.0, hidden_grad, !hidden_grad);
    const auto fused = run(k::linear_cross_entropy, in, o, Reduce::kMean, 1.0, hidden_grad, !hidden_grad);
    expect_same(fused, ref, 1e-10);
    EXPECT_EQ(fused.grad_hidden.defined(), hidden_grad);
    EXPECT_EQ(fused.grad_weight.defined(), !hidden_grad);
  }
}

TEST(LinearCrossEntropy, SecondBackwardThroughTheSameLossIsRefused) {
  const auto in = make_inputs({9, 4, 20, at::kDouble, false, 0.0, 4}, 35);
  auto h = leaf(in.hidden, true);
  auto sum = std::get<0>(k::linear_cross_entropy(h, in.weight, {}, in.targets));
  sum.backward({}, /*retain_graph=*/true);
  EXPECT_THROW(sum.backward(), std::runtime_error);
}

TEST(LinearCrossEntropy, ThreeDimensionalHiddenAndTargets) {
  auto in = make_inputs({2 * 13, 24, 300, at::kFloat, true, 0.2, 5}, 41);
  in.hidden = in.hidden.reshape({2, 13, 24});
  in.targets = in.targets.reshape({2, 13});
  LinearCrossEntropyOptions o;
  o.chunk_tokens = 5;
  const auto ref = run(k::linear_cross_entropy_unfused, in, o, Reduce::kMean, 1.0);
  const auto fused = run(k::linear_cross_entropy, in, o, Reduce::kMean, 1.0);
  expect_same(fused, ref, 1e-5);
  EXPECT_EQ(fused.grad_hidden.sizes(), (std::vector<int64_t>{2, 13, 24}));
}

TEST(LinearCrossEntropy, PerTokenLossesAndWeightedBackward) {
  const auto in = make_inputs({130, 48, 1000, at::kDouble, true, 0.3, 9}, 51);
  const auto token_weights = torch::rand({130}, torch::kDouble);
  LinearCrossEntropyOptions o;
  o.chunk_tokens = 9;
  auto weighted = [&](auto fn) {
    auto h = leaf(in.hidden, true), w = leaf(in.weight, true), b = leaf(in.bias, true);
    auto losses = fn(h, w, b, in.targets, o);
    (losses * token_weights).sum().backward();
    return Result{losses.detach(), Tensor(), h.grad(), w.grad(), b.grad()};
  };
  const auto ref = weighted(k::linear_cross_entropy_per_token_unfused);
  const auto fused = weighted(k::linear_cross_entropy_per_token);
  expect_close(fused.sum, ref.sum, 1e-10, "per-token losses");
  EXPECT_TRUE(fused.sum.masked_select(in.targets.eq(-100)).eq(0).all().item<bool>());
  expect_close(fused.grad_hidden, ref.grad_hidden, 1e-10, "grad hidden");
  expect_close(fused.grad_weight, ref.grad_weight, 1e-10, "grad weight");
  expect_close(fused.grad_bias, ref.grad_bias, 1e-10, "grad bias");
}

TEST(LinearCrossEntropy, NoGradModeBuildsNoGraph) {
  const auto in = make_inputs({30, 8, 100, at::kDouble, true, 0.2, 4}, 61);
  auto h = leaf(in.hidden, true), w = leaf(in.weight, true);
  const auto ref = std::get<0>(k::linear_cross_entropy_unfused(h, w, in.bias, in.targets));
  torch::NoGradGuard no_grad;
  const auto [sum, count] = k::linear_cross_entropy(h, w, in.bias, in.targets);
  EXPECT_FALSE(sum.requires_grad());
  EXPECT_LE(err(sum, ref.detach()), 1e-10);
  EXPECT_LE(err(k::linear_cross_entropy_per_token(h, w, in.bias, in.targets),
                k::linear_cross_entropy_per_token_unfused(h, w, in.bias, in.targets)),
            1e-10);
}

TEST(LinearCrossEntropy, DispatchAndChunkSize) {
  EXPECT_TRUE(k::fused_linear_cross_entropy_applies(torch::zeros({2, 3})));
  EXPECT_FALSE(k::fused_linear_cross_entropy_applies(torch::empty({2, 3}, torch::device(torch::kMeta))));
  for (int64_t v : {1, 1000, 32000, 128256, 256000}) {
    const int64_t rows = k::linear_cross_entropy_chunk_tokens(v, 4, 0);
    const double mib = double(rows * v * 4) / (1 << 20);
    EXPECT_GE(rows, 128) << v;
    if (rows > 128) EXPECT_GE(mib, 4.0) << v;
    EXPECT_LE(mib, rows > 128 ? 8.0 : 128.0 * v * 4 / (1 << 20)) << v;
  }
  EXPECT_EQ(k::linear_cross_entropy_chunk_tokens(1000, 4, 0), 2097);
  EXPECT_EQ(k::linear_cross_entropy_chunk_tokens(128256, 4, 0), 128);
  EXPECT_EQ(k::linear_cross_entropy_chunk_tokens(int64_t{4} << 20, 4, 0), 128);
  EXPECT_EQ(k::linear_cross_entropy_chunk_tokens(128256, 4, 77), 77);
}

// Threads standing in for the ranks of a tensor-parallel group: each reduce
// waits for all of them and hands every one the same elementwise maximum or
// sum (rank order), as an all-reduce would.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), parts_(size) {}

  void reduce(int rank, Tensor& t, bool max) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t round = round_;
    parts_[rank] = t.clone();
    if (++arrived_ == size_) {
      result_ = parts_[0];
      for (int r = 1; r < size_; ++r) result_ = max ? torch::maximum(result_, parts_[r]) : result_ + parts_[r];
      arrived_ = 0;
      ++round_;
      done_.notify_all();
    } else {
      done_.wait(lock, [&] { return round_ != round; });
    }
    t.copy_(result_);
  }

 private:
  int size_, arrived_ = 0;
  uint64_t round_ = 0;
  std::vector<Tensor> parts_;
  Tensor result_;
  std::mutex mutex_;
  std::condition_variable done_;
};

// The head's rows split unevenly over three threads (Note [A vocabulary split
// across ranks]): every part returns the whole vocabulary's loss sum and
// count, its rows' weight and bias gradients are those rows of the unsplit
// gradients, and the parts' hidden gradients add up to the unsplit one.
void compare_split(const Case& c, const std::vector<int64_t>& rows, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(c.n) + " V=" + std::to_string(c.v) + " chunk=" + std::to_string(c.chunk) +
               " dtype=" + std::string(c10::toString(c.dtype)));
  const auto in = make_inputs(c, seed);
  LinearCrossEntropyOptions base;
  base.chunk_tokens = c.chunk;
  const double upstream = 0.75;
  const auto ref = run(k::linear_cross_entropy_unfused, in, base, Reduce::kScaledSum, upstream);
  const int parts = static_cast<int>(rows.size());
  ThreadGroup group(parts);
  std::vector<Result> got(parts);
  std::vector<std::thread> threads;
  int64_t first = 0;
  for (int r = 0; r < parts; ++r) {
    Inputs mine = in;
    mine.weight = in.weight.narrow(0, first, rows[r]);
    if (c.bias) mine.bias = in.bias.narrow(0, first, rows[r]);
    auto o = base;
    o.vocab_shard = k::VocabShard{first, c.v, [&group, r](Tensor& t) { group.reduce(r, t, true); },
                                  [&group, r](Tensor& t) { group.reduce(r, t, false); }};
    threads.emplace_back(
        [&got, r, mine, o, upstream] { got[r] = run(k::linear_cross_entropy, mine, o, Reduce::kScaledSum, upstream); });
    first += rows[r];
  }
  for (auto& t : threads) t.join();
  const double tol = tolerance(c.dtype);
  Tensor hidden_sum = torch::zeros_like(ref.grad_hidden);
  first = 0;
  for (int r = 0; r < parts; ++r) {
    expect_close(got[r].sum, ref.sum, tol, "loss sum");
    EXPECT_EQ(got[r].count.item<int64_t>(), ref.count.item<int64_t>());
    expect_close(got[r].grad_weight, ref.grad_weight.narrow(0, first, rows[r]), tol, "grad weight rows");
    if (c.bias) expect_close(got[r].grad_bias, ref.grad_bias.narrow(0, first, rows[r]), tol, "grad bias rows");
    hidden_sum += got[r].grad_hidden;
    first += rows[r];
  }
  expect_close(hidden_sum, ref.grad_hidden, tol, "grad hidden (sum of the parts)");
}

TEST(LinearCrossEntropy, VocabularySplitAcrossRanksMatchesTheWholeHead) {
  uint64_t seed = 500;
  for (int64_t n : {1, 7, 130})
    for (int64_t chunk : {0, 3}) {
      compare_split({n, 5, 11, at::kDouble, n % 2 == 1, 0.25, chunk}, {4, 4, 3}, seed++);
      compare_split({n, 48, 1000, at::kFloat, false, 0.25, chunk}, {500, 500}, seed++);
    }
  // Every target ignored: zero loss and gradients on every part.
  compare_split({9, 4, 6, at::kDouble, true, 1.0, 0}, {3, 3}, seed++);
}

// Runs fn and returns the UsageError message ("" if none was thrown).
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const scaletrain::UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(LinearCrossEntropy, BadInputNamesTheValues) {
  const auto h = torch::randn({7, 3}), w = torch::randn({5, 3});
  auto t = torch::randint(0, 5, {7}, torch::kLong);
  auto expect_message = [](const std::string& m, std::initializer_list<const char*> parts) {
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    for (const char* p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' missing in: " << m;
  };
  for (auto fn : {k::linear_cross_entropy, k::linear_cross_entropy_unfused}) {
    auto high = t.clone();
    high[3] = 5;
    expect_message(message_of([&] { fn(h, w, {}, high, {}); }), {"target 5", "token 3", "[0, 5)", "-100"});
    auto negative = t.clone();
    negative[6] = -1;
    expect_message(message_of([&] { fn(h, w, {}, negative, {}); }), {"target -1", "token 6"});
    expect_message(message_of([&] { fn(h, torch::randn({5, 4}), {}, t, {}); }), {"C=3", "[5, 4]"});
    expect_message(message_of([&] { fn(h, w, {}, t.to(torch::kInt), {}); }), {"int64", "Int"});
    expect_message(message_of([&] { fn(h, w, {}, t.narrow(0, 0, 6), {}); }), {"6 elements", "7 tokens"});
    expect_message(message_of([&] { fn(h, w, torch::zeros({4}), t, {}); }), {"[5]", "[4]"});
  }
  LinearCrossEntropyOptions o;
  o.ignore_index = 7;
  auto ignored = t.clone();
  ignored[0] = 7;
  EXPECT_EQ(message_of([&] { k::linear_cross_entropy(h, w, {}, ignored, o); }), "");

  // A split vocabulary: the rows must lie inside it, targets index all of
  // it, and the paths that cannot reduce across ranks refuse it.
  auto noop = [](Tensor&) {};
  LinearCrossEntropyOptions split;
  split.vocab_shard = k::VocabShard{4, 8, noop, noop};
  expect_message(message_of([&] { k::linear_cross_entropy(h, w, {}, t, split); }), {"[4, 9)", "vocabulary of 8"});
  split.vocab_shard = k::VocabShard{3, 8, noop, noop};
  auto beyond = t.clone();
  beyond[2] = 8;
  expect_message(message_of([&] { k::linear_cross_entropy(h, w, {}, beyond, split); }), {"target 8", "[0, 8)"});
  expect_message(message_of([&] { k::linear_cross_entropy_per_token(h, w, {}, t, split); }), {"per-token"});
  expect_message(message_of([&] { k::linear_cross_entropy_unfused(h, w, {}, t, split); }), {"unfused"});
  split.vocab_shard = k::VocabShard{3, 8, noop, nullptr};
  expect_message(message_of([&] { k::linear_cross_entropy(h, w, {}, t, split); }), {"sum_across"});
}

}  // namespace linear_cross_entropy_test

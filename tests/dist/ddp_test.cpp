// DDP against the single-process reference: same initial weights and the
// same global batch must give the same parameters after 5 AdamW steps, for
// any world size and any micro-batch split (DESIGN: the invariant).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "dist_env.h"
#include "reference.h"
#include "scaletrain/comm/compat.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"

namespace scaletrain::test {
namespace ddp_test {

constexpr int64_t kGlobalBatch = 48;  // divisible by 1..4 ranks x 1, 2, 4 micro-batches
constexpr int kSteps = 5;

models::GPTConfig small_gpt() { return models::GPTConfig{64, 16, 2, 2, 32}; }

// The global batch of each step: the same on every rank (fixed seed).
std::vector<Batch> make_data() { return make_batches(kSteps, kGlobalBatch, 16, 64, 1234); }

// Parity runs in float64 and float32. Note [Adam amplifies summation order]:
// gradients from DDP match the reference to ~1e-7 relative in fp32 (the sum
// runs in another order), but Adam divides each element by its own RMS, so an
// element whose gradient is near zero (|g| ~ eps) turns that 1e-7 into a
// visible change of its update. In fp64 the same noise is ~1e-16 and the
// comparison checks the algorithm alone, at the invariant's 1e-5; in fp32 the
// learning rate is kept at 1e-4 so that amplified noise stays below 1e-5 of
// the parameters' scale while the weights still move by ~1%.
at::ScalarType g_dtype = at::kFloat;
double g_lr = 1e-2;

models::GPT make_model() {
  torch::manual_seed(42);
  auto m = models::GPT(small_gpt());
  m->to(g_dtype);
  return m;
}

// `norms`, if given, gets the gradient norm before clipping of every step.
std::vector<at::Tensor> train_reference(const std::vector<Batch>& data, std::vector<double>* norms = nullptr) {
  auto model = make_model();
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  for (auto& b : data) {
    model->loss(b.x, b.y).backward();
    const double norm = optim::clip_grad_norm(params, 1.0);
    if (norms) norms->push_back(norm);
    opt.step(g_lr);
    opt.zero_grad();
  }
  return params;
}

// DDP over `group` with `accum` micro-batches per step.
std::vector<at::Tensor> train_ddp(const std::vector<Batch>& data, comm::Group& group, int accum,
                                  parallel::DDPOptions ddp_opts = {}, std::vector<double>* norms = nullptr) {
  auto model = make_model();
  parallel::DistributedDataParallel ddp(model.ptr(), group, ddp_opts);
  auto params = model->parameters();
  optim::AdamW opt(params, optim::decay_matrices(params), {});
  const int64_t local = kGlobalBatch / group.size(), micro = local / accum;
  for (auto& b : data) {
    for (int k = 0; k < accum; ++k) {
      const int64_t start = group.rank() * local + k * micro;
      auto loss = model->loss(b.x.narrow(0, start, micro), b.y.narrow(0, start, micro)) / accum;
      if (k + 1 < accum) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    const double norm = optim::clip_grad_norm(params, 1.0);
    if (norms) norms->push_back(norm);
    opt.step(g_lr);
    opt.zero_grad();
  }
  return params;
}

double max_relative_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, bool per_tensor = true) {
  return relative_diff(a, b, per_tensor);
}

class DDPParity : public ::testing::TestWithParam<std::tuple<at::ScalarType, int>> {
 protected:
  void SetUp() override {
    g_dtype = std::get<0>(GetParam());
    g_lr = g_dtype == at::kDouble ? 1e-2 : 1e-4;
  }
  void TearDown() override {
    g_dtype = at::kFloat;
    g_lr = 1e-2;
  }
};

TEST_P(DDPParity, MatchesSingleProcessAfterFiveSteps) {
  const int accum = std::get<1>(GetParam());
  auto data = make_data();
  auto ref = train_reference(data);
  auto got = train_ddp(data, *world().group(), accum);
  const double diff = max_relative_diff(got, ref, /*per_tensor=*/g_dtype == at::kDouble);
  RecordProperty("max_relative_diff", std::to_string(diff));
  EXPECT_LE(diff, 1e-5) << "world " << world().size() << ", accumulation " << accum;
  if (world().rank() == 0)
    std::printf("[parity] %s world %d accumulation %d: max relative diff %.3g\n", c10::toString(g_dtype),
                world().size(), accum, diff);
  // The initial weights must actually have moved, or the comparison is empty.
  expect_weights_moved(got, make_model()->parameters(), g_lr, kSteps, "ddp accumulation " + std::to_string(accum));
}

INSTANTIATE_TEST_SUITE_P(DtypeAndAccumulation, DDPParity,
                         ::testing::Combine(::testing::Values(at::kDouble, at::kFloat), ::testing::Values(1, 2, 4)));

TEST(DDP, SmallBucketsGiveTheSameResult) {
  g_dtype = at::kDouble;
  auto data = make_data();
  parallel::DDPOptions o;
  o.bucket_cap_bytes = 4096;
  o.first_bucket_cap_bytes = 1024;
  o.last_bucket_cap_bytes = 512;  // and a tapered tail (Note [Bucket tail])
  auto ref = train_reference(data);
  EXPECT_LE(max_relative_diff(train_ddp(data, *world().group(), 1, o), ref), 1e-5);
  g_dtype = at::kFloat;
}

// bf16 communication against the fp32 run (the same mode but for the wire).
// As in Note [bf16 parity bounds] (mixed_precision_test.cpp), with u = 2^-8:
// each rank's averaged gradient is rounded to bf16 once before the sum and
// the sum once after, so an element is off by at most u x (its per-rank
// parts) + u x (itself), and the norm by at most 3u (per-rank gradients are
// larger than their mean, not 2x larger on this batch). The parameters after
// 5 AdamW steps: the median element off by at most 2 x 4 x 3u x lr x steps
// (AdamW is scale-free per element; the median element's gradient is at
// least 1/4 of its parts). lr 1e-2 makes the update large next to that: a
// run that never moved, skipped a step or summed instead of averaging fails.
TEST(DDP, Bf16CommunicationStaysClose) {
  constexpr double kU = 1.0 / 256;
  auto data = make_data();
  parallel::DDPOptions o;
  o.comm_dtype = at::kBFloat16;
  g_lr = 1e-2;
  std::vector<double> ref_norms, norms;
  const auto ref = train_reference(data, &ref_norms);
  const auto got = train_ddp(data, *world().group(), 1, o, &norms);
  const auto init = make_model()->parameters();
  ASSERT_EQ(norms.size(), ref_norms.size());
  double worst_norm = 0;
  for (size_t s = 0; s < norms.size(); ++s) {
    const double d = std::abs(norms[s] - ref_norms[s]) / ref_norms[s];
    EXPECT_LE(d, 3 * kU) << "step " << s + 1 << ": norm " << norms[s] << " vs fp32 " << ref_norms[s];
    worst_norm = std::max(worst_norm, d);
  }
  const double bound = 2 * 4 * 3 * kU * g_lr * kSteps;
  const double median = median_abs_diff(got, ref), update = median_abs_diff(ref, init);
  EXPECT_LE(median, bound);
  EXPECT_GE(update, 3 * bound) << "the update must dwarf the bound, or the comparison proves nothing";
  expect_weights_moved(got, init, g_lr, kSteps, "ddp bf16 communication");
  // and it is not silently fp32: bf16 rounding must be visible
  EXPECT_GT(max_relative_diff(got, ref, /*per_tensor=*/false), 1e-7);
  if (world().rank() == 0)
    std::printf(
        "[parity] ddp bf16 communication world %d: norms off by <= %.2e, median |diff| %.2e (bound %.2e), "
        "median update %.2e\n",
        world().size(), worst_norm, median, bound, update);
}

TEST(DDP, BucketsFollowReverseRegistrationOrder) {
  auto model = make_model();
  parallel::DDPOptions o;
  o.first_bucket_cap_bytes = 1;  // the last parameter alone in bucket 0
  o.bucket_cap_bytes = 1 << 30;
  o.last_bucket_cap_bytes = 0;  // no tapered tail
  parallel::DistributedDataParallel ddp(model.ptr(), *world().group(), o);
  auto layout = ddp.bucket_layout();
  ASSERT_EQ(layout.size(), 2u);
  auto names = model->named_parameters().keys();
  EXPECT_EQ(layout[0].front(), names.back());
  EXPECT_EQ(layout[1].back(), names.front());
}

// Sixteen parameters of 4 KiB each, registered p00..p15.
struct Uniform : torch::nn::Module {
  Uniform() {
    for (int i = 0; i < 16; ++i)
      ps.push_back(register_parameter((i < 10 ? "p0" : "p") + std::to_string(i), torch::zeros({1024})));
  }
  std::vector<torch::Tensor> ps;
};

// Note [Bucket tail]: the first bucket and the last ones are small; walking
// back from the end, each tail bucket may be twice the one after it.
TEST(DDP, BucketTailIsTapered) {
  parallel::DDPOptions o;
  o.first_bucket_cap_bytes = 4 << 10;
  o.bucket_cap_bytes = 16 << 10;
  o.last_bucket_cap_bytes = 4 << 10;
  o.tail_growth = 2;
  parallel::DistributedDataParallel ddp(std::make_shared<Uniform>(), *world().group(), o);
  const std::vector<std::vector<std::string>> want = {
      {"p15"}, {"p14", "p13", "p12", "p11"}, {"p10", "p09", "p08", "p07"}, {"p06", "p05", "p04", "p03"}, {"p02", "p01"},
      {"p00"}};
  EXPECT_EQ(ddp.bucket_layout(), want);
  // A model smaller than the taper keeps its small first bucket.
  o.bucket_cap_bytes = 1 << 20;
  parallel::DistributedDataParallel small(std::make_shared<Uniform>(), *world().group(), o);
  const std::vector<std::vector<std::string>> want_small = {{"p15"},
                                                            {"p14", "p13", "p12", "p11", "p10", "p09", "p08", "p07"},
                                                            {"p06", "p05", "p04", "p03"},
                                                            {"p02", "p01"},
                                                            {"p00"}};
  EXPECT_EQ(small.bucket_layout(), want_small);
  o.bucket_cap_bytes = 16 << 10;
  // Growth 1: every bucket at the last bucket's cap.
  o.tail_growth = 1;
  parallel::DistributedDataParallel even(std::make_shared<Uniform>(), *world().group(), o);
  EXPECT_EQ(even.num_buckets(), 16);
  // A tail cap at or above the bucket cap leaves the plain layout.
  o.last_bucket_cap_bytes = 16 << 10;
  parallel::DistributedDataParallel plain(std::make_shared<Uniform>(), *world().group(), o);
  EXPECT_EQ(plain.num_buckets(), 5);
  EXPECT_EQ(plain.bucket_layout().back(), (std::vector<std::string>{"p02", "p01", "p00"}));
}

// Parameter names in the order their AccumulateGrad nodes finish, recorded by
// hooks of the test's own (independent of DDP's).
struct ReadyOrder {
  explicit ReadyOrder(torch::nn::Module& m) {
    for (auto& item : m.named_parameters()) {
      auto acc = torch::autograd::impl::grad_accumulator(item.value());
      acc->add_post_hook(comm::compat::post_hook([names = names, name = item.key()] { names->push_back(name); }));
      accumulators.push_back(std::move(acc));
    }
  }
  std::shared_ptr<std::vector<std::string>> names = std::make_shared<std::vector<std::string>>();
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
};

std::vector<std::string> flatten(const std::vector<std::vector<std::string>>& layout) {
  std::vector<std::string> out;
  for (auto& b : layout) out.insert(out.end(), b.begin(), b.end());
  return out;
}

// Registered a, b, c, d but applied b, d, a, c: backward produces c's
// gradients first and b's last, far from reverse registration order.
struct Shuffled : torch::nn::Module {
  Shuffled() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    c = register_module("c", torch::nn::Linear(4, 4));
    d = register_module("d", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c(torch::tanh(a(torch::tanh(d(torch::tanh(b(x))))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr};
};

// One parameter per bucket: the layout is the order.
parallel::DDPOptions one_per_bucket() {
  parallel::DDPOptions o;
  o.first_bucket_cap_bytes = 1;
  o.bucket_cap_bytes = 1;
  return o;
}

TEST(DDP, BucketsAreRebuiltInGradientReadyOrder) {
  torch::manual_seed(0);
  auto m = std::make_shared<Shuffled>();
  parallel::DistributedDataParallel ddp(m, *world().group(), one_per_bucket());
  ReadyOrder seen(*m);
  const auto before = ddp.bucket_layout();
  EXPECT_FALSE(ddp.buckets_rebuilt());
  EXPECT_EQ(before.front().front(), "d.bias");  // reverse registration
  {
    auto guard = ddp.no_sync();  // no_sync backwards neither record nor rebuild
    m->forward(torch::ones({2, 4})).sum().backward();
  }
  EXPECT_FALSE(ddp.buckets_rebuilt());
  EXPECT_EQ(ddp.bucket_layout(), before);
  seen.names->clear();
  m->forward(torch::ones({2, 4})).sum().backward();
  ASSERT_TRUE(ddp.buckets_rebuilt());
  const auto after = ddp.bucket_layout();
  EXPECT_EQ(flatten(after), *seen.names);
  EXPECT_EQ(after.size(), before.size());
  EXPECT_EQ(after.front().front().substr(0, 2), "c.");
  EXPECT_EQ(after.back().front().substr(0, 2), "b.");
  // Rebuilt once: later steps keep the layout.
  m->forward(torch::ones({2, 4})).sum().backward();
  EXPECT_EQ(ddp.bucket_layout(), after);
}

TEST(DDP, TiedEmbeddingEndsInTheLastBucket) {
  auto model = make_model();
  parallel::DistributedDataParallel ddp(model.ptr(), *world().group(), one_per_bucket());
  ReadyOrder seen(*model);
  auto data = make_data();
  model->loss(data[0].x.narrow(0, 0, 4), data[0].y.narrow(0, 0, 4)).backward();
  ASSERT_TRUE(ddp.buckets_rebuilt());
  const auto layout = ddp.bucket_layout();
  EXPECT_EQ(flatten(layout), *seen.names);
  // wte is complete only after the embedding's backward, the last thing
  // backward does; only wpe (the other embedding, ready at the same time) may
  // follow it.
  size_t wte_bucket = layout.size();
  for (size_t b = 0; b < layout.size(); ++b)
    for (auto& n : layout[b])
      if (n == "wte.weight") wte_bucket = b;
  ASSERT_LT(wte_bucket, layout.size());
  for (size_t b = wte_bucket + 1; b < layout.size(); ++b) EXPECT_EQ(layout[b], std::vector<std::string>{"wpe.weight"});
  EXPECT_GE(wte_bucket + 2, layout.size());
}

// The rebuild carries the reduced gradients over and keeps .grad the bucket
// views: gradients after the first and later steps equal those of a DDP that
// never rebuilds, with and without no_sync accumulation.
TEST(DDP, RebuildKeepsGradients) {
  g_dtype = at::kDouble;
  auto data = make_data();
  auto a = make_model(), b = make_model();
  auto o = one_per_bucket();
  parallel::DistributedDataParallel da(a.ptr(), *world().group(), o);
  o.rebuild_buckets = false;
  parallel::DistributedDataParallel db(b.ptr(), *world().group(), o);
  const int64_t micro = 2, start = world().rank() * 2 * micro;
  for (int step = 0; step < 3; ++step) {
    for (auto* m : {&a, &b}) {
      auto& ddp = m == &a ? da : db;
      auto x = data[step].x.narrow(0, start, 2 * micro), y = data[step].y.narrow(0, start, 2 * micro);
      {
        auto guard = ddp.no_sync();
        (*m)->loss(x.narrow(0, 0, micro), y.narrow(0, 0, micro)).backward();
      }
      (*m)->loss(x.narrow(0, micro, micro), y.narrow(0, micro, micro)).backward();
    }
    EXPECT_TRUE(da.buckets_rebuilt());
    EXPECT_FALSE(db.buckets_rebuilt());
    auto pa = a->named_parameters(), pb = b->named_parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      auto &ga = pa[i].value().mutable_grad(), &gb = pb[i].value().mutable_grad();
      EXPECT_TRUE(torch::allclose(ga, gb, 1e-12, 1e-14)) << pa[i].key() << " step " << step;
      // zero_grad as the optimizer does it: in place, keeping the views.
      ga.zero_();
      gb.zero_();
    }
  }
  g_dtype = at::kFloat;
}

TEST(DDP, RebuiltBucketsWithAccumulationMatchReference) {
  g_dtype = at::kDouble;
  auto data = make_data();
  auto ref = train_reference(data);
  EXPECT_LE(max_relative_diff(train_ddp(data, *world().group(), 2, one_per_bucket()), ref), 1e-5);
  g_dtype = at::kFloat;
}

TEST(DDP, BroadcastsRankZeroWeights) {
  torch::manual_seed(100 + world().rank());  // different weights on every rank
  auto model = models::GPT(small_gpt());
  parallel::DistributedDataParallel ddp(model.ptr(), *world().group());
  auto p = model->parameters().front().clone();
  auto max = p.clone(), min = p.clone();
  world().group()->all_reduce(max, comm::ReduceOp::Max).wait();
  world().group()->all_reduce(min, comm::ReduceOp::Min).wait();
  EXPECT_TRUE(torch::equal(max, min));
}

TEST(DDP, NoSyncCommunicatesOncePerStep) {
  auto model = make_model();
  parallel::DistributedDataParallel ddp(model.ptr(), *world().group());
  auto data = make_data();
  auto x = data[0].x.narrow(0, 0, 4), y = data[0].y.narrow(0, 0, 4);
  {
    auto guard = ddp.no_sync();
    model->loss(x, y).backward();
    model->loss(x, y).backward();
  }
  EXPECT_EQ(ddp.bytes_reduced(), 0);
  model->loss(x, y).backward();
  int64_t grad_bytes = 0;
  for (auto& p : model->parameters()) grad_bytes += p.numel() * 4;
  EXPECT_EQ(ddp.bytes_reduced(), grad_bytes);
}

// A module with a branch that one forward skips.
struct TwoHeads : torch::nn::Module {
  TwoHeads() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_b) { return use_b ? b(a(x)) : a(x); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

TEST(DDP, UnusedParameterIsAClearError) {
  torch::manual_seed(0);
  auto m = std::make_shared<TwoHeads>();
  parallel::DistributedDataParallel ddp(m, *world().group());
  try {
    m->forward(torch::ones({2, 4}), false).sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("b.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("find_unused_parameters"), std::string::npos) << e.what();
  }
}

// A module wrapped twice would average its gradients twice; parameters on
// two devices cannot share buckets. Both are named before any communication;
// once the first engine is gone the module may be wrapped again.
TEST(DDP, WrappedTwiceOrTwoDevicesIsNamed) {
  auto expect_refused = [](const std::function<void()>& wrap, const std::string& part) {
    try {
      wrap();
      ADD_FAILURE() << "accepted; expected an error naming '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  torch::manual_seed(0);
  auto m = std::make_shared<TwoHeads>();
  {
    parallel::DistributedDataParallel first(m, *world().group());
    expect_refused([&] { parallel::DistributedDataParallel second(m, *world().group()); },
                   "parameter 'a.weight' is already in another live DDP (the module is wrapped twice)");
  }
  parallel::DistributedDataParallel again(m, *world().group());  // the first is gone
  auto split = std::make_shared<torch::nn::Module>();
  split->register_parameter("w", torch::zeros({4, 4}));
  split->register_parameter("v", torch::empty({4, 4}, torch::TensorOptions().device(torch::kMeta)));
  expect_refused([&] { parallel::DistributedDataParallel ddp(split, *world().group()); },
                 "DDP: parameters on different devices: 'w' on cpu, 'v' on meta");
}

// BatchNorm's running statistics follow rank 0's after every synchronized
// backward (PyTorch's broadcast_buffers), so a rank's next forward and an
// evaluation see the same buffers everywhere; with the option off each rank
// keeps what its own batches gave.
TEST(DDP, BuffersFollowRankZeroAfterEachStep) {
  if (world().size() < 2) GTEST_SKIP() << "needs two ranks";
  auto running_means = [](bool broadcast) {
    torch::manual_seed(0);
    auto net = std::make_shared<torch::nn::SequentialImpl>(torch::nn::Linear(4, 4), torch::nn::BatchNorm1d(4));
    parallel::DDPOptions o;
    o.broadcast_buffers = broadcast;
    parallel::DistributedDataParallel ddp(net, *world().group(), o);
    for (int step = 0; step < 2; ++step) {
      // Each rank's own batch: its statistics differ from rank 0's.
      torch::manual_seed(100 + 10 * world().rank() + step);
      net->forward(torch::randn({8, 4}) * (1 + world().rank())).pow(2).sum().backward();
    }
    const at::Tensor mine = net->named_buffers()["1.running_mean"].clone();
    at::Tensor all = torch::zeros({world().size(), 4});
    world().group()->all_gather(mine, all).wait();
    return all;
  };
  const at::Tensor synced = running_means(true);
  for (int r = 1; r < world().size(); ++r) EXPECT_TRUE(torch::equal(synced[r], synced[0])) << "rank " << r;
  const at::Tensor own = running_means(false);
  EXPECT_FALSE(torch::allclose(own[1], own[0])) << "the ranks' batches should give different statistics";
  EXPECT_TRUE(torch::equal(own[0], synced[0])) << "rank 0's statistics are its own either way";
}

TEST(DDP, FindUnusedParametersAveragesWhatWasUsed) {
  torch::manual_seed(0);
  auto m = std::make_shared<TwoHeads>();
  parallel::DDPOptions o;
  o.find_unused_parameters = true;
  parallel::DistributedDataParallel ddp(m, *world().group(), o);
  // Only rank 0 uses b; everyone ends with b's gradient averaged over all ranks.
  const bool use_b = world().rank() == 0;
  m->forward(torch::ones({2, 4}), use_b).sum().backward();
  auto g = m->b->weight.grad().clone();
  auto ref = std::make_shared<TwoHeads>();
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < m->parameters().size(); ++i) ref->parameters()[i].copy_(m->parameters()[i]);
  }
  ref->forward(torch::ones({2, 4}), true).sum().backward();
  auto want = ref->b->weight.grad() / world().size();
  EXPECT_TRUE(torch::allclose(g, want, 1e-5, 1e-6));
}

TEST(Mesh, SubgroupsHaveTheRightMembers) {
  const int W = world().size();
  if (W != 4) GTEST_SKIP() << "needs 4 ranks";
  comm::Mesh mesh(world(), comm::MeshDims{1, 2, 2, 1});
  auto t = torch::full({1}, static_cast<double>(world().rank()), torch::kDouble);
  mesh.dp_shard().all_reduce(t).wait();
  // dp_shard pairs are {0,1} and {2,3}.
  EXPECT_DOUBLE_EQ(t.item<double>(), world().rank() < 2 ? 1.0 : 5.0);
  auto u = torch::full({1}, static_cast<double>(world().rank()), torch::kDouble);
  mesh.dp_replicate().all_reduce(u).wait();
  // dp_replicate pairs are {0,2} and {1,3}.
  EXPECT_DOUBLE_EQ(u.item<double>(), world().rank() % 2 == 0 ? 2.0 : 4.0);
  EXPECT_EQ(mesh.dp().size(), 4);
}

}  // namespace ddp_test
}  // namespace scaletrain::test

// Every collective, fp32 and bf16, sizes that do not divide evenly, checked
// against an expectation each rank computes locally from all ranks' inputs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"

namespace scaletrain::test {
namespace collectives_test {

using comm::ReduceOp;

// Rank r's input: distinct per rank and element, exactly representable in bf16.
at::Tensor input_of(int r, int64_t n, at::ScalarType dtype) {
  auto i = torch::arange(n, torch::kFloat);
  auto v = (i.remainder(17) - 8.0) * 0.25 + (r + 1);
  return v.to(dtype);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  const double tol = got.scalar_type() == at::kBFloat16 ? 1e-2 : 1e-6;
  auto g = got.to(torch::kFloat), w = want.to(torch::kFloat);
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const double err = (g - w).abs().max().item<double>() / std::max(1.0, w.abs().max().item<double>());
  EXPECT_LE(err, tol) << what << " (world " << world().size() << ")";
}

class Collectives : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t>> {};

TEST_P(Collectives, AllReduce) {
  auto [dtype, n] = GetParam();
  auto& g = *world().group();
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
    auto t = input_of(g.rank(), n, dtype);
    g.all_reduce(t, op).wait();
    std::vector<at::Tensor> all;
    for (int r = 0; r < g.size(); ++r) all.push_back(input_of(r, n, torch::kFloat));
    auto s = torch::stack(all);
    at::Tensor want = op == ReduceOp::Sum   ? s.sum(0)
                      : op == ReduceOp::Avg ? s.mean(0)
                      : op == ReduceOp::Max ? std::get<0>(s.max(0))
                                            : std::get<0>(s.min(0));
    expect_close(t, want, "all_reduce op " + std::to_string(static_cast<int>(op)));
  }
}

TEST_P(Collectives, ReduceScatterAndAllGather) {
  auto [dtype, n] = GetParam();
  auto& g = *world().group();
  const int64_t k = g.shard_numel(n);
  auto shard = torch::empty({k}, torch::TensorOptions().dtype(dtype));
  g.reduce_scatter(input_of(g.rank(), n, dtype), shard).wait();
  auto sum = torch::zeros({g.size() * k});
  for (int r = 0; r < g.size(); ++r) sum.narrow(0, 0, n) += input_of(r, n, torch::kFloat);
  expect_close(shard, sum.narrow(0, g.rank() * k, k), "reduce_scatter");
  // all_gather is its inverse and drops the padding.
  auto full = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  g.all_gather(shard, full).wait();
  expect_close(full, sum.narrow(0, 0, n), "all_gather");
}

TEST_P(Collectives, BroadcastReduceGatherScatter) {
  auto [dtype, n] = GetParam();
  auto& g = *world().group();
  const int root = g.size() - 1;
  auto b = input_of(g.rank(), n, dtype);
  g.broadcast(b, root).wait();
  expect_close(b, input_of(root, n, torch::kFloat), "broadcast");

  auto red = input_of(g.rank(), n, dtype);
  g.reduce(red, root, ReduceOp::Sum).wait();
  if (g.rank() == root) {
    auto want = torch::zeros({n});
    for (int r = 0; r < g.size(); ++r) want += input_of(r, n, torch::kFloat);
    expect_close(red, want, "reduce");
  }

  std::vector<at::Tensor> outs;
  if (g.rank() == root)
    for (int r = 0; r < g.size(); ++r) outs.push_back(torch::empty({n}, torch::TensorOptions().dtype(dtype)));
  g.gather(input_of(g.rank(), n, dtype), outs, root).wait();
  if (g.rank() == root)
    for (int r = 0; r < g.size(); ++r) expect_close(outs[r], input_of(r, n, torch::kFloat), "gather");

  std::vector<at::Tensor> ins;
  if (g.rank() == root)
    for (int r = 0; r < g.size(); ++r) ins.push_back(input_of(r + 10, n, dtype));
  auto out = torch::empty({n}, torch::TensorOptions().dtype(dtype));
  g.scatter(ins, out, root).wait();
  expect_close(out, input_of(g.rank() + 10, n, torch::kFloat), "scatter");
}

TEST_P(Collectives, AllToAllAndSendRecv) {
  auto [dtype, n] = GetParam();
  auto& g = *world().group();
  const int W = g.size();
  // Chunk j of rank r's input holds r*100 + j.
  auto in = torch::empty({W, n}, torch::kFloat);
  for (int j = 0; j < W; ++j) in[j].fill_(g.rank() * 100 + j);
  auto out = torch::empty({W, n}, torch::TensorOptions().dtype(dtype));
  g.all_to_all(in.to(dtype), out).wait();
  auto want = torch::empty({W, n}, torch::kFloat);
  for (int i = 0; i < W; ++i) want[i].fill_(i * 100 + g.rank());
  expect_close(out, want, "all_to_all");

  if (W > 1) {
    // A ring: send to the next rank, receive from the previous one.
    auto send_buf = input_of(g.rank(), n, dtype);
    auto recv_buf = torch::empty({n}, torch::TensorOptions().dtype(dtype));
    auto r = g.recv(recv_buf, (g.rank() + W - 1) % W, 7);
    auto s = g.send(send_buf, (g.rank() + 1) % W, 7);
    s.wait();
    r.wait();
    expect_close(recv_buf, input_of((g.rank() + W - 1) % W, n, torch::kFloat), "send/recv");
  }
  g.barrier().wait();
}

TEST(CollectivesAsync, ManyInFlightCompleteInOrder) {
  auto& g = *world().group();
  std::vector<at::Tensor> ts;
  std::vector<comm::Work> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(torch::full({1000 + i}, static_cast<float>(g.rank() + i)));
    works.push_back(g.all_reduce(ts.back()));
  }
  for (auto& w : works) w.wait();
  const double base = g.size() * (g.size() - 1) / 2.0;
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(ts[i][0].item<double>(), base + g.size() * i);
  EXPECT_GE(g.sequence(), 8u);
}

// Reduce-scatters of different sizes (even and padded), dtypes and ops, all in
// flight at once: each holds its own scratch buffers until it is waited on.
TEST(CollectivesAsync, ManyReduceScattersInFlight) {
  auto& g = *world().group();
  struct Case {
    int64_t n;
    at::ScalarType dtype;
    ReduceOp op;
  };
  const std::vector<Case> cases{{4099, at::kFloat, ReduceOp::Sum},   {1000, at::kBFloat16, ReduceOp::Sum},
                                {7, at::kFloat, ReduceOp::Avg},      {65536, at::kFloat, ReduceOp::Sum},
                                {333, at::kBFloat16, ReduceOp::Avg}, {12, at::kDouble, ReduceOp::Max},
                                {100003, at::kFloat, ReduceOp::Min}, {4096, at::kBFloat16, ReduceOp::Max}};
  for (int round = 0; round < 2; ++round) {
    std::vector<at::Tensor> shards;
    std::vector<comm::Work> works;
    for (size_t c = 0; c < cases.size(); ++c) {
      auto [n, dtype, op] = cases[c];
      shards.push_back(torch::full({g.shard_numel(n)}, -1.0, torch::TensorOptions().dtype(dtype)));
      works.push_back(g.reduce_scatter(input_of(g.rank() + static_cast<int>(c), n, dtype), shards.back(), op));
    }
    // Wait in reverse order: completion order must not matter.
    for (size_t c = works.size(); c-- > 0;) works[c].wait();
    for (size_t c = 0; c < cases.size(); ++c) {
      auto [n, dtype, op] = cases[c];
      const int64_t k = g.shard_numel(n);
      std::vector<at::Tensor> rows;
      for (int r = 0; r < g.size(); ++r) {
        auto row = torch::zeros({g.size() * k});
        row.narrow(0, 0, n).copy_(input_of(r + static_cast<int>(c), n, torch::kFloat));
        rows.push_back(row);
      }
      auto s = torch::stack(rows);
      at::Tensor want = op == ReduceOp::Sum   ? s.sum(0)
                        : op == ReduceOp::Avg ? s.mean(0)
                        : op == ReduceOp::Max ? std::get<0>(s.max(0))
                                              : std::get<0>(s.min(0));
      expect_close(shards[c], want.narrow(0, g.rank() * k, k),
                   "in-flight reduce_scatter " + std::to_string(c) + " round " + std::to_string(round));
    }
  }
}

// fp32 sums equal ATen's sum over the stacked rows (rank 0's row first) bit for
// bit, and repeating an operation reuses the group's scratch buffers.
TEST(CollectivesAsync, ReduceScatterIsExactAndReusesScratch) {
  auto& g = *world().group();
  const int64_t n = 10007;  // uneven: exercises the padded input too
  const int64_t k = g.shard_numel(n);
  auto input = [&](int r) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + r);
    return torch::randn({n}, gen, torch::kFloat);
  };
  std::vector<at::Tensor> rows;
  for (int r = 0; r < g.size(); ++r) rows.push_back(torch::constant_pad_nd(input(r), {0, g.size() * k - n}));
  auto want = torch::stack(rows).sum(0).narrow(0, g.rank() * k, k);
  int64_t scratch = -1;
  for (int i = 0; i < 4; ++i) {
    auto shard = torch::empty({k});
    g.reduce_scatter(input(g.rank()), shard).wait();
    EXPECT_TRUE(torch::equal(shard, want)) << "iteration " << i;
    if (i == 0) scratch = g.scratch_bytes();
    EXPECT_EQ(g.scratch_bytes(), scratch) << "iteration " << i;
  }
  if (g.size() > 1) EXPECT_GT(scratch, 0);
}

INSTANTIATE_TEST_SUITE_P(DtypesAndSizes, Collectives,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16),
                                            ::testing::Values<int64_t>(1, 7, 1000, 4099)));

}  // namespace collectives_test
}  // namespace scaletrain::test

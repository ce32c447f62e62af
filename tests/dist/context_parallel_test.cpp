// Context parallelism against the single process on the whole sequence
// (DESIGN: the invariant), on 2 and 4 ranks, the world being the cp group.
//
// Every rank builds the same whole tensors from the same seed, computes the
// reference on them, and checks its own tokens (Note [Load-balanced chunks])
// against the reference's: the attention's output and the gradients of q, k
// and v in fp64 to 1e-10 and fp32 to 1e-5, in every mode (ring with the
// kernel, ring composed of autograd ops, all-to-all), with grouped-query
// heads and with packed documents; then whole GPT-2 and Llama models, whose
// loss and parameter gradients summed over the ranks must equal one process's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dist_env.h"
#include "scaletrain/kernels/attention.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/parallel/context/context_parallel.h"
#include "scaletrain/train/batches.h"
#include "scaletrain/util/error.h"

namespace scaletrain::test {
namespace context_parallel_test {

namespace ctx = parallel::context;

comm::Group& cp_group() { return *world().group(); }

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-30);
}

at::Tensor randn(at::IntArrayRef shape, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(shape, gen, at::kDouble).to(dtype);
}

// This rank's tokens of a [B, H, T, D] tensor.
at::Tensor mine(const at::Tensor& x) {
  return x.index_select(2, ctx::local_positions(x.size(2), cp_group().rank(), cp_group().size()));
}

// Sorted document ids [B, T]: documents of 1 to 9 tokens, different per row.
at::Tensor documents(int64_t B, int64_t T) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  at::Tensor s = torch::empty({B, T}, torch::kLong);
  for (int64_t b = 0; b < B; ++b) {
    int64_t doc = 0, left = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (left == 0) left = 1 + torch::randint(9, {1}, gen).item<int64_t>(), ++doc;
      s[b][t] = doc;
      --left;
    }
  }
  return s;
}

struct Case {
  const char* name;
  ctx::Mode mode;
  bool flash;
};

const Case kCases[] = {{"ring (kernel)", ctx::Mode::Ring, true},
                       {"ring (autograd ops)", ctx::Mode::Ring, false},
                       {"all_to_all", ctx::Mode::AllToAll, true}};

void check_attention(at::ScalarType dtype, double tol, bool with_documents) {
  const int n = cp_group().size();
  const int64_t B = 2, H = 8, Hkv = 4, D = 16, T = 2 * n * 6;  // chunks of 6 tokens
  const at::Tensor q = randn({B, H, T, D}, 1, dtype), k = randn({B, Hkv, T, D}, 2, dtype);
  const at::Tensor v = randn({B, Hkv, T, D}, 3, dtype), w = randn({B, H, T, D}, 4, dtype);
  const at::Tensor segs = with_documents ? documents(B, T) : at::Tensor();
  kernels::AttentionMask whole;
  whole.q_segments = whole.k_segments = segs;
  auto leaf = [](const at::Tensor& x) { return x.detach().clone().requires_grad_(true); };
  at::Tensor rq = leaf(q), rk = leaf(k), rv = leaf(v);
  const at::Tensor ref = std::get<0>(kernels::naive_attention(rq, rk, rv, whole));
  (ref * w).sum().backward();
  const at::Tensor my_segs =
      with_documents ? segs.index_select(1, ctx::local_positions(T, cp_group().rank(), n)) : at::Tensor();
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(c.name) + (with_documents ? ", documents" : "") + " on " + std::to_string(n) + " ranks");
    at::Tensor lq = leaf(mine(q)), lk = leaf(mine(k)), lv = leaf(mine(v));
    const at::Tensor out = ctx::attention(lq, lk, lv, my_segs, cp_group(), {c.mode, c.flash});
    (out * mine(w)).sum().backward();
    EXPECT_LE(rel(out, mine(ref)), tol);
    EXPECT_LE(rel(lq.grad(), mine(rq.grad())), tol);
    EXPECT_LE(rel(lk.grad(), mine(rk.grad())), tol);
    EXPECT_LE(rel(lv.grad(), mine(rv.grad())), tol);
  }
}

TEST(ContextParallel, LocalPositionsPairFirstAndLastChunks) {
  // T = 16 over cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_TRUE(ctx::local_positions(16, 0, 2).equal(torch::tensor({0, 1, 2, 3, 12, 13, 14, 15}, torch::kLong)));
  EXPECT_TRUE(ctx::local_positions(16, 1, 2).equal(torch::tensor({4, 5, 6, 7, 8, 9, 10, 11}, torch::kLong)));
  EXPECT_THROW(ctx::local_positions(18, 0, 2), UsageError);  // 18 tokens do not make 4 equal chunks
  EXPECT_EQ(ctx::split_problem(ctx::Mode::AllToAll, 4, 8, 2, 64).find("key/value heads") != std::string::npos, true);
  EXPECT_EQ(ctx::split_problem(ctx::Mode::Ring, 4, 8, 2, 64), "");
}

TEST(ContextParallel, AttentionEqualsTheWholeSequenceFp64) {
  check_attention(at::kDouble, 1e-10, false);
  check_attention(at::kDouble, 1e-10, true);
}

TEST(ContextParallel, AttentionEqualsTheWholeSequenceFp32) { check_attention(at::kFloat, 1e-5, true); }

TEST(ContextParallel, AllToAllRefusesHeadsItCannotSplit) {
  const int n = cp_group().size();
  const at::Tensor q = torch::zeros({1, 3, 4 * n, 8}), kv = torch::zeros({1, 1, 4 * n, 8});
  EXPECT_THROW(ctx::attention(q, kv, kv, at::Tensor(), cp_group(), {ctx::Mode::AllToAll, true}), UsageError);
}

models::ModelConfig tiny(const std::string& family, int64_t T) {
  models::ModelConfig c;
  c.family = family;
  c.vocab_size = 48;
  c.block_size = T;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = family == "llama" ? 2 : 0;
  c.n_embd = 32;
  c.intermediate_size = family == "llama" ? 48 : 0;
  return c;
}

// The loss and the parameter gradients of one micro-batch, whole or split
// over the cp ranks (Note [Context-parallel batches]), summed over the ranks.
void check_model(const std::string& family, bool with_documents) {
  const int n = cp_group().size();
  const int64_t B = 2, T = 2 * n * 4;
  const models::ModelConfig cfg = tiny(family, T);
  auto make = [&] {
    torch::manual_seed(11);
    auto m = models::make_model(cfg);
    m->to(at::kDouble);
    return m;
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = torch::randint(48, {B, T}, gen, torch::kLong);
  at::Tensor y = torch::randint(48, {B, T}, gen, torch::kLong);
  y.index_put_({0, torch::indexing::Slice(0, 5)}, models::kIgnoreTarget);  // some tokens are no target
  std::shared_ptr<const models::SequenceLayout> layout;
  if (with_documents) {
    auto l = std::make_shared<models::SequenceLayout>();
    l->segments = documents(B, T);
    const at::Tensor first = torch::cat({torch::ones({B, 1}, torch::kBool), l->segments.diff(1, 1).ne(0)}, 1);
    const at::Tensor idx = torch::arange(T, torch::kLong).expand({B, T});
    l->positions = idx - std::get<0>(torch::where(first, idx, torch::zeros_like(idx)).cummax(1));
    layout = l;
  }
  auto ref = make();
  ref->set_sequence_layout(layout);
  const at::Tensor ref_loss = ref->loss(x, y);
  ref_loss.backward();

  auto m = make();
  m->set_split_attention([](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const models::SequenceLayout* l) {
    return ctx::attention(q, k, v, l != nullptr ? l->segments : at::Tensor(), cp_group(), {ctx::Mode::Ring, true});
  });
  at::Tensor xs = x, ys = y;
  std::shared_ptr<const models::SequenceLayout> part = layout;
  train::keep_context_part(xs, ys, part, cp_group().rank(), n);
  const int64_t targets = y.ne(models::kIgnoreTarget).sum().item<int64_t>();
  m->set_sequence_layout(part);
  const at::Tensor loss = m->loss(xs, ys) * train::context_weight(ys, targets, 1, n);
  loss.backward();
  at::Tensor total = loss.detach().clone();
  cp_group().all_reduce(total).wait();
  EXPECT_LE(rel(total / n, ref_loss), 1e-10) << family;
  const auto got = m->named_parameters(), want = ref->named_parameters();
  for (const auto& p : got) {
    at::Tensor g = p.value().grad().clone();
    cp_group().all_reduce(g).wait();
    EXPECT_LE(rel(g / n, want[p.key()].grad()), 1e-10) << family << " " << p.key();
  }
}

TEST(ContextParallel, Gpt2EqualsOneProcess) {
  check_model("gpt2", false);
  check_model("gpt2", true);
}

TEST(ContextParallel, LlamaEqualsOneProcess) {
  check_model("llama", false);
  check_model("llama", true);
}

}  // namespace context_parallel_test
}  // namespace scaletrain::test

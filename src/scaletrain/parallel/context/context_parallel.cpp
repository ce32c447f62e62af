// Ring and all-to-all attention over the context-parallel group (Note
// [Load-balanced chunks] in parallel/context/context_parallel.h).
#include "scaletrain/parallel/context/context_parallel.h"

#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "scaletrain/kernels/attention.h"
#include "scaletrain/util/error.h"

namespace scaletrain::parallel::context {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Mode parse_mode(const std::string& name) {
  if (name == "ring") return Mode::Ring;
  if (name == "all_to_all") return Mode::AllToAll;
  throw UsageError("parallel.cp_mode must be ring or all_to_all, got '" + name + "'");
}

const char* mode_name(Mode mode) { return mode == Mode::Ring ? "ring" : "all_to_all"; }

torch::Tensor local_positions(int64_t T, int rank, int cp) {
  if (cp < 1 || rank < 0 || rank >= cp || T % (2 * cp) != 0)
    throw UsageError("context parallelism cannot split " + std::to_string(T) + " tokens over cp=" +
                     std::to_string(cp) + ": the sequence must divide into 2 x cp = " + std::to_string(2 * cp) +
                     " equal chunks");
  const int64_t c = T / (2 * cp);
  const auto opts = torch::TensorOptions().dtype(torch::kLong);
  return torch::cat({torch::arange(rank * c, (rank + 1) * c, opts),
                     torch::arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, opts)});
}

torch::Tensor shard_sequence(const torch::Tensor& x, int rank, int cp) {
  if (cp == 1) return x;
  return x.index_select(1, local_positions(x.size(1), rank, cp).to(x.device()));
}

std::string split_problem(Mode mode, int cp, int64_t heads, int64_t kv_heads, int64_t block_size) {
  if (cp <= 1) return "";
  if (block_size % (2 * cp) != 0)
    return "parallel.cp=" + std::to_string(cp) + " needs model.block_size divisible by 2 x cp = " +
           std::to_string(2 * cp) + " (load-balanced chunks), got " + std::to_string(block_size);
  if (mode == Mode::AllToAll && (heads % cp != 0 || kv_heads % cp != 0))
    return "parallel.cp_mode=all_to_all splits heads over cp=" + std::to_string(cp) + ": " + std::to_string(heads) +
           " heads and " + std::to_string(kv_heads) + " key/value heads per tensor-parallel rank must both divide by it";
  return "";
}

namespace {

constexpr int kTagKv = 0, kTagGrad = 1;

// Posts the send of x to the next rank and the receive of the previous
// rank's into a new tensor, which it returns; `pending` gets both works.
torch::Tensor pass_on(comm::Group& cp, const torch::Tensor& x, int tag, std::vector<comm::Work>& pending) {
  const int n = cp.size(), r = cp.rank();
  torch::Tensor in = torch::empty_like(x);
  pending.push_back(cp.send(x, (r + 1) % n, tag));
  pending.push_back(cp.recv(in, (r + n - 1) % n, tag));
  return in;
}

// Walks the ring of Note [Load-balanced chunks]: at step s this rank holds
// kv, the packed keys and values of rank r - s (the next step's already in
// flight), and pair(kv, a, b, from, q_chunk, k_chunk) runs for every pair of
// its query chunk a (chunk q_chunk of the sequence) and their key chunk b
// (k_chunk) that the causal mask does not hide whole; then
// after_step(pending) may post more transfers, and every transfer is waited
// for. hop(kv, pending) starts the next step's transfer (pass_on, or its
// differentiable form).
template <typename Hop, typename Pair, typename AfterStep>
void walk_ring(comm::Group& cp, torch::Tensor kv, const Hop& hop, const Pair& pair, const AfterStep& after_step) {
  const int n = cp.size(), r = cp.rank();
  const int64_t mine[2] = {r, 2 * n - 1 - r};
  for (int s = 0; s < n; ++s) {
    std::vector<comm::Work> pending;
    const torch::Tensor next = s + 1 < n ? hop(kv, pending) : torch::Tensor();
    const int from = (r - s + n) % n;
    const int64_t theirs[2] = {from, 2 * n - 1 - from};
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b)
        if (theirs[b] <= mine[a]) pair(kv, a, b, from, mine[a], theirs[b]);  // else every key is after every query
    after_step(pending);
    for (auto& w : pending) w.wait();
    if (s + 1 < n) kv = next;
  }
}

// The hop of walk_ring for tensors autograd does not follow.
auto plain_hop(comm::Group& cp) {
  return [&cp](const torch::Tensor& kv, std::vector<comm::Work>& pending) { return pass_on(cp, kv, kTagKv, pending); };
}

// One hop of the ring, differentiable: sends x to the next rank and returns
// the previous rank's x. The receive is only posted; `pending` gets its work,
// which the caller waits on before reading the result (so the transfer runs
// while the caller computes). The adjoint sends the gradient back to the
// previous rank and receives the next rank's.
struct RingHop : torch::autograd::Function<RingHop> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* group,
                               std::vector<comm::Work>* pending) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->saved_data["like"] = torch::empty({0}, x.options());
    return pass_on(*group, x, kTagKv, *pending);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    const int n = group->size(), r = group->rank();
    // Every hop's result is attended, but an unused one must still answer its peers.
    const torch::Tensor g = grads[0].defined() ? grads[0].contiguous()
                                                : torch::zeros(ctx->saved_data["sizes"].toIntVector(),
                                                               ctx->saved_data["like"].toTensor().options());
    torch::Tensor out = torch::empty_like(g);
    comm::Work sent = group->send(g, (r + n - 1) % n);
    comm::Work got = group->recv(out, (r + 1) % n);
    sent.wait();
    got.wait();
    return {out, torch::Tensor(), torch::Tensor()};
  }
};

// Differentiable all-to-all over dim 0 of x [cp, ...]: chunk j goes to rank
// j, chunk i of the result came from rank i. Its adjoint is itself.
struct AllToAll : torch::autograd::Function<AllToAll> {
  static torch::Tensor exchange(const torch::Tensor& x, comm::Group& group) {
    torch::Tensor in = x.contiguous(), out = torch::empty_like(in);
    group.all_to_all(in, out).wait();
    return out;
  }
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, comm::Group* group) {
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(group);
    return exchange(x, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    return {exchange(grads[0], *group), torch::Tensor()};
  }
};

std::tuple<torch::Tensor, torch::Tensor> attend_part(const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v, const kernels::AttentionMask& mask,
                                                     bool flash) {
  if (flash && q.device().is_cpu()) return kernels::flash_attention(q, k, v, mask);
  return kernels::naive_attention(q, k, v, mask);
}

// Every rank's document ids [cp, B, Tl] (not differentiable; small).
torch::Tensor gather_segments(const torch::Tensor& segments, comm::Group& cp) {
  const torch::Tensor mine = segments.contiguous();
  torch::Tensor all = torch::empty({cp.size(), mine.size(0), mine.size(1)}, mine.options());
  cp.all_gather(mine, all).wait();
  return all;
}

// The merge of partial attentions of the same queries (Note [Load-balanced chunks]).
torch::Tensor merge(const std::vector<torch::Tensor>& outs, const std::vector<torch::Tensor>& lses,
                    torch::ScalarType dtype) {
  if (outs.size() == 1) return outs[0];
  const torch::Tensor lse = torch::stack(lses).logsumexp(0);  // finite: every query sees itself
  torch::Tensor out;
  for (size_t j = 0; j < outs.size(); ++j) {
    const torch::Tensor w = (lses[j] - lse).exp().unsqueeze(-1);
    const torch::Tensor part = w * outs[j].to(w.scalar_type());
    out = out.defined() ? out + part : part;
  }
  return out.to(dtype);
}

// Which keys each (query chunk, key chunk) pair sees: chunks are c tokens,
// `segs` every rank's document ids [n, B, Tl] (undefined: none).
kernels::AttentionMask pair_mask(int64_t q_chunk, int64_t k_chunk, int64_t c, const torch::Tensor& segments,
                                 const torch::Tensor& segs, int a, int from, int b) {
  kernels::AttentionMask mask;
  mask.q_offset = q_chunk * c;
  mask.k_offset = k_chunk * c;
  if (segs.defined()) {
    mask.q_segments = segments.narrow(1, a * c, c);
    mask.k_segments = segs[from].narrow(1, b * c, c);
  }
  return mask;
}

// (out, lse) <- the merge of itself and a partial (o, l) of the same queries;
// rows that have seen no key yet (lse = -inf) stay 0 / -inf.
void merge_into(torch::Tensor& out, torch::Tensor& lse, const torch::Tensor& o, const torch::Tensor& l) {
  if (!out.defined()) {
    out = o;
    lse = l;
    return;
  }
  const torch::Tensor m = torch::maximum(lse, l);
  const torch::Tensor top = torch::where(torch::isinf(m), torch::zeros_like(m), m);
  const torch::Tensor a = (lse - top).exp(), b = (l - top).exp(), sum = a + b;
  out = (out * a.unsqueeze(-1) + o * b.unsqueeze(-1)) / sum.clamp_min(1e-30).unsqueeze(-1);
  lse = top + sum.log();
}


// Note [Ring backward]: the flash path as one autograd function, so that
// autograd keeps only this rank's q, k, v and the merged out and lse (memory
// 1/cp of the whole sequence's), never the chunks that passed by. Backward
// sends the keys and values around the ring once more, each with the
// gradient accumulated for them so far: at step s a rank holds rank r - s's
// keys and the dK, dV that ranks r - s ... r - 1 added, adds its own (the
// kernel's backward with the merged out and lse gives each chunk's exact
// share), and passes both on; after the last step every gradient goes home.
struct RingAttention : torch::autograd::Function<RingAttention> {
  // Document ids, passed as a non-differentiable argument (either may be undefined).
  struct Documents {
    torch::Tensor mine;  // this rank's [B, Tl]
    torch::Tensor all;   // every rank's [n, B, Tl]
  };
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const Documents& docs, comm::Group* cp) {
    const torch::Tensor &segments = docs.mine, &segs = docs.all;
    const int64_t Hkv = k.size(1), c = q.size(2) / 2;
    const torch::Tensor qs[2] = {q.narrow(2, 0, c), q.narrow(2, c, c)};
    torch::Tensor out[2], lse[2];
    auto pair = [&](const torch::Tensor& kv, int a, int b, int from, int64_t q_chunk, int64_t k_chunk) {
      auto [o, l] = kernels::flash_attention_forward(qs[a], kv.narrow(1, 0, Hkv).narrow(2, b * c, c),
                                                     kv.narrow(1, Hkv, Hkv).narrow(2, b * c, c),
                                                     pair_mask(q_chunk, k_chunk, c, segments, segs, a, from, b));
      merge_into(out[a], lse[a], o, l);
    };
    walk_ring(*cp, torch::cat({k, v}, 1).contiguous(), plain_hop(*cp), pair, [](std::vector<comm::Work>&) {});
    const torch::Tensor o = torch::cat({out[0], out[1]}, 2), l = torch::cat({lse[0], lse[1]}, 2);
    ctx->save_for_backward({q, k, v, o, l});
    ctx->saved_data["segments"] = segments;
    ctx->saved_data["segs"] = segs;
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(cp);
    return o.to(q.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &l = saved[4];
    const torch::Tensor segments = ctx->saved_data["segments"].toTensor(), segs = ctx->saved_data["segs"].toTensor();
    auto* cp = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    const int64_t Hkv = k.size(1), c = q.size(2) / 2;
    const torch::Tensor dout = grads[0].defined() ? grads[0].to(o.scalar_type()) : torch::zeros_like(o);
    auto half = [c](const torch::Tensor& t, int a) { return t.narrow(2, a * c, c); };
    torch::Tensor dq[2] = {torch::zeros_like(half(o, 0)), torch::zeros_like(half(o, 1))};
    const torch::Tensor kv = torch::cat({k, v}, 1).contiguous();
    torch::Tensor dkv = torch::zeros(kv.sizes(), o.options());  // for the keys and values in hand
    auto pair = [&](const torch::Tensor& kv, int a, int b, int from, int64_t q_chunk, int64_t k_chunk) {
      auto [gq, gk, gv] = kernels::flash_attention_backward(
          half(q, a), kv.narrow(1, 0, Hkv).narrow(2, b * c, c), kv.narrow(1, Hkv, Hkv).narrow(2, b * c, c),
          half(o, a), l.narrow(2, a * c, c), half(dout, a),
          pair_mask(q_chunk, k_chunk, c, segments, segs, a, from, b));
      dq[a] += gq;
      dkv.narrow(1, 0, Hkv).narrow(2, b * c, c) += gk;
      dkv.narrow(1, Hkv, Hkv).narrow(2, b * c, c) += gv;
    };
    auto after_step = [&](std::vector<comm::Work>& pending) {  // the gradient goes where the keys go
      const torch::Tensor dnext = pass_on(*cp, dkv, kTagGrad, pending);
      for (auto& w : pending) w.wait();
      pending.clear();
      dkv = dnext;
    };
    walk_ring(*cp, kv, plain_hop(*cp), pair, after_step);
    return {torch::cat({dq[0], dq[1]}, 2).to(q.scalar_type()), dkv.narrow(1, 0, Hkv).to(k.scalar_type()),
            dkv.narrow(1, Hkv, Hkv).to(v.scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

// Note [Load-balanced chunks], ring mode, composed of autograd ops (the
// reference path and CUDA tensors): step s attends the keys and values of
// rank r - s, which arrive while step s - 1 computes. Autograd keeps every
// chunk that passed by, so this path's memory is that of the whole sequence.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& segments, comm::Group& cp, bool flash) {
  const int64_t Hkv = k.size(1), c = q.size(2) / 2;
  const torch::Tensor segs = segments.defined() ? gather_segments(segments, cp) : torch::Tensor();
  const torch::Tensor qs[2] = {q.narrow(2, 0, c).contiguous(), q.narrow(2, c, c).contiguous()};
  std::vector<torch::Tensor> outs[2], lses[2];
  auto pair = [&](const torch::Tensor& kv, int a, int b, int from, int64_t q_chunk, int64_t k_chunk) {
    const kernels::AttentionMask mask = pair_mask(q_chunk, k_chunk, c, segments, segs, a, from, b);
    const torch::Tensor kb = kv.narrow(1, 0, Hkv).narrow(2, b * c, c);
    const torch::Tensor vb = kv.narrow(1, Hkv, Hkv).narrow(2, b * c, c);
    auto [o, lse] = attend_part(qs[a], kb, vb, mask, flash);
    outs[a].push_back(o);
    lses[a].push_back(lse);
  };
  auto hop = [&cp](const torch::Tensor& kv, std::vector<comm::Work>& pending) {
    return RingHop::apply(kv, &cp, &pending);
  };
  walk_ring(cp, torch::cat({k, v}, 1).contiguous(), hop, pair, [](std::vector<comm::Work>&) {});
  return torch::cat({merge(outs[0], lses[0], q.scalar_type()), merge(outs[1], lses[1], q.scalar_type())}, 2);
}

// Where the whole sequence's token t sits in the all-to-all's concatenation
// of every rank's tokens (rank 0's, then rank 1's, ...).
torch::Tensor natural_order(int64_t T, int n, const torch::Device& device) {
  std::vector<torch::Tensor> held;
  for (int i = 0; i < n; ++i) held.push_back(local_positions(T, i, n));
  const torch::Tensor where = torch::cat(held);  // where[j]: position of concatenated token j
  return torch::argsort(where).to(device);       // order[t]: the concatenated index of position t
}

// Note [Load-balanced chunks], all_to_all mode.
torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& segments, comm::Group& cp, bool flash) {
  const int n = cp.size();
  const int64_t B = q.size(0), Tl = q.size(2), D = q.size(3), T = Tl * n;
  const torch::Tensor order = natural_order(T, n, q.device()), back = torch::argsort(order);
  // [B, H, Tl, D] -> [n, B, H/n, Tl, D] -> exchanged -> [B, H/n, T, D] in sequence order.
  auto to_heads = [&](const torch::Tensor& x) {
    const int64_t H = x.size(1);
    torch::Tensor parts = x.reshape({B, n, H / n, Tl, D}).permute({1, 0, 2, 3, 4});
    torch::Tensor got = AllToAll::apply(parts, &cp);  // [n (source rank), B, H/n, Tl, D]
    return got.permute({1, 2, 0, 3, 4}).reshape({B, H / n, T, D}).index_select(2, order);
  };
  kernels::AttentionMask mask;
  if (segments.defined()) {
    const torch::Tensor all = gather_segments(segments, cp);  // [n, B, Tl]
    mask.q_segments = mask.k_segments = all.permute({1, 0, 2}).reshape({B, T}).index_select(1, order);
  }
  torch::Tensor out = std::get<0>(attend_part(to_heads(q), to_heads(k), to_heads(v), mask, flash));
  // [B, H/n, T, D] -> concatenated order -> [n (destination rank), B, H/n, Tl, D] -> back.
  const int64_t h = out.size(1);
  torch::Tensor parts = out.index_select(2, back).reshape({B, h, n, Tl, D}).permute({2, 0, 1, 3, 4});
  torch::Tensor got = AllToAll::apply(parts, &cp);  // [n (head group), B, H/n, Tl, D]
  return got.permute({1, 0, 2, 3, 4}).reshape({B, n * h, Tl, D});
}

}  // namespace

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& segments, comm::Group& cp, const AttentionOptions& options) {
  const int n = cp.size();
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || q.size(2) != k.size(2) || k.sizes() != v.sizes() ||
      q.size(1) % k.size(1) != 0 || q.size(2) % 2 != 0)
    throw UsageError("context-parallel attention: q " + c10::str(q.sizes()) + ", k " + c10::str(k.sizes()) +
                     ", v " + c10::str(v.sizes()) +
                     " are not [B, H, Tl, D] and [B, Hkv, Tl, D] of one even local length");
  if (segments.defined() && (segments.dim() != 2 || segments.size(1) != q.size(2)))
    throw UsageError("context-parallel attention: segments " + c10::str(segments.sizes()) +
                     " are not [B, " + std::to_string(q.size(2)) + "]");
  if (options.mode == Mode::AllToAll) {
    const std::string problem = split_problem(options.mode, n, q.size(1), k.size(1), q.size(2) * n);
    if (!problem.empty()) throw UsageError(problem);
    return ulysses_attention(q, k, v, segments, cp, options.flash);
  }
  if (options.flash && q.device().is_cpu()) {
    const torch::Tensor segs = segments.defined() ? gather_segments(segments, cp) : torch::Tensor();
    return RingAttention::apply(q, k, v, RingAttention::Documents{segments, segs}, &cp);
  }
  return ring_attention(q, k, v, segments, cp, options.flash);
}

}  // namespace scaletrain::parallel::context

#include "scaletrain/parallel/expert/expert_parallel.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace scaletrain::parallel::expert {

namespace {

torch::Tensor exchange(comm::Group& group, const torch::Tensor& x, const std::vector<int64_t>& in_rows,
                       const std::vector<int64_t>& out_rows) {
  int64_t total = 0;
  for (int64_t n : out_rows) total += n;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = total;
  torch::Tensor out = torch::empty(shape, x.options());
  group.all_to_all_v(x.contiguous(), out, in_rows, out_rows).wait();
  return out;
}

// The group travels in saved_data as its address: the Group outlives every
// graph built while training with it (the strategy owns both).
struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t group,
                               std::vector<int64_t> in_rows, std::vector<int64_t> out_rows) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["in_rows"] = in_rows;
    ctx->saved_data["out_rows"] = out_rows;
    return exchange(*reinterpret_cast<comm::Group*>(group), x, in_rows, out_rows);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    auto* group = reinterpret_cast<comm::Group*>(ctx->saved_data["group"].toInt());
    const auto in_rows = ctx->saved_data["in_rows"].toIntVector();
    const auto out_rows = ctx->saved_data["out_rows"].toIntVector();
    return {exchange(*group, grad[0], out_rows, in_rows), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all_rows(comm::Group& group, const torch::Tensor& x, const std::vector<int64_t>& in_rows,
                              const std::vector<int64_t>& out_rows) {
  return AllToAllRows::apply(x, static_cast<int64_t>(reinterpret_cast<intptr_t>(&group)), in_rows, out_rows);
}

interfaces::ExpertParallelHooksPtr expert_parallel_hooks(comm::Group& ep, int64_t num_experts) {
  const int64_t p = ep.size();
  if (p < 1 || num_experts % p != 0)
    throw std::invalid_argument("expert parallel degree " + std::to_string(p) + " does not divide the " +
                                std::to_string(num_experts) + " experts");
  auto hooks = std::make_shared<interfaces::ExpertParallelHooks>();
  const int64_t local = num_experts / p, me = ep.rank();
  hooks->first_expert = me * local;
  hooks->local_experts = local;
  comm::Group* g = &ep;
  hooks->run = [g, p, local, me, num_experts](
                   const torch::Tensor& sorted, const std::vector<int64_t>& counts,
                   const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& expert) {
    // 1. Slot counts per expert: recv[s * local + e] = rows rank s has for local expert e.
    // host: E counts, read one by one (Group stages them through an NCCL device)
    torch::Tensor send = torch::tensor(counts, torch::kLong), recv = torch::empty({num_experts}, torch::kLong);
    g->all_to_all(send, recv).wait();
    const int64_t* r = recv.data_ptr<int64_t>();
    std::vector<int64_t> in_rows(static_cast<size_t>(p), 0), out_rows(static_cast<size_t>(p), 0);
    for (int64_t d = 0; d < p; ++d)
      for (int64_t e = 0; e < local; ++e) {
        in_rows[static_cast<size_t>(d)] += counts[static_cast<size_t>(d * local + e)];
        out_rows[static_cast<size_t>(d)] += r[d * local + e];
      }
    // 2. Rows to the experts' ranks.
    const torch::Tensor arrived = all_to_all_rows(*g, sorted, in_rows, out_rows);
    // 3. Group the arrived rows by local expert (they come by source rank,
    // then expert), run each expert, and put the outputs back in arrival order.
    std::vector<int64_t> order;
    std::vector<int64_t> per_expert(static_cast<size_t>(local), 0);
    std::vector<int64_t> source_start(static_cast<size_t>(p), 0);
    for (int64_t s = 1; s < p; ++s)
      source_start[static_cast<size_t>(s)] = source_start[static_cast<size_t>(s - 1)] + out_rows[static_cast<size_t>(s - 1)];
    for (int64_t e = 0; e < local; ++e)
      for (int64_t s = 0; s < p; ++s) {
        int64_t at = source_start[static_cast<size_t>(s)];
        for (int64_t f = 0; f < e; ++f) at += r[s * local + f];
        for (int64_t k = 0; k < r[s * local + e]; ++k) order.push_back(at + k);
        per_expert[static_cast<size_t>(e)] += r[s * local + e];
      }
    const torch::Tensor index = torch::tensor(order, torch::kLong).to(sorted.device());
    const torch::Tensor grouped = arrived.index_select(0, index);
    std::vector<torch::Tensor> outs;
    int64_t at = 0;
    for (int64_t e = 0; e < local; ++e) {
      outs.push_back(expert(me * local + e, grouped.narrow(0, at, per_expert[static_cast<size_t>(e)])));
      at += per_expert[static_cast<size_t>(e)];
    }
    const torch::Tensor y = torch::cat(outs, 0);
    const torch::Tensor back = torch::zeros({arrived.size(0), y.size(1)}, y.options()).index_copy(0, index, y);
    // 4. Outputs back to the rows' ranks, in the order they were sent.
    return all_to_all_rows(*g, back, out_rows, in_rows);
  };
  return hooks;
}

}  // namespace scaletrain::parallel::expert

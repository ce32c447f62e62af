#include "scaletrain/rpc/dist_autograd.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/optim.h>

#include <atomic>
#include <mutex>
#include <set>
#include <unordered_set>

namespace scaletrain::rpc::dist_autograd {

namespace {

thread_local int64_t t_current = 0;

// One context's state on this worker (Note [Distributed backward]).
struct Ctx {
  std::mutex mu;
  std::map<std::string, at::Tensor> sent;  // crossing key -> the tensor this worker sent
  std::map<const c10::TensorImpl*, std::pair<std::string, std::string>> received;  // leaf -> (sender, key)
  std::vector<at::Tensor> leaves;  // the received leaves, kept with the graphs
  std::map<const c10::TensorImpl*, std::pair<at::Tensor, at::Tensor>> grads;  // parameter -> (it, gradient)
};

std::mutex g_mu;
std::map<int64_t, std::shared_ptr<Ctx>> g_contexts;
std::atomic<int64_t> g_next{1};

std::shared_ptr<Ctx> context_state(int64_t id, bool create) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_contexts.find(id);
  if (it != g_contexts.end()) return it->second;
  if (!create) throw RpcError("dist_autograd: no context " + std::to_string(id) + " on worker '" + worker_name() + "'");
  return g_contexts[id] = std::make_shared<Ctx>();
}

// The leaves a backward from `roots` reaches: the variables of the graph's
// AccumulateGrad nodes, and roots that are leaves themselves.
std::vector<at::Tensor> reachable_leaves(const std::vector<at::Tensor>& roots) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> have;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  auto add = [&](const at::Tensor& t) {
    if (have.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  };
  for (const auto& r : roots) {
    if (r.grad_fn())
      stack.push_back(r.grad_fn().get());
    else if (r.requires_grad())
      add(r);
  }
  while (!stack.empty()) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    if (!seen.insert(n).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) add(acc->variable);
    for (const auto& e : n->next_edges())
      if (e.function) stack.push_back(e.function.get());
  }
  return out;
}

// Runs this worker's graph from `roots` with `grads`, keeps the parameters'
// gradients and sends the received leaves' back to their senders, waiting
// for them to finish the same way.
void run_backward(int64_t id, const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads) {
  auto c = context_state(id, /*create=*/false);
  const std::vector<at::Tensor> leaves = reachable_leaves(roots);
  if (leaves.empty()) return;
  const auto g = torch::autograd::grad(roots, leaves, grads, /*retain_graph=*/true, /*create_graph=*/false,
                                       /*allow_unused=*/true);
  std::vector<std::pair<std::string, std::pair<std::string, at::Tensor>>> onward;  // (sender, (key, gradient))
  {
    std::lock_guard<std::mutex> lock(c->mu);
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (!g[i].defined()) continue;
      auto r = c->received.find(leaves[i].unsafeGetTensorImpl());
      if (r != c->received.end()) {
        onward.push_back({r->second.first, {r->second.second, g[i]}});
        continue;
      }
      auto& slot = c->grads[leaves[i].unsafeGetTensorImpl()];
      if (!slot.second.defined())
        slot = {leaves[i], g[i].clone()};
      else
        slot.second.add_(g[i]);
    }
  }
  std::vector<Future> waits;
  for (auto& [sender, kg] : onward)
    waits.push_back(rpc_async(sender, "__dist_backward", {Value(id), Value(kg.first), Value(kg.second)}));
  for (auto& f : waits) f.wait();
}

// Optimizers of the parameters this worker owns, by DistributedOptimizer id.
struct LocalOptimizer {
  std::string kind;
  double lr = 0;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
};
std::mutex g_opt_mu;
std::map<std::string, LocalOptimizer> g_optimizers;
std::atomic<int64_t> g_next_optimizer{1};

}  // namespace

namespace detail {

int64_t current() { return t_current; }
void set_current(int64_t context) { t_current = context; }

void on_send(int64_t context, const std::string& key, const std::string& to, const at::Tensor& sent) {
  (void)to;
  auto c = context_state(context, /*create=*/true);
  std::lock_guard<std::mutex> lock(c->mu);
  c->sent[key] = sent;
}

at::Tensor on_receive(int64_t context, const std::string& from, const std::string& key, at::Tensor received) {
  auto c = context_state(context, /*create=*/true);
  at::Tensor leaf = received.detach().requires_grad_(true);
  std::lock_guard<std::mutex> lock(c->mu);
  c->received[leaf.unsafeGetTensorImpl()] = {from, key};
  c->leaves.push_back(leaf);
  return leaf;
}

void register_builtins() {
  using K = Value::Kind;
  register_function("__dist_backward", {K::Int, K::String, K::Tensor}, [](const Args& a) {
    const int64_t id = a[0].to_int();
    at::Tensor root;
    {
      auto c = context_state(id, /*create=*/false);
      std::lock_guard<std::mutex> lock(c->mu);
      auto it = c->sent.find(a[1].str());
      if (it == c->sent.end()) throw RpcError("dist_autograd: no tensor was sent under key '" + a[1].str() + "'");
      root = it->second;
    }
    run_backward(id, {root}, {a[2].tensor()});
    return Value();
  });
  register_function("__dist_release", {K::Int}, [](const Args& a) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_contexts.erase(a[0].to_int());
    return Value();
  });
  register_function("__optim_create", {K::String, K::String, K::Double}, [](const Args& a) {
    if (a[1].str() != "sgd" && a[1].str() != "adam")
      throw RpcError("DistributedOptimizer: unknown kind '" + a[1].str() + "' (sgd | adam)");
    std::lock_guard<std::mutex> lock(g_opt_mu);
    LocalOptimizer& o = g_optimizers[a[0].str()];
    o.kind = a[1].str();
    o.lr = a[2].to_double();
    return Value();
  });
  register_function("__optim_add", {K::String, K::RRef}, [](const Args& a) {
    const RRef r = a[1].rref();
    if (!r.is_owner()) throw RpcError("DistributedOptimizer: a parameter is stepped by its owner");
    at::Tensor p = r.local_value().tensor();
    if (!p.requires_grad()) throw RpcError("DistributedOptimizer: a parameter that requires no gradient");
    std::lock_guard<std::mutex> lock(g_opt_mu);
    g_optimizers.at(a[0].str()).params.push_back(p);
    return Value();
  });
  register_function("__optim_step", {K::String, K::Int}, [](const Args& a) {
    std::lock_guard<std::mutex> lock(g_opt_mu);
    LocalOptimizer& o = g_optimizers.at(a[0].str());
    if (!o.opt) {
      if (o.kind == "sgd")
        o.opt = std::make_unique<torch::optim::SGD>(o.params, torch::optim::SGDOptions(o.lr));
      else
        o.opt = std::make_unique<torch::optim::Adam>(o.params, torch::optim::AdamOptions(o.lr));
    }
    for (auto& p : o.params) {
      const at::Tensor g = gradient(a[1].to_int(), p);
      p.mutable_grad() = g.defined() ? g.clone() : at::zeros_like(p);
    }
    o.opt->step();
    for (auto& p : o.params) p.mutable_grad().reset();
    return Value();
  });
}

}  // namespace detail

Context::Context() : previous_(t_current) {
  id_ = (static_cast<int64_t>(worker_rank() + 1) << 40) | g_next.fetch_add(1);
  context_state(id_, /*create=*/true);
  t_current = id_;
}

Context::~Context() {
  t_current = previous_;
  if (!initialized()) return;
  std::vector<Future> waits;
  for (const auto& w : worker_names()) {
    try {
      waits.push_back(rpc_async(w, "__dist_release", {Value(id_)}));
    } catch (const RpcError&) {
      // A worker that is gone holds nothing any more.
    }
  }
  for (auto& f : waits) {
    try {
      f.wait();
    } catch (const RpcError&) {
    }
  }
}

void backward(int64_t context, const std::vector<at::Tensor>& losses) {
  std::vector<at::Tensor> ones;
  for (const auto& l : losses) {
    if (l.numel() != 1) throw std::invalid_argument("dist_autograd::backward: losses must be scalars");
    if (!l.requires_grad()) throw std::invalid_argument("dist_autograd::backward: a loss does not require gradients");
    ones.push_back(at::ones_like(l));
  }
  const int64_t previous = t_current;
  t_current = context;
  try {
    run_backward(context, losses, ones);
  } catch (...) {
    t_current = previous;
    throw;
  }
  t_current = previous;
}

std::vector<std::pair<at::Tensor, at::Tensor>> get_gradients(int64_t context) {
  auto c = context_state(context, /*create=*/false);
  std::lock_guard<std::mutex> lock(c->mu);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (const auto& [impl, pg] : c->grads) out.push_back(pg);
  return out;
}

at::Tensor gradient(int64_t context, const at::Tensor& param) {
  auto c = context_state(context, /*create=*/false);
  std::lock_guard<std::mutex> lock(c->mu);
  auto it = c->grads.find(param.unsafeGetTensorImpl());
  return it == c->grads.end() ? at::Tensor() : it->second.second;
}

DistributedOptimizer::DistributedOptimizer(const std::string& kind, double lr, const std::vector<RRef>& params) {
  id_ = worker_name() + "/optimizer" + std::to_string(g_next_optimizer.fetch_add(1));
  std::map<std::string, std::vector<RRef>> by_owner;
  for (const auto& p : params) by_owner[p.owner()].push_back(p);
  for (auto& [owner, ps] : by_owner) {
    rpc_sync(owner, "__optim_create", {Value(id_), Value(kind), Value(lr)});
    for (const auto& p : ps) rpc_sync(owner, "__optim_add", {Value(id_), Value(p)});
    owners_.push_back(owner);
  }
}

void DistributedOptimizer::step(int64_t context) {
  std::vector<Future> waits;
  for (const auto& owner : owners_) waits.push_back(rpc_async(owner, "__optim_step", {Value(id_), Value(context)}));
  for (auto& f : waits) f.wait();
}

}  // namespace scaletrain::rpc::dist_autograd

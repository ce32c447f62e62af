#pragma once
// Distributed autograd over rpc/: a backward pass that follows a step's
// computation across the workers its calls went through, and an optimizer
// that applies the gradients where the parameters live.
//
// Note [Distributed backward]: a context (one per step) is current on the
// thread that creates it, and every call made under it carries its id; the
// callee runs the handler under the same id, so nested calls carry it on.
// Each tensor that crosses a call requiring gradients is recorded on both
// sides under one key: the sender keeps the tensor it sent (its graph), the
// receiver computes with a fresh leaf that requires gradients. backward()
// runs the local graph from the losses to its leaves (libtorch's engine,
// graph kept). Gradients of parameters (leaves that are not received
// tensors) add up in the context, never in .grad. The gradient of a received
// leaf goes back to its sender with the key, synchronously. The sender runs
// its own graph from the tensor it sent, with that gradient, and on in the
// same way. Because a backward pass is linear in the gradient it starts
// from, running a graph once per gradient that arrives and adding the
// results gives the gradients of one pass. The outermost call returns when
// every worker reached is done. So backward() returns with every gradient in
// place, on every worker.
//
// The graphs are kept until the context is released (its destructor, on
// every worker). Calls through remote()/RRef::to_here() are not followed:
// distributed autograd covers rpc_sync and rpc_async arguments and results.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/rpc/rpc.h"

namespace scaletrain::rpc::dist_autograd {

// RAII: creates a context and makes it current on this thread; its
// destructor releases it on every worker.
class Context {
 public:
  Context();
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  int64_t id() const { return id_; }

 private:
  int64_t id_;
  int64_t previous_;
};

// Runs the backward pass of `losses` (scalars) across every worker
// (Note [Distributed backward]).
void backward(int64_t context, const std::vector<at::Tensor>& losses);

// This worker's parameter gradients in the context, by parameter.
std::vector<std::pair<at::Tensor, at::Tensor>> get_gradients(int64_t context);
// The gradient of one parameter (undefined if it has none).
at::Tensor gradient(int64_t context, const at::Tensor& param);

// Applies gradients where the parameters live: each owner of some of
// `params` keeps an optimizer over its own (kind "sgd" or "adam", learning
// rate `lr`), and step() runs them with the context's gradients.
class DistributedOptimizer {
 public:
  DistributedOptimizer(const std::string& kind, double lr, const std::vector<RRef>& params);
  void step(int64_t context);

 private:
  std::string id_;
  std::vector<std::string> owners_;
};

namespace detail {
// Hooks the RPC agent calls (rpc/agent.cpp, rpc.cpp; Note [Distributed backward]).
int64_t current();
void set_current(int64_t context);
void on_send(int64_t context, const std::string& key, const std::string& to, const at::Tensor& sent);
at::Tensor on_receive(int64_t context, const std::string& from, const std::string& key, at::Tensor received);
void register_builtins();
}  // namespace detail

}  // namespace scaletrain::rpc::dist_autograd

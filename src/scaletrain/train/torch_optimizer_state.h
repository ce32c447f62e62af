#pragma once
// A checkpoint's view of libtorch's own optimizers (checkpoint::OptimizerState):
// the per-parameter states of torch::optim::Adam and AdamW (with amsgrad's
// maximum), SGD (its momentum buffers), RMSprop and Adagrad, under any
// layout the module trainer uses. libtorch keys a parameter's state by its
// TensorImpl and creates it at the parameter's first step (Adagrad: at
// construction); a state that does not exist yet reads as zeros and is
// created when a checkpoint sets it.
#include <ATen/ATen.h>
#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "scaletrain/checkpoint/sharded.h"

namespace scaletrain::train {

// One kind of per-parameter state tensor of the optimizer state `State`.
template <class State>
struct StateKind {
  std::string name;  // the checkpoint's tensor kind, as PyTorch's state dict names it
  std::function<at::Tensor(const State&)> get;
  std::function<void(State&, const at::Tensor&)> set;
};

template <class State>
class TorchOptimizerState final : public checkpoint::OptimizerState {
 public:
  // `counts_steps`: the state has a step count (set to the run's). `fresh_at_zero`:
  // a checkpoint of no steps leaves no state behind (SGD's momentum buffer
  // starts as the first gradient, not as a zero).
  TorchOptimizerState(torch::optim::Optimizer& o, std::vector<at::Tensor> params, std::vector<StateKind<State>> kinds,
                      bool counts_steps, bool fresh_at_zero)
      : o_(o), params_(std::move(params)), kinds_(std::move(kinds)), counts_steps_(counts_steps),
        fresh_at_zero_(fresh_at_zero) {}

  std::vector<std::string> kinds() const override {
    std::vector<std::string> out;
    for (const auto& k : kinds_) out.push_back(k.name);
    return out;
  }
  at::Tensor value(size_t kind, size_t i) const override {
    const State* s = find(i);
    const at::Tensor t = s ? kinds_.at(kind).get(*s) : at::Tensor();
    return t.defined() ? t : at::zeros_like(params_.at(i), at::MemoryFormat::Contiguous);
  }
  void set_values(size_t i, const std::vector<at::Tensor>& values) override {
    if (!find(i)) {
      auto s = std::make_unique<State>();
      if constexpr (has_step<State>::value) s->step(steps_);
      o_.state()[key(i)] = std::move(s);
    }
    State* s = find(i);
    for (size_t k = 0; k < kinds_.size(); ++k) kinds_[k].set(*s, values.at(k));
  }
  void set_steps(int64_t steps) override {
    steps_ = steps;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (steps == 0 && fresh_at_zero_) {
        o_.state().erase(key(i));
        continue;
      }
      if constexpr (has_step<State>::value)
        if (State* s = find(i); s && counts_steps_) s->step(steps);
    }
  }

 private:
  template <class S, class = void>
  struct has_step : std::false_type {};
  template <class S>
  struct has_step<S, std::void_t<decltype(std::declval<S&>().step(int64_t{}))>> : std::true_type {};

  // The state's key: the parameter's TensorImpl, as text (libtorch 1.x's
  // c10::guts::to_string of the pointer) or as the pointer (2.x).
  template <class Key = typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type>
  Key key(size_t i) const {
    if constexpr (std::is_same_v<Key, std::string>) {
      std::ostringstream text;
      text << params_.at(i).unsafeGetTensorImpl();
      return text.str();
    } else {
      return params_.at(i).unsafeGetTensorImpl();
    }
  }
  State* find(size_t i) const {
    auto it = o_.state().find(key(i));
    return it == o_.state().end() ? nullptr : dynamic_cast<State*>(it->second.get());
  }
  torch::optim::Optimizer& o_;
  std::vector<at::Tensor> params_;
  std::vector<StateKind<State>> kinds_;
  bool counts_steps_, fresh_at_zero_;
  int64_t steps_ = 0;
};

namespace detail {
template <class Options>
bool any_group(torch::optim::Optimizer& o, const std::function<bool(const Options&)>& pred) {
  for (auto& g : o.param_groups())
    if (pred(static_cast<const Options&>(g.options()))) return true;
  return false;
}
// A StateKind over the member pair State::name() / State::name(Tensor).
#define SCALETRAIN_STATE_KIND(State, member)                                                           \
  StateKind<State> {                                                                                   \
    #member, [](const State& s) { return s.member(); }, [](State& s, const at::Tensor& t) { s.member(t); } \
  }
}  // namespace detail

// A checkpoint's view of a libtorch optimizer over `params` (slot i's
// optimizer state is params[i]'s): Adam and AdamW (exp_avg, exp_avg_sq and
// with amsgrad max_exp_avg_sq), SGD (momentum_buffer, with momentum; none
// without: returns null), RMSprop (square_avg, and momentum_buffer and
// grad_avg when a group uses them), Adagrad (sum). Any other optimizer
// (LBFGS keeps a history, not per-parameter tensors) is refused with
// std::invalid_argument naming it.
inline std::unique_ptr<checkpoint::OptimizerState> torch_optimizer_state(torch::optim::Optimizer& o,
                                                                         std::vector<at::Tensor> params) {
  using namespace torch::optim;
  using detail::any_group;
  if (dynamic_cast<Adam*>(&o) || dynamic_cast<AdamW*>(&o)) {
    const bool adam = dynamic_cast<Adam*>(&o) != nullptr;
    const bool ams = adam ? any_group<AdamOptions>(o, [](const auto& x) { return x.amsgrad(); })
                          : any_group<AdamWOptions>(o, [](const auto& x) { return x.amsgrad(); });
    if (adam) {
      std::vector<StateKind<AdamParamState>> k{SCALETRAIN_STATE_KIND(AdamParamState, exp_avg),
                                               SCALETRAIN_STATE_KIND(AdamParamState, exp_avg_sq)};
      if (ams) k.push_back(SCALETRAIN_STATE_KIND(AdamParamState, max_exp_avg_sq));
      return std::make_unique<TorchOptimizerState<AdamParamState>>(o, std::move(params), k, true, false);
    }
    std::vector<StateKind<AdamWParamState>> k{SCALETRAIN_STATE_KIND(AdamWParamState, exp_avg),
                                              SCALETRAIN_STATE_KIND(AdamWParamState, exp_avg_sq)};
    if (ams) k.push_back(SCALETRAIN_STATE_KIND(AdamWParamState, max_exp_avg_sq));
    return std::make_unique<TorchOptimizerState<AdamWParamState>>(o, std::move(params), k, true, false);
  }
  if (dynamic_cast<SGD*>(&o)) {
    if (!any_group<SGDOptions>(o, [](const auto& x) { return x.momentum() != 0; })) return nullptr;  // no state
    return std::make_unique<TorchOptimizerState<SGDParamState>>(
        o, std::move(params), std::vector{SCALETRAIN_STATE_KIND(SGDParamState, momentum_buffer)}, false, true);
  }
  if (dynamic_cast<RMSprop*>(&o)) {
    std::vector<StateKind<RMSpropParamState>> k{SCALETRAIN_STATE_KIND(RMSpropParamState, square_avg)};
    if (any_group<RMSpropOptions>(o, [](const auto& x) { return x.momentum() > 0; }))
      k.push_back(SCALETRAIN_STATE_KIND(RMSpropParamState, momentum_buffer));
    if (any_group<RMSpropOptions>(o, [](const auto& x) { return x.centered(); }))
      k.push_back(SCALETRAIN_STATE_KIND(RMSpropParamState, grad_avg));
    return std::make_unique<TorchOptimizerState<RMSpropParamState>>(o, std::move(params), k, true, false);
  }
  if (dynamic_cast<Adagrad*>(&o))
    return std::make_unique<TorchOptimizerState<AdagradParamState>>(
        o, std::move(params), std::vector{SCALETRAIN_STATE_KIND(AdagradParamState, sum)}, true, false);
  throw std::invalid_argument("optimizer " + c10::demangle(typeid(o).name()) +
                              " is not supported by checkpoints (torch::optim::Adam, AdamW, SGD, RMSprop and "
                              "Adagrad are; LBFGS keeps a history, not per-parameter tensors)");
}

#undef SCALETRAIN_STATE_KIND

}  // namespace scaletrain::train

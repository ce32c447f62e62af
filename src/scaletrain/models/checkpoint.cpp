// Activation checkpointing. See checkpoint.h.
//
// Note [Checkpoint function]
// --------------------------
// PyTorch's reentrant checkpoint calls torch.autograd.backward on the
// recomputed graph from inside the outer backward, so parameter gradients are
// accumulated by a nested graph task. That does not fit engines that hook
// AccumulateGrad and queue an end-of-backward callback on the *current* graph
// task (parallel/ddp, parallel/fsdp): a hook that first fires inside the nested
// task would queue its callback there and run it when the nested task ends, in
// the middle of the real backward. Here the parameters are inputs of the
// Function instead, and backward computes the gradients with
// torch::autograd::grad (which only captures gradients at the requested
// inputs, running no AccumulateGrad node) and returns them: the outer
// graph's AccumulateGrad nodes receive them, once, with their hooks.
//
// The recomputation must see what the forward saw: the same autocast state
// (backward runs outside the trainer's autocast region) and, with dropout,
// the same random numbers. Both are captured at forward and restored around
// the recomputation only.
#include "scaletrain/models/checkpoint.h"

#include "scaletrain/precision/autocast_compat.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "scaletrain/util/error.h"

namespace scaletrain::models {

ActivationCheckpointing parse_activation_checkpointing(const std::string& s) {
  if (s == "none") return ActivationCheckpointing::None;
  if (s == "full") return ActivationCheckpointing::Full;
  throw UsageError("model.activation_checkpointing must be one of none | full, got '" + s + "'");
}

std::string to_string(ActivationCheckpointing c) { return c == ActivationCheckpointing::Full ? "full" : "none"; }

namespace {

using Body = std::function<torch::Tensor(const torch::Tensor&)>;

// Autocast flags and dtypes of this thread (CPU and CUDA).
struct AutocastState {
  bool cpu = false, gpu = false;
  at::ScalarType cpu_dtype = at::kBFloat16, gpu_dtype = at::kHalf;

  static AutocastState current() {
    using namespace precision::compat;
    return {autocast_enabled(at::kCPU), autocast_enabled(at::kCUDA), autocast_dtype(at::kCPU),  // host: CPU autocast
            autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    using namespace precision::compat;
    set_autocast_enabled(at::kCPU, cpu);  // host: CPU autocast
    set_autocast_enabled(at::kCUDA, gpu);
    set_autocast_dtype(at::kCPU, cpu_dtype);  // host: CPU autocast
    set_autocast_dtype(at::kCUDA, gpu_dtype);
  }
};

// Everything the recomputation needs besides the saved input, kept in the
// autograd context (as an IValue capsule: the context stores only IValues).
struct Recompute : torch::CustomClassHolder {
  Body body;
  std::vector<torch::Tensor> params;
  AutocastState autocast;
  c10::optional<at::Generator> generator;  // set when the RNG state must be replayed
  at::Tensor rng_state;
};

// Sets the forward's autocast state and random generator state for as long
// as it lives, then puts back what was there (the generator continues where
// backward's own draws left it, not where the forward left it).
class ReplayForward {
 public:
  explicit ReplayForward(Recompute& r) : autocast_(AutocastState::current()), r_(r) {
    r.autocast.apply();
    if (r.autocast.cpu || r.autocast.gpu) at::autocast::increment_nesting();
    if (r.generator) {
      std::lock_guard<std::mutex> lock(r.generator->mutex());
      rng_ = r.generator->get_state();
      r.generator->set_state(r.rng_state);
    }
  }
  ~ReplayForward() {
    if (r_.generator) {
      std::lock_guard<std::mutex> lock(r_.generator->mutex());
      r_.generator->set_state(rng_);
    }
    // The casts cached during the recomputation belong to it alone.
    if ((r_.autocast.cpu || r_.autocast.gpu) && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    autocast_.apply();
  }
  ReplayForward(const ReplayForward&) = delete;
  ReplayForward& operator=(const ReplayForward&) = delete;

 private:
  AutocastState autocast_;
  Recompute& r_;
  at::Tensor rng_;
};

thread_local int recompute_depth = 0;

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // Inputs as autograd sees them: x, every parameter, then the capsule (not
  // a tensor, so it gets no gradient slot of its own in CppNode's check).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, at::TensorList params,
                               const c10::intrusive_ptr<Recompute>& recompute) {
    ctx->save_for_backward({x});
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(recompute);
    return recompute->body(x);  // gradient mode is off inside Function::forward
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto r = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    const torch::Tensor saved = ctx->get_saved_variables()[0];
    const bool x_grad = saved.requires_grad();
    torch::Tensor x = saved.detach().requires_grad_(x_grad);
    torch::Tensor y;
    {
      ReplayForward replay(*r);
      torch::AutoGradMode grad_on(true);
      ++recompute_depth;
      try {
        y = r->body(x);
      } catch (...) {
        --recompute_depth;
        throw;
      }
      --recompute_depth;
    }
    // Differentiate with respect to what needs a gradient; the rest get none.
    std::vector<torch::Tensor> wrt;
    if (x_grad) wrt.push_back(x);
    for (const auto& p : r->params)
      if (p.requires_grad()) wrt.push_back(p);
    std::vector<torch::Tensor> g;
    if (!wrt.empty() && y.requires_grad())
      g = torch::autograd::grad({y}, wrt, {grad_out[0]}, /*retain_graph=*/false, /*create_graph=*/false,
                                /*allow_unused=*/true);
    torch::autograd::variable_list out;
    size_t k = 0;
    out.push_back(x_grad && !g.empty() ? g[k++] : torch::Tensor());
    for (const auto& p : r->params) out.push_back(p.requires_grad() && !g.empty() ? g[k++] : torch::Tensor());
    out.emplace_back();  // the capsule
    return out;
  }
};

}  // namespace

bool recomputing() { return recompute_depth > 0; }

torch::Tensor checkpoint(const Body& body, const torch::Tensor& x, const std::vector<torch::Tensor>& params,
                         const CheckpointOptions& options) {
  bool any_grad = x.requires_grad();
  for (const auto& p : params) any_grad = any_grad || p.requires_grad();
  if (!torch::GradMode::is_enabled() || !any_grad) return body(x);
  auto r = c10::make_intrusive<Recompute>();
  r->body = body;
  r->params = params;
  r->autocast = AutocastState::current();
  if (options.preserve_rng) {
    r->generator = at::globalContext().defaultGenerator(x.device());
    std::lock_guard<std::mutex> lock(r->generator->mutex());
    r->rng_state = r->generator->get_state();
  }
  return CheckpointFunction::apply(x, at::TensorList(params), r);
}

}  // namespace scaletrain::models

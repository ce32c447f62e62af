#pragma once
// Parameters without bytes: building a model whose weights are materialized
// later, one tensor at a time, by a strategy that keeps only its shard
// (memory-efficient initialization of models larger than one rank's memory).
//
// A deferred parameter keeps its Variable, shape, dtype and requires_grad, but
// its storage holds zero bytes; reading it before it is materialized is a bug.
// The model says how each parameter is initialized (an InitFn), and the
// strategy calls it into a temporary of that shape, in registration order, so
// the random draws are exactly those of an eagerly built model.
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain::interfaces {

// Fills `out` (shaped like the parameter `name`) with its initial value.
using InitFn = std::function<void(const std::string& name, at::Tensor& out)>;

// Allocates or releases the bytes of a tensor's storage, keeping the storage
// object and every view of it (Note [Flat parameters] in parallel/fsdp).
void alloc_storage(const at::Tensor& t);
void free_storage(const at::Tensor& t);

// Releases the bytes of every parameter of `module` (and its children).
void free_parameters(torch::nn::Module& module);

// Gives every byte-less parameter of `module` the dtype `dtype`, still
// without bytes: what `module->to(dtype)` does to a materialized model.
// With `device`, the parameters (still without bytes) and the module's
// buffers (with their values) move there too.
void set_deferred_dtype(torch::nn::Module& module, at::ScalarType dtype,
                        const std::optional<at::Device>& device = std::nullopt);

// An InitFn that draws each tensor in `dtype` (a temporary) and copies it
// into the parameter's dtype: the values an eager model built in `dtype` and
// converted by `to()` would hold, so deferred 16-bit parameters equal eager ones.
InitFn init_through(at::ScalarType dtype, InitFn init);

// The draws of a whole model on a rank that holds only some of its
// parameters (expert parallelism keeps one place's experts). `order` names
// every parameter of the whole model with its shape, in registration order.
// Asked for a parameter, the result first draws into a temporary, and drops,
// each parameter before it in `order` that this rank has not drawn yet, so
// every value is the one the whole model's draws give it, whichever
// parameters this rank was asked for before (a rank is asked only for those
// it sends). Parameters must be asked for in registration order.
using ParamShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
InitFn replaying_draws(InitFn init, ParamShapes order);
ParamShapes param_shapes(const torch::nn::Module& module);

}  // namespace scaletrain::interfaces

#include "scaletrain/interfaces/deferred.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

#include <memory>
#include <stdexcept>

namespace scaletrain::interfaces {

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  TORCH_CHECK(s->nbytes() == 0, "scaletrain: storage is partly allocated");
  const c10::DeviceGuard on(t.device());  // a GPU allocator allocates on the current device
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void free_parameters(torch::nn::Module& module) {
  for (auto& p : module.parameters()) free_storage(p);
}

void set_deferred_dtype(torch::nn::Module& module, at::ScalarType dtype, const std::optional<at::Device>& device) {
  torch::NoGradGuard no_grad;
  const at::Device where = device.value_or(at::Device(at::DeviceType::Meta));
  if (device)
    for (auto& b : module.buffers()) b.set_data(b.to(*device));
  for (auto& p : module.parameters()) {
    const bool moves = device && p.device() != where;
    if (p.scalar_type() == dtype && !moves) continue;
    TORCH_CHECK(p.storage().nbytes() == 0 || p.numel() == 0, "scaletrain: set_deferred_dtype on a parameter that has bytes");
    at::Tensor t = at::empty(p.sizes(), p.options().dtype(dtype).device(moves ? where : p.device()).requires_grad(false));
    free_storage(t);  // the peak is one parameter, in the new dtype
    p.set_data(t);
  }
}

InitFn init_through(at::ScalarType dtype, InitFn init) {
  return [dtype, init = std::move(init)](const std::string& name, at::Tensor& out) {
    if (out.scalar_type() == dtype) return init(name, out);
    at::Tensor tmp = at::empty(out.sizes(), out.options().dtype(dtype));
    init(name, tmp);
    torch::NoGradGuard no_grad;
    out.copy_(tmp);
  };
}

InitFn replaying_draws(InitFn init, ParamShapes order) {
  auto next = std::make_shared<size_t>(0);  // the first parameter of `order` not drawn yet
  return [init = std::move(init), order = std::move(order), next](const std::string& name, at::Tensor& out) {
    size_t i = *next;
    while (i < order.size() && order[i].first != name) ++i;
    if (i == order.size())
      throw std::logic_error("replaying_draws: parameter '" + name +
                             "' is not in the whole model, or was asked for out of registration order");
    for (; *next < i; ++*next) {
      at::Tensor skipped = at::empty(order[*next].second, out.options());
      init(order[*next].first, skipped);
    }
    init(name, out);
    *next = i + 1;
  };
}

ParamShapes param_shapes(const torch::nn::Module& module) {
  ParamShapes out;
  for (const auto& item : module.named_parameters()) out.emplace_back(item.key(), item.value().sizes().vec());
  return out;
}

}  // namespace scaletrain::interfaces

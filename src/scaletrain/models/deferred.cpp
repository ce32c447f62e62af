#include "scaletrain/models/deferred.h"

#include <c10/core/StorageImpl.h>

namespace scaletrain::models {

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  TORCH_CHECK(s->nbytes() == 0, "scaletrain: storage is partly allocated");
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

}  // namespace scaletrain::models

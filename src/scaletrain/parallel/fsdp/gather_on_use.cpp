#include "scaletrain/parallel/fsdp/gather_on_use.h"

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace scaletrain::parallel::fsdp {

struct GatherOnUse::Impl {
  std::function<int64_t(const c10::StorageImpl*)> unit_of;
  std::function<void(size_t)> use;
  at::CallbackHandle handle = 0;
};

namespace {

thread_local int t_quiet = 0;

// Process-wide registry of the live engines' hooks (a RecordFunction
// callback is a plain function pointer and carries no state of its own).
std::mutex g_mu;
std::vector<GatherOnUse::Impl*>& registry() {
  static std::vector<GatherOnUse::Impl*> r;
  return r;
}

using Wanted = c10::SmallVector<std::pair<GatherOnUse::Impl*, size_t>, 4>;

void want(const at::Tensor& t, Wanted& out) {
  if (!t.defined() || !t.has_storage()) return;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  for (GatherOnUse::Impl* impl : registry()) {
    const int64_t u = impl->unit_of(s);
    if (u < 0) continue;
    const std::pair<GatherOnUse::Impl*, size_t> w{impl, static_cast<size_t>(u)};
    if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  }
}

void visit(const c10::IValue& v, Wanted& out) {
  if (v.isTensor()) {
    want(v.toTensor(), out);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) want(t, out);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) visit(e, out);
  }
}

std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  if (t_quiet > 0) return nullptr;
  Wanted wanted;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (registry().empty()) return nullptr;
    for (const c10::IValue& v : fn.inputs()) visit(v, wanted);
  }
  // Exceptions cannot leave a RecordFunction callback (libtorch logs and
  // drops them); `use` reports failures itself (see fully_shard.cpp).
  for (auto& [impl, u] : wanted) {
    GatherOnUse::Quiet quiet;
    impl->use(u);
  }
  return nullptr;
}

}  // namespace

GatherOnUse::GatherOnUse(std::function<int64_t(const c10::StorageImpl*)> unit_of, std::function<void(size_t)> use)
    : impl_(new Impl{std::move(unit_of), std::move(use)}) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    registry().push_back(impl_);
  }
  impl_->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_operator).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
}

GatherOnUse::~GatherOnUse() {
  at::removeCallback(impl_->handle);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), impl_), r.end());
  }
  delete impl_;
}

bool GatherOnUse::claimed(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (Impl* impl : registry())
    if (impl->unit_of(storage) >= 0) return true;
  return false;
}

GatherOnUse::Quiet::Quiet() { ++t_quiet; }
GatherOnUse::Quiet::~Quiet() { --t_quiet; }

}  // namespace scaletrain::parallel::fsdp

// The operator callbacks behind Note [Gather on use]: the thread-local one
// that gathers a unit before an operator reads it, and the process-wide one
// that notices other threads reading a live engine's parameters.
#include "scaletrain/parallel/fsdp/gather_on_use.h"

#include <ATen/Parallel.h>
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace scaletrain::parallel::fsdp {

struct GatherOnUse::Impl {
  Hooks hooks;
  at::CallbackHandle handle = 0;  // the thread-local callback, on the engine's threads
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
// The process-wide watcher of other threads, registered while any engine lives.
at::CallbackHandle g_watch = 0;

template <typename F>
void each_tensor(const c10::IValue& v, const F& f) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.has_storage()) f(t);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector())
      if (t.defined() && t.has_storage()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) each_tensor(e, f);
  }
}

// Whether this thread carries the thread-local callback `handle`: the thread
// that registered it, and the threads autograd runs its backward on.
bool carries(at::CallbackHandle handle) {
  for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_)
    if (entry.handle_ == handle) return true;
  return false;
}

using Wanted = c10::SmallVector<std::pair<GatherOnUse::Impl*, size_t>, 4>;

// The thread-local callback: gathers what the operator reads.
std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  if (t_quiet > 0) return nullptr;
  Wanted wanted;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (registry().empty()) return nullptr;
    // Whether this thread carries each engine's callback, once per operator.
    c10::SmallVector<bool, 4> own;
    for (GatherOnUse::Impl* impl : registry()) own.push_back(carries(impl->handle));
    for (const c10::IValue& v : fn.inputs())
      each_tensor(v, [&](const at::Tensor& t) {
        const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
        for (size_t i = 0; i < registry().size(); ++i) {
          GatherOnUse::Impl* impl = registry()[i];
          if (impl->hooks.read && own[i]) impl->hooks.read(s, fn.name());
          const int64_t u = impl->hooks.unit_of(s);
          if (u < 0) continue;
          if (!own[i]) {  // another engine's thread
            impl->hooks.foreign(t);
            continue;
          }
          const std::pair<GatherOnUse::Impl*, size_t> w{impl, static_cast<size_t>(u)};
          if (std::find(wanted.begin(), wanted.end(), w) == wanted.end()) wanted.push_back(w);
        }
      });
  }
  // Exceptions cannot leave a RecordFunction callback (libtorch logs and
  // drops them); `use` reports failures itself (see fully_shard.cpp).
  for (auto& [impl, u] : wanted) {
    GatherOnUse::Quiet quiet;
    impl->hooks.use(u);
  }
  return nullptr;
}

// The process-wide callback: on a thread that carries no engine's callback,
// reads of an engine's parameters are noted (Note [Gather on use]).
std::unique_ptr<at::ObserverContext> on_other_thread(const at::RecordFunction& fn) {
  // The hot path on an engine's threads: one pass over its one or two callbacks.
  for (const auto& entry : at::get_record_function_tls_().sorted_tls_callbacks_)
    if (entry.callback_.start() == &on_operator) return nullptr;
  if (t_quiet > 0 || at::in_parallel_region()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  for (const c10::IValue& v : fn.inputs())
    each_tensor(v, [&](const at::Tensor& t) {
      for (GatherOnUse::Impl* impl : registry()) impl->hooks.foreign(t);
    });
  return nullptr;
}

}  // namespace

GatherOnUse::GatherOnUse(Hooks hooks) : impl_(new Impl{std::move(hooks)}) {
  impl_->handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&on_operator).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  std::lock_guard<std::mutex> lock(g_mu);
  registry().push_back(impl_);
  if (g_watch == 0)
    g_watch = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_other_thread).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
}

GatherOnUse::~GatherOnUse() {
  at::removeCallback(impl_->handle);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), impl_), r.end());
    if (r.empty() && g_watch != 0) {
      at::removeCallback(g_watch);
      g_watch = 0;
    }
  }
  delete impl_;
}

bool GatherOnUse::claimed(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (Impl* impl : registry())
    if (impl->hooks.unit_of(storage) >= 0) return true;
  return false;
}

GatherOnUse::Quiet::Quiet() { ++t_quiet; }
GatherOnUse::Quiet::~Quiet() { --t_quiet; }

}  // namespace scaletrain::parallel::fsdp

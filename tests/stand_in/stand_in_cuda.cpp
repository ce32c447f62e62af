// A stand-in CUDA device for CPU-only libtorch, loaded into a run with
// LD_PRELOAD (tests/stand_in/parity.sh): tensors on "cuda:0" keep their bytes
// in host memory, and every operator on them runs the CPU kernel over the
// same memory. What it checks is what a GPU run checks first and a CPU run
// never does: that every tensor an operator takes is on the same device.
//
// Note [Stand-in CUDA]
// - libtorch's CUDA hooks (at::detail::getCUDAHooks) report four GPUs with
//   primary contexts, so torch::cuda::is_available() is true, ranks of one
//   host each take their own, and the autograd engine runs its CUDA device
//   threads. Pinned memory is plain host memory.
// - A device guard for CUDA with a current device per thread and one stream
//   per device; events are no-ops (the CPU kernels finish before they
//   return).
// - Tensors on the device come from a host allocator whose pointers carry the
//   CUDA device; empty, empty_strided, copy_ and _copy_from have kernels of
//   their own, and every other operator goes through one boxed fallback:
//     1. it refuses the call, with the message CUDA kernels give, when a
//        device tensor meets one on another GPU, or a host tensor of one or
//        more dimensions (a
//        0-dim host tensor is a scalar, which CUDA kernels accept; indexing
//        accepts host indices, as on a GPU);
//     2. device tensors become host tensors over the same bytes (from_blob:
//        no copy, so in-place operators and views write where they should),
//        and a device argument (a factory's) becomes the CPU;
//     3. the CPU kernel runs;
//     4. each result that lies in a device tensor's memory is that tensor
//        (in-place operators) or a view of its storage; any other result is
//        copied to the device.
// - What it cannot check: CUDA-only code (streams, NCCL, the caching
//   allocator's figures, kernels of our own for the GPU), host reads of
//   device memory (here they succeed), and speed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/resize_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

// Four GPUs, so that ranks of one host each take their own (LOCAL_RANK).
constexpr c10::DeviceIndex kDevices = 4;
thread_local c10::DeviceIndex t_current = 0;

c10::Device device(c10::DeviceIndex i) { return c10::Device(c10::DeviceType::CUDA, i); }

struct DeviceAllocator final : c10::Allocator {
  c10::DeviceIndex index = 0;
  c10::DataPtr allocate(size_t n) const override {
    void* p = n > 0 ? c10::alloc_cpu(n) : nullptr;
    return {p, p, &c10::free_cpu, device(index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
};
DeviceAllocator g_allocators[kDevices];

DeviceAllocator* allocator_for(c10::optional<at::Device> d) {
  const c10::DeviceIndex i = d && d->has_index() ? d->index() : t_current;
  TORCH_CHECK(i >= 0 && i < kDevices, "the stand-in CUDA device has ", int(kDevices), " GPUs, not cuda:", int(i));
  return &g_allocators[i];
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return device(t_current); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) t_current = d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    static int recorded;
    *event = &recorded;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, Guard);

struct Hooks final : at::CUDAHooksInterface {
  explicit Hooks(at::CUDAHooksArgs) {}
  void initCUDA() const override {}
  const at::Generator& getDefaultCUDAGenerator(c10::DeviceIndex) const override {
    static at::Generator generator = at::make_generator<at::CPUGeneratorImpl>();
    return generator;
  }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(int64_t) const override { return true; }
  int64_t current_device() const override { return t_current; }
  at::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  bool isPinnedPtr(void*) const override { return false; }
  int getNumGPUs() const override { return kDevices; }
  void deviceSynchronize(int64_t) const override {}
};

bool on_device(const at::Tensor& t) { return t.defined() && t.device().is_cuda(); }

// A host tensor over the same bytes: a CPU tensor over the whole of the
// device tensor's storage (not owning it), with its sizes, strides and offset,
// so that views with explicit offsets (as_strided, set_) land where they
// would on the device. `resizable`: the storage may grow (an out= kernel
// resizing its output); it then moves to fresh host memory, which the
// fallback copies back into the device tensor, grown to match.
at::Tensor host_view(const at::Tensor& t, bool resizable) {
  if (!on_device(t)) return t;
  const c10::Storage& storage = t.storage();
  void* base = storage.data();
  c10::Storage host(c10::Storage::use_byte_size_t(), storage.nbytes(),
                    c10::DataPtr(
                        base, base, [](void*) {}, c10::Device(c10::kCPU)),
                    c10::GetCPUAllocator(), resizable);
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(std::move(host), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}
at::Tensor host_view(const at::Tensor& t) { return host_view(t, false); }

at::Tensor empty(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype, c10::optional<at::Layout>,
                 c10::optional<at::Device> where, c10::optional<bool>, c10::optional<at::MemoryFormat> format) {
  return at::detail::empty_generic(size, allocator_for(where), c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                   dtype.value_or(at::kFloat), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, c10::optional<at::ScalarType> dtype,
                         c10::optional<at::Layout>, c10::optional<at::Device> where, c10::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, allocator_for(where),
                                           c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype.value_or(at::kFloat));
}

at::Tensor& copy(at::Tensor& self, const at::Tensor& src, bool) {
  host_view(self).copy_(host_view(src));
  return self;
}

at::Tensor copy_from(const at::Tensor& src, const at::Tensor& dst, bool) {
  host_view(dst).copy_(host_view(src));
  return dst;
}

// The device tensor whose storage `host` lies in: the tensor itself when
// the operator wrote into it (`written`: an in-place or out= result that is
// exactly its host view), else a new view of the same storage.
c10::optional<at::Tensor> device_alias(const at::Tensor& host, const std::vector<at::Tensor>& on_dev, bool written) {
  const char* p = static_cast<const char*>(host.data_ptr());
  for (const at::Tensor& d : on_dev) {
    const c10::Storage& storage = d.storage();
    const char* base = static_cast<const char*>(storage.data());
    if (base == nullptr || p < base || p >= base + storage.nbytes()) continue;
    if (written && p == d.data_ptr() && host.sizes() == d.sizes() && host.strides() == d.strides() &&
        host.dtype() == d.dtype())
      return d;
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), d.key_set(), host.dtype());
    impl->set_sizes_and_strides(host.sizes(), host.strides(), (p - base) / static_cast<int64_t>(host.itemsize()));
    return at::Tensor(std::move(impl));
  }
  return c10::nullopt;
}

at::Tensor to_device(const at::Tensor& host, const std::vector<at::Tensor>& on_dev, bool written,
                     c10::optional<at::Device> target) {
  if (!host.defined() || !host.device().is_cpu()) return host;
  if (auto alias = device_alias(host, on_dev, written)) return *alias;
  at::Tensor out = empty_strided(host.sizes(), host.strides(), host.scalar_type(), {}, target, {});
  host_view(out).copy_(host);
  return out;
}

bool takes_host_indices(const std::string& op) {
  return op == "aten::index" || op == "aten::index_put_" || op == "aten::_index_put_impl_";
}

// Every tensor of an argument: a tensor, a list of tensors, or a list of optional tensors.
template <typename Fn>
void each_tensor(c10::IValue& v, Fn fn) {
  if (v.isTensor()) {
    v = fn(v.toTensor());
  } else if (v.isTensorList()) {
    auto list = v.toTensorList();
    for (size_t j = 0; j < list.size(); ++j) list[j] = fn(list[j]);
    v = list;
  } else if (v.isList()) {
    auto list = v.toList();
    for (size_t j = 0; j < list.size(); ++j)
      if (list.get(j).isTensor()) list.set(j, fn(list.get(j).toTensor()));
    v = list;
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t begin = stack->size() - schema.arguments().size();
  std::vector<at::Tensor> on_dev;
  bool host_array = false;
  for (size_t i = begin; i < stack->size(); ++i)
    each_tensor((*stack)[i], [&](const at::Tensor& t) {
      if (on_device(t))
        on_dev.push_back(t);
      else if (t.defined() && t.dim() > 0)
        host_array = true;
      return t;
    });
  c10::optional<at::Device> target;
  if (!on_dev.empty()) target = on_dev[0].device();
  for (const at::Tensor& t : on_dev)
    TORCH_CHECK(t.device() == *target, "Expected all tensors to be on the same device, but found at least two ",
                "devices, ", *target, " and ", t.device(), "! (", schema.name(), " on the stand-in CUDA device)");
  TORCH_CHECK(on_dev.empty() || !host_array || takes_host_indices(schema.name()),
              "Expected all tensors to be on the same device, but found at least two devices, ", *target, " and cpu! (",
              schema.name(), " on the stand-in CUDA device)");
  // Written arguments (in-place and out=): the device tensor and the host view the kernel writes.
  std::vector<std::pair<at::Tensor, at::Tensor>> written;
  for (size_t i = begin; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    const c10::AliasInfo* alias = schema.arguments()[i - begin].alias_info();
    if (v.isDevice() && v.toDevice().is_cuda()) {
      if (!target) target = v.toDevice();
      v = c10::Device(c10::kCPU);
    } else if (alias != nullptr && alias->isWrite() && v.isTensor() && on_device(v.toTensor())) {
      written.emplace_back(v.toTensor(), host_view(v.toTensor(), /*resizable=*/true));
      v = written.back().second;
    } else {
      each_tensor(v, [](const at::Tensor& t) { return host_view(t); });
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  for (auto& [dev, host] : written)  // a kernel that resized its output wrote elsewhere
    if (host.data_ptr() != dev.data_ptr() || host.sizes() != dev.sizes()) {
      dev.resize_(host.sizes());
      host_view(dev).copy_(host);
    }
  const size_t first = stack->size() - schema.returns().size();
  for (size_t i = first; i < stack->size(); ++i) {
    const c10::AliasInfo* alias = schema.returns()[i - first].alias_info();
    if (alias != nullptr && alias->isWrite() && written.size() == 1 && (*stack)[i].isTensor()) {
      (*stack)[i] = written[0].first;  // in-place and out= operators return the tensor they wrote
      continue;
    }
    const bool write = alias != nullptr && alias->isWrite();
    each_tensor((*stack)[i], [&](const at::Tensor& t) { return to_device(t, on_dev, write, target); });
  }
}

}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", Hooks)
}  // namespace at

TORCH_LIBRARY_IMPL(_, CUDA, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>()); }

TORCH_LIBRARY_IMPL(aten, CUDA, m) {
  m.impl("empty.memory_format", TORCH_FN(empty));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("copy_", TORCH_FN(copy));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("resize_", TORCH_FN(at::native::resize_));
}

namespace {
struct SetAllocator {
  SetAllocator() {
    for (c10::DeviceIndex i = 0; i < kDevices; ++i) g_allocators[i].index = i;
    c10::SetAllocator(c10::DeviceType::CUDA, &g_allocators[0]);
  }
} g_set_allocator;
}  // namespace

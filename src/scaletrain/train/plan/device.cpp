#include "scaletrain/train/plan/device.h"

#include <torch/cuda.h>

#if defined(SCALETRAIN_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "scaletrain/util/error.h"

namespace scaletrain::train {

DeviceEnvironment DeviceEnvironment::probe() {
  DeviceEnvironment env;
#if defined(SCALETRAIN_WITH_CUDA)
  env.built_with_cuda = true;
#else
  // A CPU build sees CUDA only through a device registered at run time: the
  // tests' stand-in (Note [Stand-in CUDA] in tests/stand_in/stand_in_cuda.cpp).
  env.built_with_cuda = at::globalContext().hasCUDA();
#endif
  env.visible_gpus = env.built_with_cuda && torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  return env;
}

at::Device resolve_device(const std::string& spec, int local_rank, const DeviceEnvironment& env) {
  if (spec == "cpu") return at::Device(at::kCPU);  // host: a CPU run is asked for
  // cuda:N names the GPU (several ranks may share one, e.g. over Gloo); cuda takes LOCAL_RANK's.
  int index = local_rank;
  if (spec.rfind("cuda:", 0) == 0) {
    const std::string n = spec.substr(5);
    if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError("train.device=" + spec + ": expected cuda:N with N a GPU number");
    index = std::stoi(n);
  } else if (spec != "auto" && spec != "cuda") {
    throw UsageError("train.device must be auto, cpu, cuda or cuda:N, got '" + spec + "'");
  }
  const bool asked = spec != "auto";
  if (!env.built_with_cuda) {
    if (asked)
      throw UsageError("train.device=" + spec +
                       " needs a CUDA build (this scaletrain is built against a libtorch without CUDA)");
    return at::Device(at::kCPU);  // host: no CUDA build
  }
  if (env.visible_gpus == 0) {
    if (asked) throw UsageError("train.device=" + spec + ": no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)");
    return at::Device(at::kCPU);  // host: no GPU visible
  }
  const std::string gpus = std::to_string(env.visible_gpus) + " GPU" + (env.visible_gpus == 1 ? "" : "s");
  if (spec.rfind("cuda:", 0) == 0 && index >= env.visible_gpus)
    throw UsageError("train.device=" + spec + " but this process sees " + gpus + " (cuda:0 to cuda:" +
                     std::to_string(env.visible_gpus - 1) + ")");
  if (index < 0 || index >= env.visible_gpus)
    throw UsageError("LOCAL_RANK=" + std::to_string(local_rank) + " but this process sees " + gpus +
                     " (one rank per GPU: use --nproc-per-node " + std::to_string(env.visible_gpus) +
                     ", train.device=cuda:N to share one, or train.device=cpu)");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

void use_device(const at::Device& device) {
  if (!device.is_cuda()) return;
#if defined(SCALETRAIN_WITH_CUDA)
  c10::cuda::set_device(device.index());
#endif
}

DeviceMemory device_memory(const at::Device& device) {
  DeviceMemory m;
#if defined(SCALETRAIN_WITH_CUDA)
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    // Index 0 is the aggregate over pool kinds in every libtorch version.
    m.available = true;
    m.max_allocated_mb = static_cast<double>(stats.allocated_bytes[0].peak) / 1048576.0;
    m.max_reserved_mb = static_cast<double>(stats.reserved_bytes[0].peak) / 1048576.0;
  }
#else
  (void)device;
#endif
  return m;
}

void reset_device_peaks(const at::Device& device) {
#if defined(SCALETRAIN_WITH_CUDA)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

at::Tensor host_empty(int64_t numel, at::ScalarType dtype, bool pin) {
  // Host memory is what is meant here (offloaded state).
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(pin));  // host: offloaded state
}

}  // namespace scaletrain::train

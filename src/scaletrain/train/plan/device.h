#pragma once
// Where a run computes, and what the device's allocator says about memory.
//
// Note [One device per rank]: a rank computes on one device. train.device
// auto takes the GPU numbered LOCAL_RANK when libtorch was built with CUDA
// and that GPU is visible, else the CPU; cuda insists on a GPU (a usage error
// when there is none, or when LOCAL_RANK is beyond the visible ones); cpu
// never uses a GPU. Everything downstream takes the plan's device: the model
// and its buffers are moved there, batches are copied there, the engines
// allocate beside the parameters they manage (`param.options()`), autocast is
// entered for the device's type, and the collective backend follows (NCCL for
// CUDA tensors, Gloo for CPU ones, unless parallel.backend forces one).
// Host memory is named only where host memory is meant: offloaded shards,
// checkpoint files, token batches before their copy, and scalar bookkeeping.
#include <ATen/ATen.h>

#include <string>

namespace scaletrain::train {

// What this process can see (injectable so the CPU build tests the GPU rules).
struct DeviceEnvironment {
  bool built_with_cuda = false;  // libtorch (and scaletrain) were built with CUDA
  int visible_gpus = 0;          // torch::cuda::device_count()
  static DeviceEnvironment probe();
};

// train.device (auto | cpu | cuda) for the rank with local rank `local_rank`;
// throws UsageError naming the problem (Note [One device per rank]).
at::Device resolve_device(const std::string& spec, int local_rank, const DeviceEnvironment& env);

// Makes `device` current for this thread (a CUDA device: cudaSetDevice), so
// that NCCL and any allocation without an explicit index land on it.
void use_device(const at::Device& device);

// Peak allocated and reserved bytes of the device's caching allocator since
// the last reset, in MiB; `available` is false on CPU (RSS is the figure).
struct DeviceMemory {
  bool available = false;
  double max_allocated_mb = 0;
  double max_reserved_mb = 0;
};
DeviceMemory device_memory(const at::Device& device);
void reset_device_peaks(const at::Device& device);

// Host memory for state kept off the device: page-locked when the device is a
// GPU (pin), so copies to and from it can be asynchronous; plain otherwise.
at::Tensor host_empty(int64_t numel, at::ScalarType dtype, bool pin);

}  // namespace scaletrain::train

#pragma once
// Every difference between the libtorch versions scaletrain builds against
// (Debian's 1.13.1, CPU + Gloo; PyTorch 2.x with CUDA + NCCL) lives here.
//
// - 1.13: backends derive from c10d::ProcessGroup. 2.x: from c10d::Backend,
//   and c10d::ProcessGroup became a dispatching wrapper.
// - ProcessGroupGloo.hpp / ProcessGroupNCCL.hpp are guarded by USE_C10D_GLOO /
//   USE_C10D_NCCL, which libtorch does not export to its users.
// - NCCL exists only in CUDA builds (TORCH_CUDA / USE_C10D_NCCL below).
#include <torch/version.h>

#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#if defined(SCALETRAIN_WITH_NCCL)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <memory>
#include <string>

namespace scaletrain::comm::compat {

#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<BackendBase>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// True when this build can run NCCL (libtorch with CUDA, built with
// SCALETRAIN_WITH_NCCL).
constexpr bool kHaveNccl =
#if defined(SCALETRAIN_WITH_NCCL)
    true;
#else
    false;
#endif

// The Gloo transport device. `interface` (GLOO_SOCKET_IFNAME) wins; a
// loopback master address pins Gloo to loopback; otherwise Gloo resolves this
// host's name, as torchrun does.
inline std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_addr,
                                                               const std::string& interface) {
  if (!interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  if (master_addr == "127.0.0.1" || master_addr == "localhost" || master_addr == "::1")
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

inline BackendPtr make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                            std::chrono::milliseconds timeout,
                            std::shared_ptr<::gloo::transport::Device> device) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(std::move(device));
  // Two worker threads let two buckets be in flight at once (the c10d default).
  options->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

inline BackendPtr make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                            std::chrono::milliseconds timeout) {
#if defined(SCALETRAIN_WITH_NCCL)
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  (void)store, (void)rank, (void)size, (void)timeout;
  throw std::runtime_error("this scaletrain build has no NCCL (libtorch without CUDA)");
#endif
}

// A post-hook on an autograd node (the AccumulateGrad of a parameter fires it
// after the gradient has been accumulated into .grad).
template <typename Fn>
std::unique_ptr<torch::autograd::FunctionPostHook> post_hook(Fn fn) {
  return std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [fn = std::move(fn)](const torch::autograd::variable_list& outputs,
                           const torch::autograd::variable_list& /*inputs*/) {
        fn();
        return outputs;
      });
}

}  // namespace scaletrain::comm::compat

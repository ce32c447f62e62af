#pragma once
// The raw baseline of the communication benchmarks: a c10d::ProcessGroupGloo
// built the way a c10d user would, on its own TCPStore (MASTER_PORT + 1).
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>

#include "scaletrain/comm/env.h"

namespace scaletrain::bench {

inline c10::intrusive_ptr<c10d::ProcessGroupGloo> make_raw_gloo(const comm::WorldInfo& info) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(info.master_port + 1);
  so.isServer = info.rank == 0;
  so.numWorkers = info.world_size;
  so.timeout = std::chrono::seconds(120);
  auto store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, so);
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(300));
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(info.master_addr));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world_size, opts);
}

}  // namespace scaletrain::bench

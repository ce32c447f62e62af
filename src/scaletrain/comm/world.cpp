#include "scaletrain/comm/world.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>

#include "scaletrain/comm/compat.h"
#include "scaletrain/comm/rendezvous_store.h"
#include "scaletrain/util/error.h"

namespace scaletrain::comm {

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::Auto;
  if (name == "gloo") return Backend::Gloo;
  if (name == "nccl") return Backend::Nccl;
  throw UsageError("unknown communication backend '" + name + "' (expected auto, gloo or nccl)");
}

World::World(WorldInfo info, WorldOptions options) : info_(std::move(info)), options_(std::move(options)) {}

World::~World() = default;

std::shared_ptr<World> World::init(const WorldOptions& options) { return init(world_info_from_env(), options); }

std::shared_ptr<World> World::init(const WorldInfo& info, const WorldOptions& options) {
  std::shared_ptr<World> w(new World(info, options));
  if (w->options_.interface.empty()) {
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) w->options_.interface = ifname;
  }
  switch (options.backend) {
    case Backend::Gloo: w->kind_ = BackendKind::Gloo; break;
    case Backend::Nccl:
      if (!compat::kHaveNccl || !torch::cuda::is_available())
        throw UsageError("backend nccl needs a CUDA build of scaletrain and a visible GPU");
      w->kind_ = BackendKind::Nccl;
      break;
    case Backend::Auto:
      w->kind_ = (compat::kHaveNccl && torch::cuda::is_available()) ? BackendKind::Nccl : BackendKind::Gloo;
      break;
  }
  if (info.world_size == 1) {
    w->store_ = c10::make_intrusive<c10d::HashStore>();
  } else {
    // Our own store rather than c10d::TCPStore: its 1.13 server listens on
    // every interface, ours only on MASTER_ADDR.
    RendezvousStoreOptions o;
    o.host = info.master_addr;
    o.port = static_cast<uint16_t>(info.master_port);
    o.is_server = info.rank == 0;
    o.world_size = info.world_size;
    o.connect_timeout = options.timeout;
    o.timeout = options.timeout;
    try {
      w->store_ = c10::make_intrusive<RendezvousStore>(o);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      throw CommError("rendezvous with " + info.master_addr + ":" + std::to_string(info.master_port) +
                      " failed: " + msg.substr(0, msg.find('\n')));
    }
  }
  std::vector<int> all(info.world_size);
  for (int i = 0; i < info.world_size; ++i) all[i] = i;
  w->world_ = w->new_group("world", all);
  return w;
}

std::shared_ptr<Group> World::new_group(const std::string& name, std::vector<int> ranks) {
  auto it = std::find(ranks.begin(), ranks.end(), info_.rank);
  if (it == ranks.end())
    throw std::invalid_argument("rank " + std::to_string(info_.rank) + " is not a member of group '" + name + "'");
  const int group_rank = static_cast<int>(it - ranks.begin());
  const int n = static_cast<int>(ranks.size());
  auto store = c10::make_intrusive<c10d::PrefixStore>("scaletrain/" + name, store_);
  compat::BackendPtr backend;
  try {
    if (kind_ == BackendKind::Nccl)
      backend = compat::make_nccl(store, group_rank, n, options_.timeout);
    else
      backend = compat::make_gloo(store, group_rank, n, options_.timeout,
                                  compat::gloo_device(info_.master_addr, options_.interface));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    throw CommError("creating group '" + name + "' failed: " + msg.substr(0, msg.find('\n')));
  }
  return std::make_shared<Group>(name, std::move(ranks), group_rank, kind_, std::move(backend), options_.timeout);
}

}  // namespace scaletrain::comm

#pragma once
// Joining the job: rendezvous through a store on the master address, the
// world process group, and named subgroups. Rendezvous and launching stay
// here; sharding math never sees them.
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "scaletrain/comm/env.h"
#include "scaletrain/comm/group.h"

namespace c10d {
class Store;
}

namespace scaletrain::comm {

enum class Backend { Auto, Gloo, Nccl };
Backend parse_backend(const std::string& name);  // "auto" | "gloo" | "nccl"

struct WorldOptions {
  // Auto: NCCL when this build has CUDA and a GPU is visible, else Gloo.
  Backend backend = Backend::Auto;
  // Deadline of every collective and of the rendezvous itself.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Network interface for Gloo; empty reads GLOO_SOCKET_IFNAME.
  std::string interface;
  // Debug mode: compare every collective's fingerprint across ranks before
  // it runs (Note [Which rank, which collective] in group.h).
  // SCALETRAIN_DEBUG_COLLECTIVES=1 or =0 in the environment overrides it.
  bool debug_collectives = false;
  // Shared secret of the rendezvous store; empty reads SCALETRAIN_STORE_SECRET
  // (which `scaletrain launch` sets for its workers).
  std::string store_secret;
};

class World {
 public:
  // Reads the environment (see env.h), rendezvous with the other ranks and
  // builds the world group. Blocks until every rank has joined or the timeout.
  // SIGPIPE is ignored from then on unless the program set its own
  // disposition (Note [Broken pipes] in world.cpp).
  static std::shared_ptr<World> init(const WorldOptions& options = {});
  static std::shared_ptr<World> init(const WorldInfo& info, const WorldOptions& options);
  ~World();

  const WorldInfo& info() const { return info_; }
  int rank() const { return info_.rank; }
  // The rendezvous store (other services rendezvous through it: rpc/).
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  int size() const { return info_.world_size; }
  BackendKind backend() const { return kind_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  const std::shared_ptr<Group>& group() const { return world_; }

  // A group of the given global ranks (this rank must be one of them). Only
  // members call it; `name` must be unique within the job and the same on
  // every member, as it namespaces the group's keys in the store.
  std::shared_ptr<Group> new_group(const std::string& name, std::vector<int> ranks);
  // 0, 1, 2... per `kind` on this rank: what makes the names of groups that
  // objects create (a mesh's, a sharded engine's) unique. Members create
  // those objects in the same order, so they draw the same numbers.
  int next_instance(const std::string& kind);
  bool debug_collectives() const { return options_.debug_collectives; }
  // Note [Same on every rank]: every rank posts `text` (lines "key=value")
  // under `what`; rank 0 compares every rank's with its own, the others
  // theirs with rank 0's, before any collective. A difference throws
  // UsageError on every rank, naming the rank and its first differing line
  // on both sides. Collective: every rank calls it, in the same order.
  void check_same_everywhere(const std::string& what, const std::string& text);

 private:
  class Responder;  // answers other ranks' questions about our collectives (world.cpp)
  World(WorldInfo info, WorldOptions options);
  WorldInfo info_;
  WorldOptions options_;
  BackendKind kind_ = BackendKind::Gloo;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<Group> world_;
  std::shared_ptr<Responder> responder_;  // null in a world of one
  std::mutex instances_mu_;
  std::map<std::string, int> instances_;  // next_instance()
};

}  // namespace scaletrain::comm

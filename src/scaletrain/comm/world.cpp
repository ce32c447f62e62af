#include "scaletrain/comm/world.h"

#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

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

// Note [Which rank, which collective] (group.h): a rank whose collective
// failed asks every member of the group for its record. The question is a
// store key "scaletrain/probe/K" naming the group (K from a counter); each
// process's responder thread takes the questions in order on a connection of
// its own and answers under "scaletrain/probe/K/<global rank>". A rank that
// is computing or blocked in a collective still answers; a stopped or dead
// one does not, which is itself the answer.
class World::Responder {
 public:
  using StoreSilent = CollectiveTracker::StoreSilent;
  static constexpr std::chrono::seconds kAskTimeout{3};

  Responder(RendezvousStore& store, int rank) : rank_(rank) {
    listen_ = c10::static_intrusive_pointer_cast<RendezvousStore>(store.clone());
    ask_ = c10::static_intrusive_pointer_cast<RendezvousStore>(store.clone());
    // The diagnosis has its own deadline, whatever the store does: a store
    // host that is stopped (SIGSTOP) must not cost a second full timeout.
    ask_->setTimeout(kAskTimeout);
    thread_ = std::thread([this] { run(); });
  }
  ~Responder() {
    stop_ = true;
    listen_->interrupt();
    thread_.join();
  }
  Responder(const Responder&) = delete;
  Responder& operator=(const Responder&) = delete;

  void add(const std::string& group, const std::shared_ptr<CollectiveTracker>& t) {
    std::lock_guard<std::mutex> lock(mu_);
    trackers_[group] = t;
  }

  // Every member's answer ("" for this rank and for members that did not
  // answer within a few seconds).
  // Throws StoreSilent when the store itself does not answer.
  std::vector<std::string> ask(const std::string& group, const std::vector<int>& ranks) {
    std::lock_guard<std::mutex> lock(ask_mu_);
    std::vector<std::string> out(ranks.size());
    std::string key;
    try {
      const int64_t k = ask_->add("scaletrain/probe/count", 1);
      key = "scaletrain/probe/" + std::to_string(k);
      ask_->set(key, std::vector<uint8_t>(group.begin(), group.end()));
    } catch (const std::exception& e) {
      throw StoreSilent(e.what());
    }
    const auto deadline = std::chrono::steady_clock::now() + kAskTimeout;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank_) continue;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      const std::string answer = key + "/" + std::to_string(ranks[i]);
      try {
        ask_->wait({answer}, std::max(left, std::chrono::milliseconds(1)));
        auto v = ask_->get(answer);
        out[i].assign(v.begin(), v.end());
      } catch (const std::exception&) {
        // No answer in time: the table says so.
      }
    }
    return out;
  }

 private:
  void run() {
    for (int64_t k = 1; !stop_; ++k) {
      const std::string key = "scaletrain/probe/" + std::to_string(k);
      std::string group;
      for (;;) {
        try {
          listen_->wait({key}, std::chrono::seconds(60));
          auto v = listen_->get(key);
          group.assign(v.begin(), v.end());
          break;
        } catch (const std::exception& e) {
          // A quiet minute: wait again. Anything else (stopped, the store
          // gone with rank 0) ends the thread.
          if (stop_ || std::string(e.what()).find("timed out") == std::string::npos) return;
        }
      }
      std::string answer = "not a member of group '" + group + "'";
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = trackers_.find(group);
        if (it != trackers_.end())
          if (auto t = it->second.lock()) answer = t->record();
      }
      try {
        listen_->set(key + "/" + std::to_string(rank_), std::vector<uint8_t>(answer.begin(), answer.end()));
      } catch (const std::exception&) {
        return;
      }
    }
  }

  const int rank_;
  c10::intrusive_ptr<RendezvousStore> listen_, ask_;
  std::mutex mu_, ask_mu_;
  std::map<std::string, std::weak_ptr<CollectiveTracker>> trackers_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: runs once everything above exists
};

World::World(WorldInfo info, WorldOptions options) : info_(std::move(info)), options_(std::move(options)) {}

World::~World() = default;

std::shared_ptr<World> World::init(const WorldOptions& options) { return init(world_info_from_env(), options); }

// Note [Broken pipes]: Gloo writes to its sockets with writev(), which
// raises SIGPIPE when the peer has gone, and SIGPIPE's default action ends
// the process before it can say why (a launcher then reports "killed by
// signal 13" instead of the failure). Python, and so PyTorch, ignores
// SIGPIPE from start-up; a process that joins a world here does the same,
// unless the program has chosen a disposition of its own. Writes to a closed
// socket or pipe then fail with EPIPE, which becomes an error with a message.
namespace {

// Said when the other ranks never came: where this rank's idea of the world
// came from, and for Slurm the usual cause (an sbatch script runs one task
// and sees the job's SLURM_NTASKS; srun starts the tasks).
std::string missing_ranks_hint(const WorldInfo& info) {
  std::string s = " (rank " + std::to_string(info.rank) + " of " + std::to_string(info.world_size) + ", from " +
                  info.source + " variables";
  if (info.source == "slurm")
    s += "; a command run directly in an sbatch script is one task even when SLURM_NTASKS is " +
         std::to_string(info.world_size) + ": start the ranks with srun, or with scaletrain launch";
  return s + ")";
}

void ignore_broken_pipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}
}  // namespace

std::shared_ptr<World> World::init(const WorldInfo& info, const WorldOptions& options) {
  ignore_broken_pipes();
  std::shared_ptr<World> w(new World(info, options));
  if (w->options_.interface.empty()) {
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) w->options_.interface = ifname;
  }
  if (const char* d = std::getenv("SCALETRAIN_DEBUG_COLLECTIVES")) {
    const std::string v = d;
    if (v == "1" || v == "true") w->options_.debug_collectives = true;
    if (v == "0" || v == "false") w->options_.debug_collectives = false;
  }
  if (w->options_.store_secret.empty())
    if (const char* s = std::getenv("SCALETRAIN_STORE_SECRET")) w->options_.store_secret = s;
  if (w->options_.store_secret.empty()) w->options_.store_secret = info.job_secret;  // WorldInfo::job_secret
  switch (options.backend) {
    case Backend::Gloo:
      w->kind_ = BackendKind::Gloo;
      break;
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
  } else if (info.agent_store) {
    // Note [torchrun's agent store] (env.h): the port is the agent's, so no
    // rank can serve our own store there. Without our store there is no
    // Responder: a failed collective is reported without its culprit.
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(info.master_port);
    o.isServer = false;
    o.waitWorkers = false;
    o.timeout = options.timeout;
    try {
      auto agent = c10::make_intrusive<c10d::TCPStore>(info.master_addr, o);
      w->store_ = c10::make_intrusive<c10d::PrefixStore>(
          "scaletrain/attempt_" + std::to_string(info.restart_count), agent);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      throw CommError("torchrun's agent store at " + info.master_addr + ":" + std::to_string(info.master_port) +
                      " cannot be reached: " + msg.substr(0, msg.find('\n')));
    }
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
    o.secret = w->options_.store_secret;
    // `scaletrain launch` makes a secret (one node), mpirun, srun and
    // torchrun's run id give one (WorldInfo::job_secret); under MPICH or a
    // launch across nodes without one, any client that reaches the port is
    // served: said once per job, by the rank that serves it.
    if (o.secret.empty() && o.is_server)
      std::fprintf(stderr,
                   "scaletrain: warning: SCALETRAIN_STORE_SECRET is not set, so the rendezvous store at %s:%d "
                   "accepts any client (ranks from %s); set it to one value for the whole job\n",
                   info.master_addr.c_str(), info.master_port, info.source.c_str());
    try {
      auto store = c10::make_intrusive<RendezvousStore>(o);
      w->responder_ = std::make_shared<Responder>(*store, info.rank);
      w->store_ = store;
    } catch (const std::exception& e) {
      std::string msg = e.what();
      throw CommError("rendezvous with " + info.master_addr + ":" + std::to_string(info.master_port) +
                      " failed: " + msg.substr(0, msg.find('\n')) + missing_ranks_hint(info));
    }
  }
  std::vector<int> all(info.world_size);
  for (int i = 0; i < info.world_size; ++i) all[i] = i;
  try {
    w->world_ = w->new_group("world", all);
  } catch (const std::exception& e) {
    if (info.world_size == 1) throw;
    const std::string msg = e.what();
    throw CommError("the world group of " + std::to_string(info.world_size) + " ranks could not form: " +
                    msg.substr(0, msg.find('\n')) + missing_ranks_hint(info));
  }
  return w;
}

int World::next_instance(const std::string& kind) {
  std::lock_guard<std::mutex> lock(instances_mu_);
  return instances_[kind]++;
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
  auto group = std::make_shared<Group>(name, ranks, group_rank, kind_, std::move(backend), options_.timeout);
  if (responder_ && n > 1) {
    CollectiveTracker::Options t;
    t.group = name;
    t.ranks = ranks;
    t.rank = group_rank;
    if (options_.debug_collectives)
      t.fingerprint_store = c10::make_intrusive<c10d::PrefixStore>("scaletrain/" + name + "/debug",
                                                                   static_cast<RendezvousStore&>(*store_).clone());
    else  // Note [First-of-kind check]
      t.first_store = c10::make_intrusive<c10d::PrefixStore>("scaletrain/" + name + "/first",
                                                             static_cast<RendezvousStore&>(*store_).clone());
    std::weak_ptr<Responder> weak = responder_;
    t.ask = [weak](const std::string& g, const std::vector<int>& members) {
      auto responder = weak.lock();
      return responder ? responder->ask(g, members) : std::vector<std::string>(members.size());
    };
    auto tracker = std::make_shared<CollectiveTracker>(std::move(t));
    responder_->add(name, tracker);
    group->set_tracker(std::move(tracker));
  }
  return group;
}

namespace {

// The first line where `a` and `b` differ, as "LINE_A (rank 0: LINE_B)".
std::string first_difference(const std::string& mine, const std::string& theirs, int their_rank) {
  std::istringstream a(mine), b(theirs);
  std::string la, lb;
  for (;;) {
    const bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) return "(the same lines in another order)";
    if (!ga) la = "(nothing)";
    if (!gb) lb = "(nothing)";
    if (la != lb) return la + " (rank " + std::to_string(their_rank) + ": " + lb + ")";
  }
}

}  // namespace

// Note [Same on every rank]: ranks that were started with different
// settings (one node's config edited, an override given to one rank) would
// otherwise meet first in a collective of another shape or count, and fail
// after a timeout that blames whoever serves the store. The settings travel
// through the store once, before any collective, so the error names the rank
// that differs and the setting. Every rank throws: one that differs at once
// with its own difference, the others once rank 0 has published its verdict
// (without it, ranks equal to rank 0 would go on into collectives that the
// others never join). Each call has keys of its own (next_instance), so a
// program may check several times.
void World::check_same_everywhere(const std::string& what, const std::string& text) {
  if (size() == 1) return;
  const std::string prefix = "scaletrain/same/" + what + "/" + std::to_string(next_instance("same/" + what)) + "/";
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto read = [&](const std::string& name) {
    const std::string k = prefix + name;
    store_->wait({k}, options_.timeout);
    const auto v = store_->get(k);
    return std::string(v.begin(), v.end());
  };
  store_->set(prefix + std::to_string(rank()), bytes(text));
  if (rank() != 0) {
    const std::string zero = read("0");
    if (zero != text)
      throw UsageError("rank " + std::to_string(rank()) + "'s " + what +
                       " differs from rank 0's: " + first_difference(text, zero, 0));
    const std::string verdict = read("verdict");
    if (!verdict.empty()) throw UsageError(what + " differs between ranks: " + verdict);
    return;
  }
  std::string odd;
  for (int r = 1; r < size(); ++r) {
    const std::string theirs = read(std::to_string(r));
    if (theirs != text && odd.empty())
      odd = "rank " + std::to_string(r) + ": " + first_difference(theirs, text, 0);
    else if (theirs != text)
      odd += "; rank " + std::to_string(r);
  }
  store_->set(prefix + "verdict", bytes(odd));
  if (!odd.empty()) throw UsageError(what + " differs between ranks: " + odd);
}

}  // namespace scaletrain::comm

// Process launcher: spawn the workers, relay their output, stop them all on
// the first failure, a forwarded signal or a timeout. See launcher.h.
//
// This file holds run() with its restart policy (and the elastic form,
// run_elastic()) and the public helpers of launcher.h; the signal handling
// and the start of the workers are in launcher_spawn.cpp, the supervision loop
// in launcher_supervise.cpp, their shared pieces in launcher_internal.h.
//
// Note [No process left behind]
// Three mechanisms together guarantee that no worker outlives run():
//  1. Each worker sets PR_SET_PDEATHSIG = SIGKILL before exec, so if the
//     launcher itself is killed (even by SIGKILL) the kernel kills the workers.
//  2. All workers share one process group whose leader is rank 0 of this node,
//     so one killpg() also reaches their children (`sh -c` forks, data
//     loader processes). To keep that group id from being recycled by an
//     unrelated process, the leader is observed with waitid(WNOWAIT) and only
//     reaped after the final killpg(): while it is a zombie, its pid (= the
//     group id) cannot be reused.
//  3. Every worker is reaped by waitpid() before run() returns, on every
//     path, including exceptions (Supervisor's destructor).
//  4. A launcher killed by SIGKILL runs none of the above, and mechanism 1
//     reaches only the process it started: the `sh -c` of a wrapper, not
//     the trainer that sh forked. So a process built on the library calls
//     follow_launcher() (the trainers do): a thread waits until the read end
//     of its heartbeat pipe is gone, which happens exactly when the launcher
//     (or, after a restart, the launcher's attempt) is gone, and then stops
//     the process with SIGTERM.
#include "scaletrain/launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/launch/launcher_internal.h"
#include "scaletrain/util/error.h"

namespace scaletrain::launch {
namespace {

using detail::Fd;
using detail::format_seconds;
using detail::g_pending_int;
using detail::g_pending_term;
using detail::make_pipe;
using detail::Pipe;
using detail::Placement;
using detail::SignalScope;
using detail::Stop;
using detail::Supervisor;
using detail::write_all;

std::atomic<bool> g_running{false};  // one run() per process (handlers are global)

Placement static_placement(const LaunchOptions& o) {
  return {o.node_rank * o.nproc_per_node, o.nnodes * o.nproc_per_node, o.node_rank, o.master_addr, o.master_port};
}

// Makes the one-run-per-process rule loud instead of a handler mix-up.
class RunningFlag {
 public:
  RunningFlag() {
    if (g_running.exchange(true)) throw std::logic_error("launch::run: another run() is active in this process");
  }
  ~RunningFlag() { g_running = false; }
  RunningFlag(const RunningFlag&) = delete;
  RunningFlag& operator=(const RunningFlag&) = delete;
};

// The elastic form of run(): rounds formed by opts.rendezvous (Note [Elastic
// rounds] in launch/elastic.h). Each round starts this node's workers with the
// round's placement; a failure here is reported to the other nodes and
// counted; a round ended elsewhere (a node failed, was lost, or is waiting to
// join) stops the workers without counting; success ends the job.
int run_elastic(const LaunchOptions& opts, const std::vector<std::string>& command, int wake_fd,
                const sigset_t& caller_mask) {
  const auto say = [&](const std::string& line) { write_all(opts.stderr_fd, "scaletrain launch: " + line + "\n"); };
  NodeRendezvous& rdzv = *opts.rendezvous;
  std::string reason;  // why the last round ended (SCALETRAIN_RESTART_REASON of the next)
  for (;;) {
    NodeRendezvous::Round rd;
    try {
      rd = rdzv.next_round(opts.nproc_per_node);
    } catch (const std::exception& e) {
      say(e.what());
      return 1;
    }
    say("round " + std::to_string(rd.round) + ": node " + std::to_string(rd.node_index) + " of " +
        std::to_string(rd.nodes) + ", ranks " + std::to_string(rd.first_rank) + "-" +
        std::to_string(rd.first_rank + opts.nproc_per_node - 1) + " of world size " + std::to_string(rd.world_size));
    int code = 0;
    Stop why = Stop::kNone;
    std::string failure, culprit;
    {
      Supervisor sup(opts, Placement{rd.first_rank, rd.world_size, rd.node_index, rd.master_addr, rd.master_port},
                     rd.round, reason);
      sup.spawn_all(command, caller_mask);
      code = sup.supervise(wake_fd, [&] {
        std::string w = rdzv.interrupted();
        if (!w.empty()) reason = "round " + std::to_string(rd.round) + " ended: " + w;
        return w;
      });
      why = sup.stopped_by();
      failure = sup.failure();
      culprit = sup.culprit();
    }
    if (!culprit.empty()) say("culprit: " + culprit);
    if (why == Stop::kFailure)
      reason = "round " + std::to_string(rd.round) + ": node " + std::to_string(rd.node_index) + ": " +
               failure_reason(failure, culprit, rd.first_rank, opts.nproc_per_node);
    switch (why) {
      case Stop::kNone:
        rdzv.succeeded();
        return 0;
      case Stop::kSignal:
      case Stop::kTimeout:
        rdzv.abort("node " + std::to_string(rd.node_index) + " was stopped");
        return code;
      case Stop::kRendezvous:
        continue;
      case Stop::kFailure:
        break;
    }
    if (code == 2) {  // refused input: every node would see it again
      rdzv.abort("node " + std::to_string(rd.node_index) + ": " + failure + " (refused its input)");
      return 2;
    }
    int failures = 0;
    try {
      failures = rdzv.fail_round("node " + std::to_string(rd.node_index) + ": " + failure);
    } catch (const std::exception& e) {
      say("giving up: " + std::string(e.what()) + "; this node's failure: " + failure);
      if (!culprit.empty()) say("culprit: " + culprit);
      return 1;
    }
    if (failures > opts.max_restarts) {
      std::string all;
      for (const auto& f : rdzv.failures()) all += (all.empty() ? "" : "; ") + f;
      rdzv.abort("giving up after " + std::to_string(failures - 1) + " restarts");
      say("giving up after " + std::to_string(failures - 1) + " restart" + (failures == 2 ? "" : "s") +
          "; failures: " + all);
      if (!culprit.empty()) say("culprit: " + culprit);
      return 1;
    }
    say("joining the next round (failure " + std::to_string(failures) + " of at most " +
        std::to_string(opts.max_restarts + 1) + ") after " + failure);
    if (g_pending_int.load() > 0 || g_pending_term.load() > 0) return 128 + (g_pending_int.load() > 0 ? SIGINT : SIGTERM);
  }
}

}  // namespace

void validate(const LaunchOptions& o, const std::vector<std::string>& command) {
  auto fail = [](const std::string& m) { throw UsageError("launch: " + m); };
  if (o.nproc_per_node < 1) fail("--nproc-per-node must be >= 1, got " + std::to_string(o.nproc_per_node));
  if (o.nnodes < 1) fail("--nnodes must be >= 1, got " + std::to_string(o.nnodes));
  if (o.max_nodes > 0 || o.min_nodes > 0) {
    if (o.min_nodes < 1 || o.max_nodes < o.min_nodes)
      fail("--nnodes MIN:MAX needs 1 <= MIN <= MAX, got " + std::to_string(o.min_nodes) + ":" +
           std::to_string(o.max_nodes));
    if (!o.rendezvous) fail("--nnodes MIN:MAX needs a node rendezvous");
  }
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    fail("--node-rank must be in [0, " + std::to_string(o.nnodes) + "), got " + std::to_string(o.node_rank));
  if (static_cast<long long>(o.nnodes) * o.nproc_per_node > INT_MAX) fail("--nnodes * --nproc-per-node is too large");
  if (o.master_addr.empty()) fail("--master-addr must not be empty");
  if (o.master_port < 1 || o.master_port > 65535)
    fail("--master-port must be in [1, 65535], got " + std::to_string(o.master_port));
  if (o.max_nodes > 0 && o.master_port == 65535)
    fail("--master-port must be below 65535 for an elastic job (the workers' store uses the next port)");
  if (o.threads < 0) fail("--threads must be >= 0 (0 = auto), got " + std::to_string(o.threads));
  if (!(o.timeout_s >= 0)) fail("--timeout must be >= 0 seconds (0 = none), got " + format_seconds(o.timeout_s));
  if (!(o.grace_s >= 0)) fail("grace period must be >= 0 seconds, got " + format_seconds(o.grace_s));
  if (o.max_restarts < 0) fail("--max-restarts must be >= 0, got " + std::to_string(o.max_restarts));
  if (!(o.heartbeat_timeout_s >= 0) || !std::isfinite(o.heartbeat_timeout_s))
    fail("--heartbeat-timeout must be >= 0 seconds (0 = off), got " + format_seconds(o.heartbeat_timeout_s));
  if (o.max_restarts > 0 && o.nnodes > 1 && o.max_nodes == 0)
    fail("--max-restarts with --nnodes " + std::to_string(o.nnodes) +
         " needs the nodes' launchers to agree on each restart: give --nnodes as MIN:MAX (elastic), e.g. " +
         std::to_string(o.nnodes) + ":" + std::to_string(o.nnodes));
  if (command.empty() || command[0].empty()) fail("no worker command given (put it after --)");
}

namespace {
// The write end of this worker's heartbeat pipe, or -1 outside the launcher.
int heartbeat_fd() {
  static const int fd = [] {
    const char* v = std::getenv("SCALETRAIN_HEARTBEAT_FD");
    if (!v) return -1;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 0 || n > INT_MAX || ::fcntl(static_cast<int>(n), F_GETFD) < 0) return -1;
    return static_cast<int>(n);
  }();
  return fd;
}
}  // namespace

void heartbeat() {
  const int fd = heartbeat_fd();
  if (fd < 0) return;
  const char byte = 1;
  // Non-blocking: a full pipe already holds beats the launcher has not read.
  ssize_t ignored = ::write(fd, &byte, 1);
  (void)ignored;
}

// Note [No process left behind], mechanism 4: the kernel reports
// POLLERR on a pipe's write end once no process holds its read end, which
// only the launcher ever held. No clock is involved.
void follow_launcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int fd = heartbeat_fd();
    if (fd < 0) return;
    std::thread([fd] {
      pollfd p{fd, 0, 0};
      for (;;) {
        const int ready = ::poll(&p, 1, -1);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0 || (p.revents & POLLNVAL)) return;  // nothing to watch: mechanisms 1-3 remain
        if (p.revents & (POLLERR | POLLHUP)) break;
      }
      static const char line[] = "scaletrain: the launcher that started this worker is gone; stopping\n";
      ssize_t ignored = ::write(STDERR_FILENO, line, sizeof line - 1);
      (void)ignored;
      ::kill(::getpid(), SIGTERM);
    }).detach();
  });
}

namespace {
// 32 random bytes as hex, for the workers' store secret.
std::string random_secret() {
  unsigned char raw[32];
  Fd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (!fd.valid() || ::read(fd.get(), raw, sizeof raw) != static_cast<ssize_t>(sizeof raw))
    throw std::runtime_error("launch: cannot read /dev/urandom for the store secret");
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (unsigned char c : raw) {
    s += kHex[c >> 4];
    s += kHex[c & 15];
  }
  return s;
}
}  // namespace

int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

int resolve_threads(const LaunchOptions& o, const char* omp_env) {
  if (o.threads > 0) return o.threads;
  if (omp_env) {
    // OMP_NUM_THREADS may be a nested list ("4,2"): its first level is the
    // intra-op count.
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(omp_env, &end, 10);
    if (end != omp_env && errno == 0 && v > 0 && v <= INT_MAX) return static_cast<int>(v);
  }
  return std::max(1, usable_cores() / std::max(1, o.nproc_per_node));
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("launch: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) throw std::runtime_error(std::string("launch: cannot find a free port: ") + std::strerror(err));
  return ntohs(a.sin_port);
}

std::string failure_reason(const std::string& failure, const std::string& culprit, int first_rank, int nproc) {
  int rank = -1;
  if (std::sscanf(culprit.c_str(), "rank %d", &rank) != 1 || (rank >= first_rank && rank < first_rank + nproc))
    return failure;
  return "rank " + std::to_string(rank) + " of another node stopped answering (culprit: " + culprit +
         "); then here: " + failure;
}

int run(const LaunchOptions& opts, const std::vector<std::string>& command) {
  validate(opts, command);
  if (!opts.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(opts.log_dir, ec);
    if (ec) throw UsageError("launch: cannot create --log-dir " + opts.log_dir + ": " + ec.message());
  }
  RunningFlag running;
  const auto say = [&](const std::string& line) { write_all(opts.stderr_fd, "scaletrain launch: " + line + "\n"); };
  // The workers' rendezvous store accepts only clients that know the secret
  // (Note [Rendezvous wire protocol]). One node: a fresh one per run. Several
  // nodes must share it, so it comes from the environment of every launcher.
  if (!std::getenv("SCALETRAIN_STORE_SECRET")) {
    if (opts.nnodes == 1 && opts.max_nodes == 0)
      ::setenv("SCALETRAIN_STORE_SECRET", random_secret().c_str(), 1);
    else
      say("warning: SCALETRAIN_STORE_SECRET is not set, so the rendezvous store accepts any client; "
          "set it to the same value on every node");
  }
  Pipe wake = make_pipe(O_NONBLOCK);
  SignalScope signals(wake.write.get());
  if (opts.max_nodes > 0) return run_elastic(opts, command, wake.read.get(), signals.caller_mask());
  std::vector<std::string> failures;  // "attempt 0: rank 1 exited with code 3", ...
  for (int attempt = 0;; ++attempt) {
    int code = 0;
    std::string failure, culprit;
    {
      // Destroyed before `signals`: workers are reaped while SIGCHLD is still ours.
      Supervisor sup(opts, static_placement(opts), attempt, failures.empty() ? "" : failures.back());
      sup.spawn_all(command, signals.caller_mask());
      code = sup.supervise(wake.read.get());
      if (sup.stopped_by() != Stop::kFailure) return code;  // success, a signal or the timeout
      failure = sup.failure();
      culprit = sup.culprit();
    }
    failures.push_back("attempt " + std::to_string(attempt) + ": " +
                       failure_reason(failure, culprit, static_placement(opts).first_rank, opts.nproc_per_node));
    std::string all;
    for (const auto& f : failures) all += (all.empty() ? "" : "; ") + f;
    // The last line names the rank that caused a failed collective, if one did.
    const auto last_word = [&] {
      if (!culprit.empty()) say("culprit: " + culprit);
    };
    if (code == 2) {  // a usage error: the same input would be refused again
      if (opts.max_restarts > 0) say("not restarting: a rank refused its input (exit 2); failures: " + all);
      last_word();
      return code;
    }
    if (attempt >= opts.max_restarts) {
      if (opts.max_restarts > 0)
        say("giving up after " + std::to_string(attempt) + " restart" + (attempt == 1 ? "" : "s") + "; failures: " + all);
      last_word();
      return code;
    }
    if (!culprit.empty()) say("culprit of attempt " + std::to_string(attempt) + ": " + culprit);
    say("restarting all " + std::to_string(opts.nproc_per_node) + " workers (restart " + std::to_string(attempt + 1) +
        " of " + std::to_string(opts.max_restarts) + ") after " + failure);
    // Signals that arrived while the group was going down stop the job here.
    if (g_pending_int.load() > 0 || g_pending_term.load() > 0) return 128 + (g_pending_int.load() > 0 ? SIGINT : SIGTERM);
  }
}

}  // namespace scaletrain::launch

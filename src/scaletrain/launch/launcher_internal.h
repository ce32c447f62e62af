#pragma once
// Internal to launch/'s process launcher (launcher.h): the pieces its files
// share. launcher.cpp holds run() with its restart policy and the public
// helpers; launcher_spawn.cpp the signal handling and the starting of the
// workers (command lookup, environment contract, fork/exec);
// launcher_supervise.cpp the supervision loop and the relay of the workers'
// output. Not an API: everything here is in launch::detail. Torch-free, like
// the rest of launch/.
#include "scaletrain/launch/launcher.h"

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <functional>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace scaletrain::launch::detail {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- handles

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Both ends of a pipe, close-on-exec so workers only inherit what they dup2.
struct Pipe {
  Fd read, write;
};

Pipe make_pipe(int extra_flags = 0);

// Writes all of `data`; false if the descriptor is broken (then we stop
// trying: a closed console must not stop the supervision).
bool write_all(int fd, const std::string& data);

// ---------------------------------------------------------------- signals

// State shared with the async signal handler (launcher_spawn.cpp): lock-free
// atomics only.
extern std::atomic<int> g_pending_int;   // SIGINTs not yet handled by the loop
extern std::atomic<int> g_pending_term;  // SIGTERMs not yet handled by the loop

inline constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

// Installs on_signal for SIGINT/SIGTERM/SIGCHLD and unblocks them in this
// thread for its lifetime; restores the previous handlers and mask after.
// Installing our own SIGCHLD handler also undoes a caller's SIG_IGN, which
// would otherwise make the kernel reap workers before we read their status.
class SignalScope {
 public:
  explicit SignalScope(int wake_fd);
  ~SignalScope();
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  // The mask the caller had; workers get it back before exec.
  const sigset_t& caller_mask() const { return old_mask_; }

 private:
  struct sigaction old_[std::size(kHandledSignals)]{};
  sigset_t old_mask_{};
};

const char* signal_name(int sig);

std::string format_seconds(double s);

// ---------------------------------------------------------------- spawning

// Where this node's workers sit in the job: fixed by the options, or by the
// round of an elastic job.
struct Placement {
  int first_rank = 0, world_size = 1, group_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

// Everything one exec needs, prepared before fork(): between fork and exec
// the child may only call async-signal-safe functions (no malloc).
struct ExecPlan {
  std::string path;
  std::vector<std::string> args, env;
  std::vector<char*> argv, envp;
  std::string quoted_path;
  void seal() {
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    quoted_path = " '" + path + "'";
  }
};

// ---------------------------------------------------------------- output

// One of a worker's two output pipes, with its unfinished last line.
struct Stream {
  Fd fd;
  bool is_err = false;
  std::string partial;
};

struct Worker {
  int rank = 0;  // global rank: the "[rank N]" prefix and the log name
  pid_t pid = -1;
  Stream out, err;
  Fd log;
  Fd heartbeat;          // read end of the worker's heartbeat pipe
  bool beating = false;  // a first beat came: the watchdog is armed
  Clock::time_point last_beat{};
  bool exited = false;  // status observed (waitid WNOWAIT)
  bool reaped = false;  // waitpid done: the pid may be recycled from now on
  siginfo_t status{};
};

// ---------------------------------------------------------------- supervisor

// kRendezvous: an elastic round ended elsewhere (Note [Elastic rounds]).
enum class Stop { kNone, kFailure, kSignal, kTimeout, kRendezvous };

// Owns the workers for one run(); see Note [No process left behind] in
// launcher.cpp. Spawning is in launcher_spawn.cpp, the rest in
// launcher_supervise.cpp.
class Supervisor {
 public:
  // `reason`: why this attempt follows another (SCALETRAIN_RESTART_REASON).
  Supervisor(const LaunchOptions& o, Placement at, int attempt, std::string reason = "")
      : o_(o), at_(std::move(at)), attempt_(attempt), reason_(std::move(reason)) {}
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  // On an exception, nothing may survive: kill the group and reap blocking.
  ~Supervisor();

  void spawn_all(const std::vector<std::string>& command, const sigset_t& caller_mask);
  // `interrupted` (elastic jobs) is polled about twice a second; a non-empty
  // answer stops the workers with Stop::kRendezvous.
  int supervise(int wake_fd, const std::function<std::string()>& interrupted = {});
  // Why the job stopped, and the first failure ("rank 1 exited with code 3").
  Stop stopped_by() const { return stop_; }
  const std::string& failure() const { return failure_; }
  // The first "culprit: rank N ..." line a worker wrote, and who wrote it.
  const std::string& culprit() const { return culprit_; }

 private:
  // The clocks of one supervise() call, and what poll() waits on.
  struct Loop;
  struct PollSet;

  void spawn(int local_rank, ExecPlan& plan, const sigset_t& caller_mask);
  void kill_all(int sig);
  void observe_exits();
  void begin_stop(Stop why, int signo);
  void handle_signal(int sig);
  void read_stream(Worker& w, Stream& s);
  void read_heartbeat(Worker& w);
  void check_heartbeats(Clock::time_point now);
  void emit(Worker& w, const Stream& s, const std::string& text);
  void say(const std::string& line) { write_all(o_.stderr_fd, "scaletrain launch: " + line + "\n"); }
  // The pieces of supervise().
  Clock::time_point step(Loop& l, const std::function<std::string()>& interrupted);
  PollSet poll_set(int wake_fd, bool all_exited);
  std::chrono::milliseconds poll_wait(const Loop& l, Clock::time_point now,
                                      const std::function<std::string()>& interrupted) const;
  void dispatch(const PollSet& p, int wake_fd);
  int finish();

  const LaunchOptions& o_;
  const Placement at_;
  const int attempt_;
  const std::string reason_;
  std::string failure_;
  std::string culprit_;
  std::vector<Worker> workers_;
  Fd devnull_;
  pid_t pgid_ = 0;  // rank 0's pid once spawned
  Stop stop_ = Stop::kNone;
  int stop_signal_ = 0;
  int failure_code_ = 1;  // exit code for Stop::kFailure: 2 when the first failing rank exited 2
  bool term_sent_ = false, kill_sent_ = false;
  Clock::time_point kill_at_{};
  bool out_ok_ = true, err_ok_ = true;
};

}  // namespace scaletrain::launch::detail

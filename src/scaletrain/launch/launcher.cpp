// Process launcher: spawn the workers, relay their output, stop them all on
// the first failure, a forwarded signal or a timeout. See launcher.h.
//
// Longer than 600 lines (issue 35): supervision, elastic rounds and the CLI
// glue share this file; those are its seams.
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
#include "scaletrain/launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "scaletrain/util/error.h"

extern char** environ;

namespace scaletrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

// A line longer than this without a newline (a progress bar redrawn with
// '\r', binary junk) is printed in pieces so memory stays bounded.
constexpr size_t kMaxLine = 64 * 1024;
// After the last worker has exited, how long we keep reading pipes still held
// open by processes that escaped the process group (setsid daemons).
constexpr double kDrainSeconds = 1.0;
// Upper bound on one poll() sleep; SIGCHLD normally wakes us much earlier,
// this only matters if the caller's threads all block SIGCHLD.
constexpr int kMaxPollMs = 200;
// Exit code of a child that failed between fork and exec (like posix_spawn).
constexpr int kExecFailedCode = 127;

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

Pipe make_pipe(int extra_flags = 0) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC | extra_flags) != 0)
    throw std::runtime_error(std::string("launch: pipe2 failed: ") + std::strerror(errno));
  return Pipe{Fd(p[0]), Fd(p[1])};
}

// Writes all of `data`; false if the descriptor is broken (then we stop
// trying: a closed console must not stop the supervision).
bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// ---------------------------------------------------------------- signals

// State shared with the async signal handler: lock-free atomics only.
std::atomic<int> g_wake_fd{-1};      // write end of the self-pipe
std::atomic<int> g_pending_int{0};   // SIGINTs not yet handled by the loop
std::atomic<int> g_pending_term{0};  // SIGTERMs not yet handled by the loop
std::atomic<bool> g_running{false};  // one run() per process (handlers are global)

extern "C" void on_signal(int sig) {
  const int saved_errno = errno;
  if (sig == SIGINT) g_pending_int.fetch_add(1);
  if (sig == SIGTERM) g_pending_term.fetch_add(1);
  // SIGCHLD only needs the wake-up. The pipe is non-blocking: if it is full a
  // wake-up is already pending and the counters above carry the signal.
  const int fd = g_wake_fd.load();
  if (fd >= 0) {
    const char byte = 0;
    ssize_t ignored = ::write(fd, &byte, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

// Installs on_signal for SIGINT/SIGTERM/SIGCHLD and unblocks them in this
// thread for its lifetime; restores the previous handlers and mask after.
// Installing our own SIGCHLD handler also undoes a caller's SIG_IGN, which
// would otherwise make the kernel reap workers before we read their status.
class SignalScope {
 public:
  explicit SignalScope(int wake_fd) {
    g_pending_int = 0;
    g_pending_term = 0;
    g_wake_fd = wake_fd;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(kHandledSignals); ++i)
      ::sigaction(kHandledSignals[i], &sa, &old_[i]);
    sigset_t ours;
    sigemptyset(&ours);
    for (int s : kHandledSignals) sigaddset(&ours, s);
    ::pthread_sigmask(SIG_UNBLOCK, &ours, &old_mask_);
  }
  ~SignalScope() {
    for (size_t i = 0; i < std::size(kHandledSignals); ++i)
      ::sigaction(kHandledSignals[i], &old_[i], nullptr);
    ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    g_wake_fd = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  // The mask the caller had; workers get it back before exec.
  const sigset_t& caller_mask() const { return old_mask_; }

 private:
  struct sigaction old_[std::size(kHandledSignals)] {};
  sigset_t old_mask_{};
};

const char* signal_name(int sig) {
  static const std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},   {SIGTRAP, "SIGTRAP"},
      {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"},
      {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"}, {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},
      {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},
  };
  for (const auto& [num, name] : kNames)
    if (num == sig) return name;
  return "unknown signal";
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

// ---------------------------------------------------------------- spawning

// command[0] resolved the way execvp would, but in the launcher, so that a
// typo is one UsageError instead of N failing workers.
std::string resolve_executable(const std::string& name) {
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (!executable(name)) throw UsageError("launch: cannot execute '" + name + "'");
    return name;
  }
  const char* path_env = std::getenv("PATH");
  const std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  size_t begin = 0;
  while (begin <= path.size()) {
    size_t end = path.find(':', begin);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(begin, end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (executable(candidate)) return candidate;
    begin = end + 1;
  }
  throw UsageError("launch: command not found: '" + name + "'");
}

// The variables of the environment contract, in the order they are set.
constexpr const char* kContractVars[] = {
    "RANK",        "LOCAL_RANK",  "WORLD_SIZE",      "LOCAL_WORLD_SIZE",   "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "SCALETRAIN_THREADS", "SCALETRAIN_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "SCALETRAIN_HEARTBEAT_FD", "SCALETRAIN_RESTART_REASON",
};

// Where this node's workers sit in the job: fixed by the options, or by the
// round of an elastic job.
struct Placement {
  int first_rank = 0, world_size = 1, group_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

Placement static_placement(const LaunchOptions& o) {
  return {o.node_rank * o.nproc_per_node, o.nnodes * o.nproc_per_node, o.node_rank, o.master_addr, o.master_port};
}

// The launcher's environment with the contract variables replaced, for
// attempt `attempt` (0: the first start), started again because of `reason`.
std::vector<std::string> worker_environment(const LaunchOptions& o, const Placement& at, int local_rank, int attempt,
                                            const std::string& reason) {
  const char* omp_env = std::getenv("OMP_NUM_THREADS");
  const int threads = resolve_threads(o, omp_env);
  // An inherited OMP_NUM_THREADS is passed through verbatim (it may be a
  // nested list such as "4,2"); only an explicit --threads replaces it.
  const std::string omp = (o.threads == 0 && omp_env) ? omp_env : std::to_string(threads);
  const std::string values[] = {
      std::to_string(at.first_rank + local_rank),
      std::to_string(local_rank),
      std::to_string(at.world_size),
      std::to_string(o.nproc_per_node),
      std::to_string(at.group_rank),
      at.master_addr,
      std::to_string(at.master_port),
      omp,
      std::to_string(threads),
      std::to_string(attempt),
      std::to_string(attempt),
      std::to_string(o.max_restarts),
      "",  // SCALETRAIN_HEARTBEAT_FD: set in spawn(), once the pipe exists
      attempt > 0 ? reason : "",
  };
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    const std::string key = entry.substr(0, entry.find('='));
    const bool ours = std::any_of(std::begin(kContractVars), std::end(kContractVars),
                                  [&](const char* v) { return key == v; });
    if (!ours) env.push_back(entry);
  }
  for (size_t i = 0; i < std::size(kContractVars); ++i)
    if (!values[i].empty()) env.push_back(std::string(kContractVars[i]) + "=" + values[i]);
  return env;
}

// Async-signal-safe report of a failure between fork and exec, on the
// worker's stderr pipe (so it comes out prefixed with the rank).
[[noreturn]] void child_fail(const char* what, const std::string& path_msg) {
  const int err = errno;
  const char* desc =
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
      strerrordesc_np(err);  // static table: no locale, no malloc
#else
      nullptr;
#endif
  auto put = [](const char* s) {
    ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
    (void)ignored;
  };
  put("scaletrain launch: ");
  put(what);
  put(path_msg.c_str());  // formatted before fork; c_str() does not allocate
  put(": ");
  put(desc ? desc : "error");
  put("\n");
  ::_exit(kExecFailedCode);
}

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

// Owns the workers for one run(); see Note [No process left behind].
class Supervisor {
 public:
  // `reason`: why this attempt follows another (SCALETRAIN_RESTART_REASON).
  Supervisor(const LaunchOptions& o, Placement at, int attempt, std::string reason = "")
      : o_(o), at_(std::move(at)), attempt_(attempt), reason_(std::move(reason)) {}
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;
  // On an exception, nothing may survive: kill the group and reap blocking.
  ~Supervisor() {
    kill_all(SIGKILL);
    for (auto& w : workers_)
      if (!w.reaped && w.pid > 0) ::waitpid(w.pid, nullptr, 0);
  }

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

void Supervisor::spawn_all(const std::vector<std::string>& command, const sigset_t& caller_mask) {
  // Workers read /dev/null: they sit in a background process group, and a
  // background read from the terminal would stop them with SIGTTIN.
  devnull_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!devnull_.valid()) throw std::runtime_error("launch: cannot open /dev/null");
  const std::string path = resolve_executable(command[0]);
  workers_.reserve(o_.nproc_per_node);
  for (int lr = 0; lr < o_.nproc_per_node; ++lr) {
    ExecPlan plan;
    plan.path = path;
    plan.args = command;
    plan.env = worker_environment(o_, at_, lr, attempt_, reason_);
    spawn(lr, plan, caller_mask);
  }
}

void Supervisor::spawn(int local_rank, ExecPlan& plan, const sigset_t& caller_mask) {
  Worker& w = workers_.emplace_back();
  w.rank = at_.first_rank + local_rank;
  Pipe out = make_pipe(), err = make_pipe();
  // Non-blocking on both ends: a worker's beat never waits on us, and we
  // drain without blocking. The child keeps the write end across exec.
  Pipe beat = make_pipe(O_NONBLOCK);
  plan.env.push_back("SCALETRAIN_HEARTBEAT_FD=" + std::to_string(beat.write.get()));
  plan.seal();
  if (!o_.log_dir.empty()) {
    const std::string name = o_.log_dir + "/rank" + std::to_string(w.rank) + ".log";
    const int keep = attempt_ > 0 ? O_APPEND : O_TRUNC;  // a restart adds to the first attempt's log
    w.log = Fd(::open(name.c_str(), O_WRONLY | O_CREAT | keep | O_CLOEXEC, 0644));
    if (!w.log.valid()) throw UsageError("launch: cannot write log file " + name + ": " + std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  const pid_t group = pgid_;  // 0 for the first worker: it becomes the leader

  // Block every signal across fork so our handlers cannot run in the child
  // (they would write to the launcher's self-pipe) before it resets them.
  sigset_t all, before;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  const pid_t pid = ::fork();
  if (pid == 0) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    for (int s : kHandledSignals) ::sigaction(s, &dfl, nullptr);
    // Die with the launcher; if it already died, the re-parenting happened
    // before prctl could arm the signal, so check and leave.
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) child_fail("prctl failed for", plan.quoted_path);
    if (::getppid() != parent) ::_exit(kExecFailedCode);
    if (::setpgid(0, group) != 0) child_fail("setpgid failed for", plan.quoted_path);
    if (::dup2(devnull_.get(), STDIN_FILENO) < 0 || ::dup2(out.write.get(), STDOUT_FILENO) < 0 ||
        ::dup2(err.write.get(), STDERR_FILENO) < 0 || ::fcntl(beat.write.get(), F_SETFD, 0) != 0)
      ::_exit(kExecFailedCode);
    ::pthread_sigmask(SIG_SETMASK, &caller_mask, nullptr);
    ::execve(plan.path.c_str(), plan.argv.data(), plan.envp.data());
    child_fail("cannot execute", plan.quoted_path);
  }
  const int fork_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  if (pid < 0) {
    workers_.pop_back();
    throw std::runtime_error(std::string("launch: fork failed: ") + std::strerror(fork_errno));
  }
  w.pid = pid;
  // Also set the group from the parent, so it is in place before we could
  // signal it (whichever of the two calls runs first wins; the other fails
  // harmlessly, e.g. with EACCES after exec).
  ::setpgid(pid, group == 0 ? pid : group);
  if (pgid_ == 0) pgid_ = pid;
  w.out.fd = std::move(out.read);
  w.err.fd = std::move(err.read);
  w.err.is_err = true;
  w.heartbeat = std::move(beat.read);
}

void Supervisor::read_heartbeat(Worker& w) {
  char buf[256];
  ssize_t n;
  bool beat = false;
  while ((n = ::read(w.heartbeat.get(), buf, sizeof buf)) > 0) beat = true;
  if (beat) {
    w.beating = true;
    w.last_beat = Clock::now();
  }
  if (n == 0) w.heartbeat.reset();  // the worker (and its children) closed it
}

// Kills a worker whose heartbeat stopped (LaunchOptions::heartbeat_timeout_s).
void Supervisor::check_heartbeats(Clock::time_point now) {
  if (o_.heartbeat_timeout_s <= 0 || stop_ != Stop::kNone) return;
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.heartbeat_timeout_s));
  for (auto& w : workers_) {
    if (!w.beating || w.exited || now - w.last_beat < limit) continue;
    failure_ = "rank " + std::to_string(w.rank) + " sent no heartbeat for " + format_seconds(o_.heartbeat_timeout_s) +
               " s (stopped, or stuck in a step); killed it";
    say(failure_);
    ::kill(w.pid, SIGKILL);
    failure_code_ = 1;
    begin_stop(Stop::kFailure, 0);
    return;
  }
}

void Supervisor::kill_all(int sig) {
  // The group id is only ours while its leader (rank 0 here) is unreaped.
  // A stopped worker (SIGSTOP) keeps a SIGTERM pending until it runs again:
  // SIGCONT lets it act on it now instead of at the grace period's SIGKILL.
  const bool wake = sig != SIGKILL && sig != SIGCONT;
  if (pgid_ > 0 && !workers_.front().reaped) {
    ::killpg(pgid_, sig);
    if (wake) ::killpg(pgid_, SIGCONT);
  }
  // Also by pid, in case a worker left the group (setsid). Only unreaped
  // pids: a reaped one may already belong to someone else.
  for (auto& w : workers_)
    if (w.pid > 0 && !w.reaped && !w.exited) {
      ::kill(w.pid, sig);
      if (wake) ::kill(w.pid, SIGCONT);
    }
}

void Supervisor::observe_exits() {
  for (auto& w : workers_) {
    if (w.exited) continue;
    siginfo_t info{};
    // WNOWAIT: read the status but leave the zombie; see Note [No process left behind].
    if (::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0) continue;
    if (info.si_pid == 0) continue;  // still running
    w.exited = true;
    w.status = info;
    if (w.pid != pgid_) {
      ::waitpid(w.pid, nullptr, 0);
      w.reaped = true;
    }
    const bool ok = info.si_code == CLD_EXITED && info.si_status == 0;
    if (!ok && stop_ == Stop::kNone) {
      if (info.si_code == CLD_EXITED)
        failure_ = "rank " + std::to_string(w.rank) + " exited with code " + std::to_string(info.si_status);
      else
        failure_ = "rank " + std::to_string(w.rank) + " was killed by signal " + std::to_string(info.si_status) +
                   " (" + signal_name(info.si_status) + ")";
      say(failure_);
      // A rank that exits 2 refused bad input (a usage error, reported in
      // its one line): the job exits 2 as one process would; other failures 1.
      failure_code_ = info.si_code == CLD_EXITED && info.si_status == 2 ? 2 : 1;
      begin_stop(Stop::kFailure, 0);
    }
  }
}

// Stops the job gracefully: SIGTERM (or the forwarded signal) now, SIGKILL
// after grace_s. Only the first reason counts.
void Supervisor::begin_stop(Stop why, int signo) {
  if (stop_ != Stop::kNone) return;
  stop_ = why;
  stop_signal_ = signo;
  kill_all(why == Stop::kSignal ? signo : SIGTERM);
  term_sent_ = true;
  kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.grace_s));
}

void Supervisor::handle_signal(int sig) {
  if (stop_ == Stop::kNone) {
    say(std::string("received ") + signal_name(sig) + ", stopping workers");
    begin_stop(Stop::kSignal, sig);
  } else if (!kill_sent_) {
    // A second Ctrl-C means "now": do not wait out the grace period.
    say(std::string("received ") + signal_name(sig) + " again, killing workers");
    kill_all(SIGKILL);
    kill_sent_ = true;
  }
}

void Supervisor::emit(Worker& w, const Stream& s, const std::string& text) {
  // A worker whose collective failed names the rank that caused it.
  static const std::string kCulprit = "culprit: rank ";
  if (culprit_.empty() && text.compare(0, kCulprit.size(), kCulprit) == 0) {
    culprit_ = text.substr(std::string("culprit: ").size());
    while (!culprit_.empty() && (culprit_.back() == '\n' || culprit_.back() == '\r')) culprit_.pop_back();
    culprit_ += " (reported by rank " + std::to_string(w.rank) + ")";
  }
  // One write() per line keeps a line whole even if others share the fd.
  bool& ok = s.is_err ? err_ok_ : out_ok_;
  if (ok) ok = write_all(s.is_err ? o_.stderr_fd : o_.stdout_fd, "[rank " + std::to_string(w.rank) + "] " + text);
  if (w.log.valid() && !write_all(w.log.get(), text)) w.log.reset();
}

void Supervisor::read_stream(Worker& w, Stream& s) {
  char buf[16384];
  const ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) {  // EOF (or a broken pipe): flush the unfinished line
    if (!s.partial.empty()) emit(w, s, s.partial + "\n");
    s.partial.clear();
    s.fd.reset();
    return;
  }
  s.partial.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    emit(w, s, s.partial.substr(start, nl + 1 - start));
  s.partial.erase(0, start);
  while (s.partial.size() >= kMaxLine) {
    emit(w, s, s.partial.substr(0, kMaxLine) + "\n");
    s.partial.erase(0, kMaxLine);
  }
}

int Supervisor::supervise(int wake_fd, const std::function<std::string()>& interrupted) {
  using std::chrono::duration;
  const Clock::time_point start = Clock::now();
  const bool has_timeout = o_.timeout_s > 0;
  const Clock::time_point deadline =
      start + std::chrono::duration_cast<Clock::duration>(duration<double>(has_timeout ? o_.timeout_s : 0));
  bool all_exited = false;
  Clock::time_point drain_until{};
  Clock::time_point next_poll = start;

  for (;;) {
    for (int n = g_pending_int.exchange(0); n > 0; --n) handle_signal(SIGINT);
    for (int n = g_pending_term.exchange(0); n > 0; --n) handle_signal(SIGTERM);
    observe_exits();
    const Clock::time_point now = Clock::now();
    check_heartbeats(now);
    if (interrupted && stop_ == Stop::kNone && now >= next_poll) {
      next_poll = now + std::chrono::milliseconds(500);
      const std::string why = interrupted();
      if (!why.empty()) {
        say("stopping the workers: " + why);
        begin_stop(Stop::kRendezvous, 0);
      }
    }
    if (has_timeout && stop_ == Stop::kNone && now >= deadline) {
      say("timed out after " + format_seconds(o_.timeout_s) + " s");
      begin_stop(Stop::kTimeout, 0);
    }
    if (term_sent_ && !kill_sent_ && now >= kill_at_) {
      kill_all(SIGKILL);
      kill_sent_ = true;
    }
    if (!all_exited && std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.exited; })) {
      all_exited = true;
      // The leader is still a zombie, so pgid_ is still ours: sweep up any
      // children the workers left behind, which also closes their pipes.
      ::killpg(pgid_, SIGKILL);
      drain_until = now + std::chrono::duration_cast<Clock::duration>(duration<double>(kDrainSeconds));
    }

    std::vector<pollfd> fds{{wake_fd, POLLIN, 0}};
    std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
    for (auto& w : workers_)
      for (Stream* s : {&w.out, &w.err})
        if (s->fd.valid()) {
          fds.push_back({s->fd.get(), POLLIN, 0});
          owners.emplace_back(&w, s);
        }
    if (all_exited && (fds.size() == 1 || now >= drain_until)) break;
    const size_t n_streams = fds.size();
    for (auto& w : workers_)
      if (w.heartbeat.valid() && !all_exited) {
        fds.push_back({w.heartbeat.get(), POLLIN, 0});
        owners.emplace_back(&w, nullptr);
      }

    // Sleep until output, a signal (SIGCHLD included), or the next deadline.
    auto wait = std::chrono::milliseconds(kMaxPollMs);
    auto until = [&](Clock::time_point t) {
      wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(std::max(t - now, Clock::duration::zero())));
    };
    if (has_timeout && stop_ == Stop::kNone) until(deadline);
    if (term_sent_ && !kill_sent_) until(kill_at_);
    if (all_exited) until(drain_until);
    if (interrupted && stop_ == Stop::kNone) until(next_poll);
    if (o_.heartbeat_timeout_s > 0 && stop_ == Stop::kNone)
      for (auto& w : workers_)
        if (w.beating && !w.exited)
          until(w.last_beat + std::chrono::duration_cast<Clock::duration>(duration<double>(o_.heartbeat_timeout_s)));
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
    if (ready < 0 && errno != EINTR) throw std::runtime_error(std::string("launch: poll failed: ") + std::strerror(errno));
    if (ready <= 0) continue;
    if (fds[0].revents) {
      char sink[256];
      while (::read(wake_fd, sink, sizeof sink) > 0) {
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      if (i < n_streams)
        read_stream(*owners[i].first, *owners[i].second);
      else
        read_heartbeat(*owners[i].first);
    }
  }

  // Flush what processes outside the group may still have left unterminated.
  for (auto& w : workers_)
    for (Stream* s : {&w.out, &w.err}) {
      if (!s->partial.empty()) emit(w, *s, s->partial + "\n");
      s->partial.clear();
      s->fd.reset();
    }
  for (auto& w : workers_)
    if (!w.reaped) {
      ::waitpid(w.pid, nullptr, 0);
      w.reaped = true;
    }

  switch (stop_) {
    case Stop::kNone: return 0;
    case Stop::kFailure: return failure_code_;
    case Stop::kSignal: return 128 + stop_signal_;
    case Stop::kTimeout: return kTimeoutExitCode;
    case Stop::kRendezvous: return 0;
  }
  return 1;
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
      reason = "round " + std::to_string(rd.round) + ": node " + std::to_string(rd.node_index) + ": " + failure;
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

void heartbeat() {
  static const int fd = [] {
    const char* v = std::getenv("SCALETRAIN_HEARTBEAT_FD");
    if (!v) return -1;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 0 || n > INT_MAX || ::fcntl(static_cast<int>(n), F_GETFD) < 0) return -1;
    return static_cast<int>(n);
  }();
  if (fd < 0) return;
  const char byte = 1;
  // Non-blocking: a full pipe already holds beats the launcher has not read.
  ssize_t ignored = ::write(fd, &byte, 1);
  (void)ignored;
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
    failures.push_back("attempt " + std::to_string(attempt) + ": " + failure);
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

// Process launcher, part two: the launcher's signal handling and the start of
// the workers (the command looked up in PATH, the environment contract, and
// fork/exec into one process group). See launcher.h, and launcher_internal.h
// for how the launcher's files divide the work.
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/launch/launcher_internal.h"
#include "scaletrain/util/error.h"

extern char** environ;

namespace scaletrain::launch::detail {
namespace {

// Exit code of a child that failed between fork and exec (like posix_spawn).
constexpr int kExecFailedCode = 127;

}  // namespace

// ---------------------------------------------------------------- handles

Pipe make_pipe(int extra_flags) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC | extra_flags) != 0)
    throw std::runtime_error(std::string("launch: pipe2 failed: ") + std::strerror(errno));
  return Pipe{Fd(p[0]), Fd(p[1])};
}

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
std::atomic<int> g_pending_int{0};   // SIGINTs not yet handled by the loop
std::atomic<int> g_pending_term{0};  // SIGTERMs not yet handled by the loop

namespace {

std::atomic<int> g_wake_fd{-1};  // write end of the self-pipe

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

}  // namespace

SignalScope::SignalScope(int wake_fd) {
  g_pending_int = 0;
  g_pending_term = 0;
  g_wake_fd = wake_fd;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (size_t i = 0; i < std::size(kHandledSignals); ++i) ::sigaction(kHandledSignals[i], &sa, &old_[i]);
  sigset_t ours;
  sigemptyset(&ours);
  for (int s : kHandledSignals) sigaddset(&ours, s);
  ::pthread_sigmask(SIG_UNBLOCK, &ours, &old_mask_);
}

SignalScope::~SignalScope() {
  for (size_t i = 0; i < std::size(kHandledSignals); ++i) ::sigaction(kHandledSignals[i], &old_[i], nullptr);
  ::pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  g_wake_fd = -1;
}

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

namespace {

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
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "SCALETRAIN_THREADS",
    "SCALETRAIN_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "SCALETRAIN_HEARTBEAT_FD",
    "SCALETRAIN_RESTART_REASON",
};

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
    const bool ours =
        std::any_of(std::begin(kContractVars), std::end(kContractVars), [&](const char* v) { return key == v; });
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

}  // namespace

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

}  // namespace scaletrain::launch::detail

// Tests of the process launcher (launch::run): environment contract, output
// relay, failure propagation, timeouts, signal forwarding, and that no worker
// survives any of it. Workers are small /bin/sh scripts that write what they
// see into a temporary directory. Every test bounds its time with timeout_s.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/launch/launcher.h"
#include "scaletrain/util/error.h"

namespace fs = std::filesystem;
using scaletrain::launch::LaunchOptions;

namespace launcher_test {

using Clock = std::chrono::steady_clock;

// A scratch directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "st_launch_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Lines of a `env` dump as a map.
std::map<std::string, std::string> read_env(const std::string& path) {
  std::map<std::string, std::string> env;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

pid_t read_pid(const std::string& path) {
  std::ifstream in(path);
  long pid = -1;
  in >> pid;
  return static_cast<pid_t>(pid);
}

// Strict check for our direct children: an unreaped zombie still counts as
// alive, so this also proves the launcher reaped them.
bool gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

// For grandchildren (re-parented to init or a subreaper, which may be slow to
// reap): gone, or a zombie.
bool not_running(pid_t pid) {
  if (gone(pid)) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto paren = content.rfind(')');
  return paren != std::string::npos && paren + 2 < content.size() && content[paren + 2] == 'Z';
}

// Waits (bounded) until all files exist.
bool wait_for_files(const std::vector<std::string>& paths, double seconds) {
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    bool all = true;
    for (const auto& p : paths) all = all && fs::exists(p) && fs::file_size(p) > 0;
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// Waits (bounded) for a process we cannot reap to finish dying.
bool eventually_not_running(pid_t pid) {
  const auto until = Clock::now() + std::chrono::seconds(3);
  while (!not_running(pid) && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return not_running(pid);
}

// Shell snippet: the worker writes its pid to <dir>/pid$RANK atomically, so
// a worker killed mid-write never leaves a half-written file.
std::string write_pid(const std::string& dir) {
  return "echo $$ > " + dir + "/pid$RANK.tmp && mv " + dir + "/pid$RANK.tmp " + dir + "/pid$RANK; ";
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Options whose output goes to files in `dir`, with a safety timeout.
struct Captured {
  LaunchOptions opts;
  std::FILE* out = nullptr;
  std::FILE* err = nullptr;
  explicit Captured(const TempDir& dir, int nproc) {
    out = std::fopen((dir / "launcher.out").c_str(), "w+");
    err = std::fopen((dir / "launcher.err").c_str(), "w+");
    opts.nproc_per_node = nproc;
    opts.stdout_fd = ::fileno(out);
    opts.stderr_fd = ::fileno(err);
    opts.timeout_s = 20;  // a broken launcher fails the test instead of hanging it
    opts.grace_s = 1.0;
  }
  ~Captured() {
    std::fclose(out);
    std::fclose(err);
  }
  Captured(const Captured&) = delete;
  Captured& operator=(const Captured&) = delete;
};

std::vector<std::string> sh(const std::string& script) { return {"/bin/sh", "-c", script}; }


TEST(Launch, AllRanksSucceedWithTorchrunEnvironment) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.nnodes = 2;
  c.opts.node_rank = 1;
  c.opts.master_addr = "10.1.2.3";
  c.opts.master_port = 12345;
  c.opts.threads = 3;
  // Several nodes share the store secret given to every launcher (unset, the
  // launcher warns that the store accepts any client).
  ::setenv("SCALETRAIN_STORE_SECRET", "shared by all nodes", 1);
  const int rc = scaletrain::launch::run(c.opts, sh("env > " + (dir / "env") + "$LOCAL_RANK"));
  ::unsetenv("SCALETRAIN_STORE_SECRET");
  ASSERT_EQ(rc, 0) << slurp(dir / "launcher.err");
  for (int lr = 0; lr < 2; ++lr) {
    auto env = read_env(dir / ("env" + std::to_string(lr)));
    EXPECT_EQ(env["RANK"], std::to_string(2 + lr));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(lr));
    EXPECT_EQ(env["WORLD_SIZE"], "4");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["MASTER_ADDR"], "10.1.2.3");
    EXPECT_EQ(env["MASTER_PORT"], "12345");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "3");
    EXPECT_EQ(env["SCALETRAIN_THREADS"], "3");
    EXPECT_FALSE(env["PATH"].empty()) << "the launcher's own environment is inherited";
    EXPECT_EQ(env["SCALETRAIN_STORE_SECRET"], "shared by all nodes");
  }
  EXPECT_EQ(slurp(dir / "launcher.err"), "");
}

TEST(Launch, ThreadsResolution) {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.threads = 5;
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, "7"), 5) << "explicit --threads wins";
  o.threads = 0;
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, "7"), 7) << "inherited OMP_NUM_THREADS is kept";
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, "4,2"), 4);
  const int cores = scaletrain::launch::usable_cores();
  EXPECT_GE(cores, 1);
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, nullptr), std::max(1, cores / 2));
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, "junk"), std::max(1, cores / 2));
  o.nproc_per_node = 100000;
  EXPECT_EQ(scaletrain::launch::resolve_threads(o, nullptr), 1) << "at least one thread";
}

TEST(Launch, InheritedOmpNumThreadsIsKeptWithoutExplicitThreads) {
  TempDir dir;
  Captured c(dir, 1);
  const char* saved = std::getenv("OMP_NUM_THREADS");
  const std::string saved_value = saved ? saved : "";
  ::setenv("OMP_NUM_THREADS", "6", 1);
  const int rc = scaletrain::launch::run(c.opts, sh("env > " + (dir / "env")));
  if (saved) ::setenv("OMP_NUM_THREADS", saved_value.c_str(), 1); else ::unsetenv("OMP_NUM_THREADS");
  ASSERT_EQ(rc, 0);
  auto env = read_env(dir / "env");
  EXPECT_EQ(env["OMP_NUM_THREADS"], "6");
  EXPECT_EQ(env["SCALETRAIN_THREADS"], "6");
}

TEST(Launch, OutputLinesArePrefixedWithRank) {
  TempDir dir;
  Captured c(dir, 2);
  const int rc = scaletrain::launch::run(
      c.opts, sh("echo hello $RANK; echo oops $RANK >&2; echo second $RANK; printf 'no newline %s' $RANK"));
  ASSERT_EQ(rc, 0);
  const std::string out = slurp(dir / "launcher.out"), err = slurp(dir / "launcher.err");
  for (int r = 0; r < 2; ++r) {
    const std::string p = "[rank " + std::to_string(r) + "] ";
    const std::string R = std::to_string(r);
    EXPECT_NE(out.find(p + "hello " + R + "\n"), std::string::npos) << out;
    EXPECT_NE(out.find(p + "second " + R + "\n"), std::string::npos) << out;
    EXPECT_NE(out.find(p + "no newline " + R + "\n"), std::string::npos) << "partial line flushed at EOF:\n" << out;
    EXPECT_NE(err.find(p + "oops " + R + "\n"), std::string::npos) << err;
    EXPECT_EQ(out.find("oops"), std::string::npos) << "stderr stays on stderr";
  }
  // Every line is whole: it starts with a prefix.
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) EXPECT_EQ(line.rfind("[rank ", 0), 0u) << line;
}

TEST(Launch, LogDirGetsOneFilePerRank) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.log_dir = dir / "logs/nested";  // created on demand
  const int rc = scaletrain::launch::run(c.opts, sh("echo out $RANK; echo err $RANK >&2"));
  ASSERT_EQ(rc, 0);
  for (int r = 0; r < 2; ++r) {
    const std::string log = slurp(dir / ("logs/nested/rank" + std::to_string(r) + ".log"));
    EXPECT_NE(log.find("out " + std::to_string(r) + "\n"), std::string::npos) << log;
    EXPECT_NE(log.find("err " + std::to_string(r) + "\n"), std::string::npos) << log;
    EXPECT_EQ(log.find("[rank"), std::string::npos) << "log files carry no prefix";
  }
}

TEST(Launch, FailingRankStopsTheOthersAndNoProcessIsLeft) {
  TempDir dir;
  Captured c(dir, 3);
  // Rank 1 fails once the others are up; they sleep in a child of sh, so the
  // launcher must reach grandchildren too.
  const std::string d = dir.path().string();
  const std::string script =
      write_pid(d) +
      "if [ $RANK = 1 ]; then while [ ! -e " + d + "/pid0 ] || [ ! -e " + d + "/pid2 ]; do sleep 0.02; done; exit 3; fi; "
      "sleep 30 & echo $! > " + d + "/child$RANK.tmp; mv " + d + "/child$RANK.tmp " + d + "/child$RANK; wait";
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  const double took = seconds_since(t0);
  EXPECT_EQ(rc, 1);
  EXPECT_LT(took, 10.0);
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_NE(err.find("scaletrain launch: rank 1 exited with code 3\n"), std::string::npos) << err;
  EXPECT_EQ(err.find("rank 0 "), std::string::npos) << "only the first failure is reported: " << err;
  for (int r = 0; r < 3; ++r) {
    const pid_t pid = read_pid(dir / ("pid" + std::to_string(r)));
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(gone(pid)) << "rank " << r << " pid " << pid << " still exists (or is an unreaped zombie)";
  }
  for (int r : {0, 2}) {
    const std::string f = dir / ("child" + std::to_string(r));
    if (!fs::exists(f)) continue;  // killed before it started its sleep
    const pid_t child = read_pid(f);
    // It got SIGKILL from the launcher but may still be finishing its exit.
    EXPECT_TRUE(eventually_not_running(child)) << "grandchild of rank " << r << " survived";
  }
}

TEST(Launch, RankKilledBySignalIsReported) {
  TempDir dir;
  Captured c(dir, 2);
  const std::string d = dir.path().string();
  const std::string script = write_pid(d) +
                             "if [ $RANK = 0 ]; then while [ ! -e " + d + "/pid1 ]; do sleep 0.02; done; kill -9 $$; fi; "
                             "exec sleep 30";
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  EXPECT_EQ(rc, 1);
  EXPECT_LT(seconds_since(t0), 10.0);
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_NE(err.find("scaletrain launch: rank 0 was killed by signal 9 (SIGKILL)\n"), std::string::npos) << err;
  for (int r = 0; r < 2; ++r) {
    const std::string f = dir / ("pid" + std::to_string(r));
    ASSERT_TRUE(fs::exists(f));
    EXPECT_TRUE(gone(read_pid(f))) << "rank " << r;
  }
}

TEST(Launch, WorkerIgnoringSigtermIsKilledAfterGrace) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.grace_s = 0.3;
  const std::string d = dir.path().string();
  const std::string script =
      "trap '' TERM; " + write_pid(d) +
      "if [ $RANK = 1 ]; then while [ ! -e " + d + "/pid0 ]; do sleep 0.02; done; exit 2; fi; exec sleep 30";
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  EXPECT_EQ(rc, 2) << "a rank's usage error (exit 2) is the job's";
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(slurp(dir / "launcher.err").find("rank 1 exited with code 2"), std::string::npos);
  EXPECT_TRUE(gone(read_pid(dir / "pid0")));
}

TEST(Launch, TimeoutKillsSleepingWorkers) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.timeout_s = 0.5;
  const std::string d = dir.path().string();
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(write_pid(d) + "exec sleep 30"));
  const double took = seconds_since(t0);
  EXPECT_EQ(rc, scaletrain::launch::kTimeoutExitCode);
  EXPECT_GE(took, 0.5);
  EXPECT_LT(took, 5.0);
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_NE(err.find("scaletrain launch: timed out after 0.5 s\n"), std::string::npos) << err;
  EXPECT_EQ(err.find("exited with code"), std::string::npos) << "workers we killed are not failures: " << err;
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(gone(read_pid(dir / ("pid" + std::to_string(r))))) << "rank " << r;
}

TEST(Launch, SigtermToLauncherIsForwarded) {
  TempDir dir;
  Captured c(dir, 2);
  const std::string d = dir.path().string();
  const std::vector<std::string> pid_files{dir / "pid0", dir / "pid1"};
  // Send SIGTERM to this process once both workers are up: run() is then
  // certainly inside its loop with its handler installed.
  std::thread sender([&] {
    if (wait_for_files(pid_files, 10)) ::kill(::getpid(), SIGTERM);
  });
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(write_pid(d) + "exec sleep 30"));
  sender.join();
  EXPECT_EQ(rc, 128 + SIGTERM);
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_NE(slurp(dir / "launcher.err").find("received SIGTERM"), std::string::npos);
  for (const auto& f : pid_files) EXPECT_TRUE(gone(read_pid(f))) << f;
}

TEST(Launch, WorkersDieWithAKilledLauncher) {
  TempDir dir;
  const std::string d = dir.path().string();
  const std::vector<std::string> pid_files{dir / "pid0", dir / "pid1"};
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    LaunchOptions o;
    o.nproc_per_node = 2;
    o.timeout_s = 20;
    o.stdout_fd = o.stderr_fd = ::open("/dev/null", O_WRONLY);
    ::_exit(scaletrain::launch::run(o, sh(write_pid(d) + "exec sleep 30")));
  }
  const bool started = wait_for_files(pid_files, 10);
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  ASSERT_TRUE(started);
  // PR_SET_PDEATHSIG kills the orphans; init then reaps them.
  const auto until = Clock::now() + std::chrono::seconds(5);
  bool all_dead = false;
  while (!all_dead && Clock::now() < until) {
    all_dead = not_running(read_pid(pid_files[0])) && not_running(read_pid(pid_files[1]));
    if (!all_dead) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(all_dead);
}

// --max-restarts: a failure stops the whole group and starts it again with
// the attempt number in the environment; the count is not reset by a
// success of some ranks, every failure is listed at the end, and logs keep
// every attempt's lines.
TEST(Launch, RestartsTheGroupWithTheAttemptNumber) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.max_restarts = 3;
  c.opts.log_dir = dir / "logs";
  const std::string d = dir.path().string();
  // Attempt 0: rank 1 exits 3; attempt 1: rank 0 is killed by SIGKILL; attempt 2: all succeed.
  // The failing rank waits until both ranks of its attempt have started.
  const std::string starts = d + "/starts$SCALETRAIN_RESTART_COUNT";
  const std::string both = "until [ $(cat " + starts + " 2>/dev/null | wc -l) -ge 2 ]; do sleep 0.02; done; ";
  const std::string script =
      "echo attempt $SCALETRAIN_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS; "
      "echo $RANK >> " + starts + "; "
      "if [ $SCALETRAIN_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then " + both + "exit 3; fi; "
      "if [ $SCALETRAIN_RESTART_COUNT = 1 ] && [ $RANK = 0 ]; then " + both + "kill -9 $$; fi; "
      "if [ $SCALETRAIN_RESTART_COUNT -lt 2 ]; then exec sleep 30; fi";
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_EQ(rc, 0) << err;
  EXPECT_NE(err.find("restarting all 2 workers (restart 1 of 3) after rank 1 exited with code 3"), std::string::npos)
      << err;
  EXPECT_NE(err.find("restarting all 2 workers (restart 2 of 3) after rank 0 was killed by signal 9 (SIGKILL)"),
            std::string::npos)
      << err;
  for (int a = 0; a < 3; ++a) EXPECT_EQ(slurp(dir / ("starts" + std::to_string(a))).size(), 4u) << "attempt " << a;
  EXPECT_FALSE(fs::exists(dir / "starts3"));
  const std::string log = slurp(dir / "logs/rank1.log");
  for (int a = 0; a < 3; ++a)
    EXPECT_NE(log.find("attempt " + std::to_string(a) + " " + std::to_string(a) + " of 3"), std::string::npos) << log;
}

TEST(Launch, RestartsRunOutAndEveryFailureIsListed) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.max_restarts = 2;
  const int rc = scaletrain::launch::run(c.opts, sh("if [ $RANK = 1 ]; then exit 5; fi; exec sleep 30"));
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("giving up after 2 restarts; failures: attempt 0: rank 1 exited with code 5; attempt 1: rank 1 "
                     "exited with code 5; attempt 2: rank 1 exited with code 5"),
            std::string::npos)
      << err;
  // A usage error (exit 2) would be refused again: no restart.
  TempDir dir2;
  Captured c2(dir2, 2);
  c2.opts.max_restarts = 3;
  EXPECT_EQ(scaletrain::launch::run(c2.opts, sh("if [ $RANK = 0 ]; then exit 2; fi; exec sleep 30")), 2);
  const std::string err2 = slurp(dir2 / "launcher.err");
  EXPECT_NE(err2.find("not restarting: a rank refused its input (exit 2)"), std::string::npos) << err2;
  EXPECT_EQ(err2.find("restarting all"), std::string::npos) << err2;
}

// Shell snippet: one heartbeat, as launch::heartbeat() sends it (the pipe is
// reopened through /proc, since sh cannot name descriptors above 9).
std::string beat() { return "printf x > /proc/self/fd/$SCALETRAIN_HEARTBEAT_FD; "; }

TEST(Launch, WorkerWhoseHeartbeatStopsIsKilledAndReported) {
  TempDir dir;
  Captured c(dir, 2);
  c.opts.heartbeat_timeout_s = 1;
  const std::string d = dir.path().string();
  // Rank 0 beats every 0.1 s; rank 1 beats once and then hangs.
  const std::string script =
      write_pid(d) + "if [ $RANK = 1 ]; then " + beat() + "exec sleep 30; fi; " +
      "i=0; while [ $i -lt 300 ]; do " + beat() + "sleep 0.1; i=$((i+1)); done";
  const auto t0 = Clock::now();
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  EXPECT_EQ(rc, 1);
  EXPECT_LT(seconds_since(t0), 8.0);
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_NE(err.find("scaletrain launch: rank 1 sent no heartbeat for 1 s"), std::string::npos) << err;
  EXPECT_EQ(err.find("rank 0 sent no heartbeat"), std::string::npos) << err;
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(gone(read_pid(dir / ("pid" + std::to_string(r))))) << "rank " << r;
}

TEST(Launch, StoppedWorkerIsKilledByTheHeartbeatWatchdog) {
  TempDir dir;
  Captured c(dir, 1);
  c.opts.heartbeat_timeout_s = 0.5;
  c.opts.max_restarts = 1;  // the restart policy applies: attempt 1 runs to the end
  const std::string d = dir.path().string();
  const std::string script = "if [ $SCALETRAIN_RESTART_COUNT = 1 ]; then exit 0; fi; " + write_pid(d) +
                             "while true; do " + beat() + "sleep 0.05; done";
  std::thread stopper([&] {
    if (wait_for_files({dir / "pid0"}, 10)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ::kill(read_pid(dir / "pid0"), SIGSTOP);
    }
  });
  const int rc = scaletrain::launch::run(c.opts, sh(script));
  stopper.join();
  EXPECT_EQ(rc, 0);
  const std::string err = slurp(dir / "launcher.err");
  EXPECT_NE(err.find("rank 0 sent no heartbeat for 0.5 s"), std::string::npos) << err;
  EXPECT_NE(err.find("restarting all 1 workers"), std::string::npos) << err;
  EXPECT_TRUE(gone(read_pid(dir / "pid0")));
}

TEST(Launch, WorkersThatNeverBeatAreNotWatched) {
  TempDir dir;
  Captured c(dir, 1);
  c.opts.heartbeat_timeout_s = 0.2;
  EXPECT_EQ(scaletrain::launch::run(c.opts, sh("sleep 1")), 0) << slurp(dir / "launcher.err");
}

TEST(Launch, WorkersGetAStoreSecretAndTheCulpritIsTheLastLine) {
  TempDir dir;
  Captured c(dir, 2);
  const std::string d = dir.path().string();
  const std::string script = "env > " + d + "/env$RANK.tmp && mv " + d + "/env$RANK.tmp " + d + "/env$RANK; "
                             "if [ $RANK = 0 ]; then while [ ! -e " + d + "/env1 ]; do sleep 0.02; done; "
                             "echo 'collective failed' >&2; echo 'culprit: rank 1 is behind: test' >&2; exit 1; fi; "
                             "exec sleep 30";
  EXPECT_EQ(scaletrain::launch::run(c.opts, sh(script)), 1);
  const auto env0 = read_env(dir / "env0");
  const auto env1 = read_env(dir / "env1");
  ASSERT_EQ(env0.count("SCALETRAIN_STORE_SECRET"), 1u);
  EXPECT_GE(env0.at("SCALETRAIN_STORE_SECRET").size(), 32u);
  EXPECT_EQ(env0.at("SCALETRAIN_STORE_SECRET"), env1.at("SCALETRAIN_STORE_SECRET"));
  std::string err = slurp(dir / "launcher.err");
  while (!err.empty() && err.back() == '\n') err.pop_back();
  const std::string last = err.substr(err.rfind('\n') + 1);
  EXPECT_EQ(last, "scaletrain launch: culprit: rank 1 is behind: test (reported by rank 0)") << err;
}

TEST(Launch, BadInputIsAUsageError) {
  using scaletrain::UsageError;
  using scaletrain::launch::run;
  LaunchOptions o;
  o.nproc_per_node = 0;
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  o.nnodes = 2;
  o.node_rank = 2;
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  o.master_port = 70000;
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  o.max_restarts = -1;
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  o.nnodes = 2;
  o.max_restarts = 1;  // the launchers of several nodes would have to agree on a restart
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  o.heartbeat_timeout_s = -1;
  EXPECT_THROW(run(o, {"/bin/true"}), UsageError);
  o = LaunchOptions{};
  EXPECT_THROW(run(o, {}), UsageError);
  EXPECT_THROW(run(o, {"scaletrain-no-such-command-xyz"}), UsageError);
  EXPECT_THROW(run(o, {"/nonexistent/bin/prog"}), UsageError);
  try {
    o.nproc_per_node = -1;
    run(o, {"/bin/true"});
    FAIL() << "no exception";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--nproc-per-node"), std::string::npos) << e.what();
  }
}

TEST(Launch, CommandIsFoundInPath) {
  TempDir dir;
  Captured c(dir, 1);
  EXPECT_EQ(scaletrain::launch::run(c.opts, {"true"}), 0);
  EXPECT_EQ(scaletrain::launch::run(c.opts, {"false"}), 1);
  EXPECT_NE(slurp(dir / "launcher.err").find("rank 0 exited with code 1"), std::string::npos);
}

}  // namespace launcher_test

namespace scaletrain::launch {
namespace launcher_test {

// After a node is lost, the survivors' collectives fail first: the restart
// reason names the lost node's rank (the workers' culprit), not the survivor.
TEST(Launch, RestartReasonNamesACulpritOfAnotherNode) {
  const std::string here = "rank 0 exited with code 1";
  // Node 0 holds ranks 0-1; rank 3 is on node 1.
  EXPECT_EQ(failure_reason(here, "rank 3 (it did not answer) (reported by rank 0)", 0, 2),
            "rank 3 of another node stopped answering (culprit: rank 3 (it did not answer) (reported by rank 0)); "
            "then here: rank 0 exited with code 1");
  EXPECT_EQ(failure_reason(here, "rank 1 (behind) (reported by rank 0)", 0, 2), here) << "a local culprit";
  EXPECT_EQ(failure_reason(here, "", 0, 2), here) << "no culprit";
  EXPECT_EQ(failure_reason("rank 2 exited with code 1", "rank 0 (it serves the store) (reported by rank 2)", 2, 2),
            "rank 0 of another node stopped answering (culprit: rank 0 (it serves the store) (reported by rank 2)); "
            "then here: rank 2 exited with code 1");
}

}  // namespace launcher_test
}  // namespace scaletrain::launch

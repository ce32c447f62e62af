// Process launcher, part three: the supervision loop. Supervisor::supervise()
// relays the workers' output line by line with the "[rank N] " prefix,
// watches their exits and heartbeats, forwards signals, enforces the timeout
// and the grace period, and stops them all on the first failure. See
// launcher.h, and launcher_internal.h for how the launcher's files divide the
// work.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "scaletrain/launch/launcher_internal.h"

namespace scaletrain::launch::detail {
namespace {

// A line longer than this without a newline (a progress bar redrawn with
// '\r', binary junk) is printed in pieces so memory stays bounded.
constexpr size_t kMaxLine = size_t{64} * 1024;
// After the last worker has exited, how long we keep reading pipes still held
// open by processes that escaped the process group (setsid daemons).
constexpr double kDrainSeconds = 1.0;
// Upper bound on one poll() sleep; SIGCHLD normally wakes us much earlier,
// this only matters if the caller's threads all block SIGCHLD.
constexpr int kMaxPollMs = 200;

}  // namespace

Supervisor::~Supervisor() {
  kill_all(SIGKILL);
  for (auto& w : workers_)
    if (!w.reaped && w.pid > 0) ::waitpid(w.pid, nullptr, 0);
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
    // WNOWAIT: read the status but leave the zombie; see Note [No process left behind] in launcher.cpp.
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
        failure_ = "rank " + std::to_string(w.rank) + " was killed by signal " + std::to_string(info.si_status) + " (" +
                   signal_name(info.si_status) + ")";
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

// ---------------------------------------------------------------- output

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

// ---------------------------------------------------------------- the loop

// The clocks of one supervise() call.
struct Supervisor::Loop {
  bool has_timeout = false;
  Clock::time_point deadline{};
  bool all_exited = false;
  Clock::time_point drain_until{};
  Clock::time_point next_poll{};
};

// What one poll() waits on: the self-pipe, the open output streams, then the
// heartbeat pipes (until every worker has exited); owners[i] goes with fds[i].
struct Supervisor::PollSet {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  size_t n_streams = 0;  // fds[1, n_streams) are output streams
};

int Supervisor::supervise(int wake_fd, const std::function<std::string()>& interrupted) {
  using std::chrono::duration;
  const Clock::time_point start = Clock::now();
  Loop l;
  l.has_timeout = o_.timeout_s > 0;
  l.deadline = start + std::chrono::duration_cast<Clock::duration>(duration<double>(l.has_timeout ? o_.timeout_s : 0));
  l.next_poll = start;

  for (;;) {
    const Clock::time_point now = step(l, interrupted);
    PollSet p = poll_set(wake_fd, l.all_exited);
    if (l.all_exited && (p.fds.size() == 1 || now >= l.drain_until)) break;
    // Sleep until output, a signal (SIGCHLD included), or the next deadline.
    const std::chrono::milliseconds wait = poll_wait(l, now, interrupted);
    const int ready = ::poll(p.fds.data(), p.fds.size(), static_cast<int>(wait.count()));
    if (ready < 0 && errno != EINTR)
      throw std::runtime_error(std::string("launch: poll failed: ") + std::strerror(errno));
    if (ready <= 0) continue;
    dispatch(p, wake_fd);
  }
  return finish();
}

// One pass of the loop's checks, in order: forwarded signals, exits,
// heartbeats, the elastic round, the timeout, the grace period, the end of
// the workers. Returns the time it looked at the clock.
Clock::time_point Supervisor::step(Loop& l, const std::function<std::string()>& interrupted) {
  using std::chrono::duration;
  for (int n = g_pending_int.exchange(0); n > 0; --n) handle_signal(SIGINT);
  for (int n = g_pending_term.exchange(0); n > 0; --n) handle_signal(SIGTERM);
  observe_exits();
  const Clock::time_point now = Clock::now();
  check_heartbeats(now);
  if (interrupted && stop_ == Stop::kNone && now >= l.next_poll) {
    l.next_poll = now + std::chrono::milliseconds(500);
    const std::string why = interrupted();
    if (!why.empty()) {
      say("stopping the workers: " + why);
      begin_stop(Stop::kRendezvous, 0);
    }
  }
  if (l.has_timeout && stop_ == Stop::kNone && now >= l.deadline) {
    say("timed out after " + format_seconds(o_.timeout_s) + " s");
    begin_stop(Stop::kTimeout, 0);
  }
  if (term_sent_ && !kill_sent_ && now >= kill_at_) {
    kill_all(SIGKILL);
    kill_sent_ = true;
  }
  if (!l.all_exited && std::all_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.exited; })) {
    l.all_exited = true;
    // The leader is still a zombie, so pgid_ is still ours: sweep up any
    // children the workers left behind, which also closes their pipes.
    ::killpg(pgid_, SIGKILL);
    l.drain_until = now + std::chrono::duration_cast<Clock::duration>(duration<double>(kDrainSeconds));
  }
  return now;
}

Supervisor::PollSet Supervisor::poll_set(int wake_fd, bool all_exited) {
  PollSet p;
  p.fds.push_back({wake_fd, POLLIN, 0});
  p.owners.emplace_back(nullptr, nullptr);
  for (auto& w : workers_)
    for (Stream* s : {&w.out, &w.err})
      if (s->fd.valid()) {
        p.fds.push_back({s->fd.get(), POLLIN, 0});
        p.owners.emplace_back(&w, s);
      }
  p.n_streams = p.fds.size();
  for (auto& w : workers_)
    if (w.heartbeat.valid() && !all_exited) {
      p.fds.push_back({w.heartbeat.get(), POLLIN, 0});
      p.owners.emplace_back(&w, nullptr);
    }
  return p;
}

// How long poll() may sleep at most: until the nearest deadline, capped at
// kMaxPollMs.
std::chrono::milliseconds Supervisor::poll_wait(const Loop& l, Clock::time_point now,
                                                const std::function<std::string()>& interrupted) const {
  using std::chrono::duration;
  auto wait = std::chrono::milliseconds(kMaxPollMs);
  auto until = [&](Clock::time_point t) {
    wait = std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(std::max(t - now, Clock::duration::zero())));
  };
  if (l.has_timeout && stop_ == Stop::kNone) until(l.deadline);
  if (term_sent_ && !kill_sent_) until(kill_at_);
  if (l.all_exited) until(l.drain_until);
  if (interrupted && stop_ == Stop::kNone) until(l.next_poll);
  if (o_.heartbeat_timeout_s > 0 && stop_ == Stop::kNone)
    for (auto& w : workers_)
      if (w.beating && !w.exited)
        until(w.last_beat + std::chrono::duration_cast<Clock::duration>(duration<double>(o_.heartbeat_timeout_s)));
  return wait;
}

// Handles what poll() found ready: drains the self-pipe, relays output,
// records beats.
void Supervisor::dispatch(const PollSet& p, int wake_fd) {
  if (p.fds[0].revents) {
    char sink[256];
    while (::read(wake_fd, sink, sizeof sink) > 0) {
    }
  }
  for (size_t i = 1; i < p.fds.size(); ++i) {
    if (!p.fds[i].revents) continue;
    if (i < p.n_streams)
      read_stream(*p.owners[i].first, *p.owners[i].second);
    else
      read_heartbeat(*p.owners[i].first);
  }
}

// After the loop: flushes the lines left unfinished, reaps the leader, and
// maps the reason of the stop to supervise()'s exit code.
int Supervisor::finish() {
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
    case Stop::kNone:
      return 0;
    case Stop::kFailure:
      return failure_code_;
    case Stop::kSignal:
      return 128 + stop_signal_;
    case Stop::kTimeout:
      return kTimeoutExitCode;
    case Stop::kRendezvous:
      return 0;
  }
  return 1;
}

}  // namespace scaletrain::launch::detail

// The collective tracker (Note [Which rank, which collective] in group.h):
// the fingerprint checks, and the table that names the rank at fault.
#include "scaletrain/comm/group_internal.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>

namespace scaletrain::comm {

namespace detail {

std::string first_line(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string s = ce ? ce->what_without_backtrace() : e.what();
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace detail

// --- CollectiveTracker (Note [Which rank, which collective] in group.h) -----

namespace {

using detail::first_line;

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string to_string(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// "" when every rank called the same collective; else the message naming the
// ranks that differ from the majority (ties go to group rank 0's side).
std::string compare_fingerprints(const std::string& group, uint64_t seq, const std::vector<int>& ranks,
                                 const std::vector<std::string>& fps) {
  std::map<std::string, int> count;
  for (const auto& f : fps) ++count[f];
  std::string major = fps[0];
  for (const auto& [f, c] : count)
    if (c > count[major]) major = f;
  std::ostringstream m;
  int odd = 0;
  for (size_t r = 0; r < fps.size(); ++r) {
    if (fps[r] == major) continue;
    m << (odd++ ? "; " : "") << "rank " << ranks[r] << " (group rank " << r << ") called " << fps[r];
  }
  if (odd == 0) return "";
  std::ostringstream out;
  out << "collective mismatch on group '" << group << "' at seq " << seq << ": " << m.str() << "; ";
  if (fps.size() == 2)
    out << "rank " << ranks[fps[0] == major ? 0 : 1] << " called " << major;
  else
    out << "the other " << fps.size() - static_cast<size_t>(odd) << " ranks called " << major;
  return out.str();
}

struct Record {
  bool answered = false;
  uint64_t started = 0, finished = 0, waiting = 0;  // seq + 1 (0: none)
  std::string started_op, finished_op;
  double seconds = 0;  // in the current state (waiting, or computing since the last finish)
};

// Parses record()'s line: "started op finished op waiting seconds", tab-separated.
Record parse_record(const std::string& line) {
  Record r;
  std::vector<std::string> f;
  std::stringstream ss(line);
  for (std::string x; std::getline(ss, x, '\t');) f.push_back(x);
  if (f.size() != 6) return r;
  try {
    r.started = std::stoull(f[0]);
    r.started_op = f[1];
    r.finished = std::stoull(f[2]);
    r.finished_op = f[3];
    r.waiting = std::stoull(f[4]);
    r.seconds = std::stod(f[5]);
    r.answered = true;
  } catch (const std::exception&) {
    r.answered = false;
  }
  return r;
}

std::string seq_text(uint64_t s, const std::string& op) {
  return s == 0 ? std::string("none") : "seq " + std::to_string(s - 1) + " " + op;
}

}  // namespace

CollectiveTracker::CollectiveTracker(Options options) : o_(std::move(options)) {}

void CollectiveTracker::launching(uint64_t seq, const std::string& op, const std::string& fingerprint) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = seq + 1;
    started_op_ = op;
  }
  if (o_.ranks.size() < 2) return;
  if (!o_.fingerprint_store) return check_first_of_kind(seq, op, fingerprint);
  c10d::Store& st = *o_.fingerprint_store;
  const std::string base = "fp/" + std::to_string(seq) + "/";
  std::string verdict;
  try {
    st.set(base + std::to_string(o_.rank), to_bytes(fingerprint));
    if (o_.rank == 0) {
      std::vector<std::string> fps(o_.ranks.size());
      fps[0] = fingerprint;
      for (size_t r = 1; r < fps.size(); ++r) fps[r] = to_string(st.get(base + std::to_string(r)));
      verdict = compare_fingerprints(o_.group, seq, o_.ranks, fps);
      st.set(base + "v", to_bytes("=" + verdict));
      // Every rank has read seq - 2's verdict before it set seq - 1's key,
      // which rank 0 has just read: those keys are no longer needed.
      if (seq >= 2) {
        const std::string old = "fp/" + std::to_string(seq - 2) + "/";
        for (size_t r = 0; r < fps.size(); ++r) st.deleteKey(old + std::to_string(r));
        st.deleteKey(old + "v");
      }
    } else {
      verdict = to_string(st.get(base + "v")).substr(1);
    }
  } catch (const std::exception& e) {
    throw CommError(explain("fingerprint check of " + op + " on group '" + o_.group + "' (seq " + std::to_string(seq) +
                            ") failed: " + first_line(e)));
  }
  if (!verdict.empty()) throw CommError(verdict);
}

// Note [First-of-kind check] (group.h).
void CollectiveTracker::check_first_of_kind(uint64_t seq, const std::string& op, const std::string& fingerprint) {
  constexpr size_t kMaxKinds = 4096;  // beyond this, new kinds go unchecked
  if (!o_.first_store) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.size() >= kMaxKinds || !seen_.insert(fingerprint).second) return;
  }
  c10d::Store& st = *o_.first_store;
  const std::string base = std::to_string(seq) + "/";
  std::vector<std::string> fps(o_.ranks.size());
  fps[static_cast<size_t>(o_.rank)] = fingerprint;
  size_t r = 0;
  try {
    st.set(base + std::to_string(o_.rank), to_bytes(fingerprint));
    for (r = 0; r < fps.size(); ++r)
      if (static_cast<int>(r) != o_.rank) fps[r] = to_string(st.get(base + std::to_string(r)));
  } catch (const std::exception& e) {
    throw CommError(explain("first " + fingerprint + " on group '" + o_.group + "' (seq " + std::to_string(seq) +
                            "): rank " + std::to_string(o_.ranks[r]) +
                            " did not compare its collective of this seq (it had called its kind before and this rank "
                            "had not, so the ranks called different collectives, or it never came): " +
                            first_line(e)));
  }
  const std::string verdict = compare_fingerprints(o_.group, seq, o_.ranks, fps);
  if (!verdict.empty()) throw CommError(verdict);
}

void CollectiveTracker::finished(uint64_t seq, const std::string& op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (seq + 1 > finished_) {
    finished_ = seq + 1;
    finished_op_ = op;
  }
  since_ = Clock::now();
}

void CollectiveTracker::waiting(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_on_ = seq + 1;
  since_ = Clock::now();
}

void CollectiveTracker::done_waiting() {
  std::lock_guard<std::mutex> lock(mu_);
  waiting_on_ = 0;
  since_ = Clock::now();
}

std::string CollectiveTracker::record() const {
  std::lock_guard<std::mutex> lock(mu_);
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", std::chrono::duration<double>(Clock::now() - since_).count());
  return std::to_string(started_) + "\t" + started_op_ + "\t" + std::to_string(finished_) + "\t" + finished_op_ + "\t" +
         std::to_string(waiting_on_) + "\t" + secs;
}

std::string CollectiveTracker::explain(const std::string& what) const {
  if (!o_.ask || o_.ranks.size() < 2) return what;
  const std::string mine = record();  // before the others are asked (which takes time)
  std::vector<std::string> answers;
  std::string store_silent;  // the store did not answer: its host is the culprit
  try {
    answers = o_.ask(o_.group, o_.ranks);
  } catch (const StoreSilent& e) {
    store_silent = e.what();
  } catch (const std::exception&) {
    answers.clear();
  }
  answers.resize(o_.ranks.size());
  answers[static_cast<size_t>(o_.rank)] = mine;
  std::vector<Record> recs;
  for (const auto& a : answers) recs.push_back(parse_record(a));
  std::ostringstream t;
  t << what << "\n  ranks of group '" << o_.group << "' (collectives by sequence number):";
  char line[512];
  std::snprintf(line, sizeof line, "\n  %-6s %-26s %-26s %s", "rank", "last started", "last finished", "now");
  t << line;
  int culprit = -1;
  std::string why;
  uint64_t most = 0;
  for (const auto& r : recs)
    if (r.answered) most = std::max(most, r.started);
  for (size_t i = 0; i < recs.size(); ++i) {
    const Record& r = recs[i];
    std::string now;
    if (!r.answered) {
      now = "no answer (exited, stopped, or stuck where it cannot answer)";
    } else if (r.waiting) {
      char b[96];
      std::snprintf(b, sizeof b, "waiting on seq %llu for %.1f s", static_cast<unsigned long long>(r.waiting - 1),
                    r.seconds);
      now = b;
    } else {
      char b[96];
      std::snprintf(b, sizeof b, "not in a collective for %.1f s", r.seconds);
      now = b;
    }
    std::snprintf(line, sizeof line, "\n  %-6d %-26s %-26s %s", o_.ranks[i], seq_text(r.started, r.started_op).c_str(),
                  seq_text(r.finished, r.finished_op).c_str(), now.c_str());
    t << line;
  }
  // The culprit: a member that did not answer, else the one furthest behind.
  for (size_t i = 0; i < recs.size() && culprit < 0; ++i)
    if (!recs[i].answered) {
      culprit = static_cast<int>(i);
      why = "did not answer (exited, stopped, or stuck where it cannot answer)";
    }
  if (culprit < 0) {
    uint64_t least = most;
    for (size_t i = 0; i < recs.size(); ++i)
      if (recs[i].started < least) {
        least = recs[i].started;
        culprit = static_cast<int>(i);
      }
    if (culprit >= 0)
      why = "is behind: it has not started seq " + std::to_string(most - 1) + " (last started: " +
            seq_text(recs[static_cast<size_t>(culprit)].started, recs[static_cast<size_t>(culprit)].started_op) + ")";
  }
  if (!store_silent.empty())
    t << "\nculprit: rank 0 (it serves the store, which did not answer the diagnosis either: " << store_silent << ")";
  else if (culprit >= 0)
    t << "\nculprit: rank " << o_.ranks[static_cast<size_t>(culprit)] << " " << why;
  else
    t << "\nno rank is behind: every rank started seq " << (most == 0 ? 0 : most - 1)
      << " (the transport itself failed or stalled)";
  return t.str();
}

}  // namespace scaletrain::comm

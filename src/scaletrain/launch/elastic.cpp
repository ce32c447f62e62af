// The node-level rendezvous of elastic jobs. See Note [Elastic rounds] in
// elastic.h.
#include "scaletrain/launch/elastic.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace scaletrain::launch {
namespace {

using Clock = std::chrono::steady_clock;

void pause() { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }

}  // namespace

ElasticRendezvous::ElasticRendezvous(ElasticOptions options, std::unique_ptr<NodeStore> store)
    : o_(std::move(options)), store_(std::move(store)) {
  next_ = has("round") ? std::stoi(text("round")) : 0;
}

ElasticRendezvous::~ElasticRendezvous() = default;

std::string ElasticRendezvous::key(const std::string& k) const { return "elastic/" + k; }
std::string ElasticRendezvous::round_key(const std::string& k) const {
  return "elastic/r" + std::to_string(current_.round) + "/" + k;
}
bool ElasticRendezvous::has(const std::string& k) { return store_->check(key(k)); }
std::string ElasticRendezvous::text(const std::string& k) { return store_->get(key(k)); }
int64_t ElasticRendezvous::counter(const std::string& k) { return store_->add(key(k), 0); }

NodeRendezvous::Round ElasticRendezvous::next_round(int nproc) {
  // The store is gone: say so once more as the last line, rather than the
  // secondary error of asking it again.
  if (!lost_.empty()) throw std::runtime_error("giving up: " + lost_);
  const auto start = Clock::now();
  for (;;) {
    const int R = next_;
    const std::string r = "r" + std::to_string(R) + "/";
    if (has("abort")) throw std::runtime_error("the job was ended: " + text("abort"));
    if (has("done")) throw std::runtime_error("the job has finished; this node has nothing to join");
    const int64_t place = store_->add(key(r + "joined"), 1);
    // Wait for the round to close (see the Note).
    int64_t seen = -1, count = 0;
    auto changed = Clock::now();
    for (;;) {
      if (has(r + "closed")) {
        count = std::stoll(text(r + "closed"));
        break;
      }
      if (has("abort")) throw std::runtime_error("the job was ended: " + text("abort"));
      if (has("done")) throw std::runtime_error("the job has finished; this node has nothing to join");
      const int64_t n = counter(r + "joined");
      if (n != seen) {
        seen = n;
        changed = Clock::now();
      }
      if (n >= o_.max_nodes || (n >= o_.min_nodes && Clock::now() - changed >= o_.last_call)) {
        const std::string c = std::to_string(std::min<int64_t>(n, o_.max_nodes));
        count = std::stoll(store_->compare_set(key(r + "closed"), "", c));
        break;
      }
      if (Clock::now() - start > o_.join_timeout)
        throw std::runtime_error("no round of at least " + std::to_string(o_.min_nodes) + " nodes formed within " +
                                 std::to_string(o_.join_timeout.count() / 1000) + " s (" + std::to_string(n) +
                                 " joined round " + std::to_string(R) + ")");
      pause();
    }
    next_ = R + 1;
    if (place > count) {  // late: the members will make room in the next round
      store_->add(key(r + "waiting"), 1);
      continue;
    }
    store_->set(key(r + "node" + std::to_string(place)), store_->local_host() + "\t" + std::to_string(nproc));
    Round rd;
    rd.round = R;
    rd.nodes = static_cast<int>(count);
    rd.node_index = static_cast<int>(place - 1);
    for (int64_t i = 1; i <= count; ++i) {
      const std::string k = key(r + "node" + std::to_string(i));
      store_->wait({k}, o_.join_timeout);
      const std::string line = store_->get(k);
      const auto tab = line.find('\t');
      const int n = std::stoi(line.substr(tab + 1));
      if (i == 1) rd.master_addr = line.substr(0, tab);
      if (i < place) rd.first_rank += n;
      rd.world_size += n;
    }
    rd.master_port = o_.port + 1;
    // Late starters read where the job is.
    if (!has("round") || std::stoi(text("round")) < R) store_->set(key("round"), std::to_string(R));
    current_ = rd;
    place_ = static_cast<int>(place);
    seen_.clear();
    return rd;
  }
}

void ElasticRendezvous::end_round(const std::string& why) { store_->compare_set(round_key("end"), "", why); }

std::string ElasticRendezvous::interrupted() {
  try {
    store_->set(round_key("alive/" + std::to_string(place_)), std::to_string(++beat_));
    if (store_->check(round_key("end"))) return store_->get(round_key("end"));
    if (has("abort")) return "the job was ended: " + text("abort");
    if (current_.nodes < o_.max_nodes && store_->add(round_key("waiting"), 0) > 0) {
      end_round("a node is waiting to join");
      return "a node is waiting to join";
    }
    const auto now = Clock::now();
    for (int i = 1; i <= current_.nodes; ++i) {
      if (i == place_ || store_->check(round_key("done/" + std::to_string(i)))) continue;  // itself, or finished
      const int64_t v = store_->add(round_key("alive/" + std::to_string(i)), 0);
      auto it = seen_.find(i);
      if (it == seen_.end() || it->second.first != v) {
        seen_[i] = {v, now};
        continue;
      }
      if (now - it->second.second >= o_.keepalive_timeout) {
        std::string why = "node " + std::to_string(i - 1) + " stopped answering for " +
                          std::to_string(o_.keepalive_timeout.count() / 1000) + " s (lost)";
        end_round(why);
        return why;
      }
    }
    return "";
  } catch (const std::exception& e) {
    lost_ = store_gone(e);
    return lost_;
  }
}

// The launchers' store failed (its host's launcher died, most likely).
std::string ElasticRendezvous::store_gone(const std::exception& e) const {
  return "the rendezvous store at " + o_.host + ":" + std::to_string(o_.port) + " is gone (round " +
         std::to_string(current_.round) + ", this node was node " + std::to_string(place_ - 1) + " of " +
         std::to_string(current_.nodes) + "): " + e.what();
}

int ElasticRendezvous::fail_round(const std::string& why) {
  try {
    end_round(why);
    if (store_->add(round_key("failed"), 1) == 1) {
      const int64_t k = store_->add(key("failures"), 1);
      store_->set(key("failure/" + std::to_string(k)), "round " + std::to_string(current_.round) + ": " + why);
    }
    return static_cast<int>(counter("failures"));
  } catch (const std::exception& e) {
    throw std::runtime_error(store_gone(e));  // nothing left to restart with
  }
}

std::vector<std::string> ElasticRendezvous::failures() {
  std::vector<std::string> out;
  try {
    const int64_t n = counter("failures");
    for (int64_t k = 1; k <= n; ++k) out.push_back(text("failure/" + std::to_string(k)));
  } catch (const std::exception&) {
  }
  return out;
}

void ElasticRendezvous::succeeded() {
  try {
    store_->set(round_key("done/" + std::to_string(place_)), "1");
    store_->set(key("done"), "1");
    std::vector<std::string> all;
    for (int i = 1; i <= current_.nodes; ++i) all.push_back(round_key("done/" + std::to_string(i)));
    store_->wait(all, std::chrono::seconds(10));
  } catch (const std::exception&) {
    // The others may already be gone; this node's part is done.
  }
}

void ElasticRendezvous::abort(const std::string& why) {
  try {
    store_->compare_set(key("abort"), "", why);
  } catch (const std::exception&) {
  }
}

}  // namespace scaletrain::launch

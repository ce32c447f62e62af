// The elastic rounds (launch/elastic.h, Note [Elastic rounds]) over an
// in-memory NodeStore shared by several ElasticRendezvous objects, each
// playing one node's launcher on its own thread: who gets which ranks, how a
// failure, a lost node, a waiting node and an abort end a round. The same
// protocol runs between real launchers over comm's store in
// checkpoint_sharded_test.cpp (ElasticMembership).
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/launch/elastic.h"

namespace scaletrain::launch {
namespace elastic_test {

using std::chrono::milliseconds;

// One map behind a mutex: what the launchers of all nodes share.
struct SharedMap {
  std::mutex mu;
  std::condition_variable changed;
  std::map<std::string, std::string> values;
};

class MemoryStore : public NodeStore {
 public:
  MemoryStore(std::shared_ptr<SharedMap> map, std::string host) : m_(std::move(map)), host_(std::move(host)) {}
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    m_->values[key] = value;
    m_->changed.notify_all();
  }
  std::string get(const std::string& key) override {
    wait({key}, milliseconds(5000));
    std::lock_guard<std::mutex> lock(m_->mu);
    return m_->values.at(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    auto& v = m_->values[key];
    v = std::to_string((v.empty() ? 0 : std::stoll(v)) + delta);
    m_->changed.notify_all();
    return std::stoll(v);
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    const auto it = m_->values.find(key);
    if ((it == m_->values.end() && expected.empty()) || (it != m_->values.end() && it->second == expected))
      m_->values[key] = desired;
    m_->changed.notify_all();
    return m_->values[key];
  }
  bool check(const std::string& key) override {
    std::lock_guard<std::mutex> lock(m_->mu);
    return m_->values.count(key) > 0;
  }
  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(m_->mu);
    const bool all = m_->changed.wait_for(lock, timeout, [&] {
      for (const auto& k : keys)
        if (m_->values.count(k) == 0) return false;
      return true;
    });
    if (!all) throw std::runtime_error("store: wait timed out");
  }
  std::string local_host() override { return host_; }

 private:
  std::shared_ptr<SharedMap> m_;
  std::string host_;
};

ElasticOptions options(int min_nodes, int max_nodes) {
  ElasticOptions o;
  o.port = 29400;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.last_call = milliseconds(300);
  o.keepalive_timeout = milliseconds(400);
  o.join_timeout = milliseconds(10000);
  return o;
}

std::unique_ptr<ElasticRendezvous> node(const std::shared_ptr<SharedMap>& map, const std::string& host,
                                        const ElasticOptions& o) {
  return std::make_unique<ElasticRendezvous>(o, std::make_unique<MemoryStore>(map, host));
}

// Two nodes (min = max = 2) that have joined round 0, node a first, with
// `a_procs` and `b_procs` workers; their rounds.
struct TwoNodes {
  std::shared_ptr<SharedMap> map = std::make_shared<SharedMap>();
  std::unique_ptr<ElasticRendezvous> a = node(map, "hostA", options(2, 2));
  std::unique_ptr<ElasticRendezvous> b = node(map, "hostB", options(2, 2));
  NodeRendezvous::Round ra, rb;

  explicit TwoNodes(int a_procs = 1, int b_procs = 1) {
    auto first = std::async(std::launch::async, [&] { return a->next_round(a_procs); });
    {
      std::unique_lock<std::mutex> lock(map->mu);
      map->changed.wait_for(lock, milliseconds(5000), [&] { return map->values.count("elastic/r0/joined") > 0; });
    }
    rb = b->next_round(b_procs);
    ra = first.get();
  }
};

// Both nodes join; ranks follow the join order, the workers' store is at the
// first node's address, one port above the launchers'.
TEST(ElasticRounds, NodesAgreeOnOnePlacement) {
  TwoNodes n(3, 2);
  auto& a = n.a;
  const auto x = n.ra, y = n.rb;
  EXPECT_EQ(x.round, 0);
  EXPECT_EQ(y.round, 0);
  EXPECT_EQ(x.nodes, 2);
  EXPECT_EQ(x.world_size, 5);
  EXPECT_EQ(y.world_size, 5);
  EXPECT_EQ(x.node_index, 0);
  EXPECT_EQ(y.node_index, 1);
  EXPECT_EQ(x.first_rank, 0);
  EXPECT_EQ(y.first_rank, 3);
  EXPECT_EQ(x.master_addr, "hostA");
  EXPECT_EQ(y.master_addr, "hostA");
  EXPECT_EQ(x.master_port, 29401);
  EXPECT_EQ(a->interrupted(), "");
}

// A round with room closes at min_nodes once no node joined for last_call.
TEST(ElasticRounds, ClosesAtMinNodesAfterTheLastCall) {
  auto map = std::make_shared<SharedMap>();
  auto a = node(map, "hostA", options(1, 4));
  const auto start = std::chrono::steady_clock::now();
  const auto r = a->next_round(1);
  EXPECT_EQ(r.nodes, 1);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(300));
}

// A failure on one node ends the round on the other, counted once however
// many nodes report it; the next round forms again.
TEST(ElasticRounds, AFailureEndsTheRoundEverywhere) {
  TwoNodes n;
  auto &a = n.a, &b = n.b;
  EXPECT_EQ(a->fail_round("node 0: rank 0 exited with code 1"), 1);
  EXPECT_EQ(b->interrupted(), "node 0: rank 0 exited with code 1");
  EXPECT_EQ(b->fail_round("node 1: rank 1 exited with code 1"), 1);  // the same round: still one failure
  EXPECT_EQ(a->failures(), std::vector<std::string>{"round 0: node 0: rank 0 exited with code 1"});
  auto r2 = std::async(std::launch::async, [&] { return a->next_round(1); });
  EXPECT_EQ(b->next_round(1).round, 1);
  EXPECT_EQ(r2.get().round, 1);
}

// A node whose keep-alive stops changing is lost after keepalive_timeout.
TEST(ElasticRounds, ANodeThatStopsBeatingIsLost) {
  TwoNodes n;
  auto &a = n.a, &b = n.b;
  b->interrupted();  // b beats once, then never again
  std::string why;
  const auto start = std::chrono::steady_clock::now();
  while (why.empty() && std::chrono::steady_clock::now() - start < milliseconds(5000)) {
    why = a->interrupted();
    std::this_thread::sleep_for(milliseconds(50));
  }
  EXPECT_NE(why.find("node 1 stopped answering"), std::string::npos) << why;
  EXPECT_EQ(b->interrupted(), why);  // the round ended for everyone, with the first reason
}

// A node arriving at a full round waits; a round with room lets it in by
// ending, and the next round has every node.
TEST(ElasticRounds, AWaitingNodeEndsARoundWithRoom) {
  auto map = std::make_shared<SharedMap>();
  const auto o = options(1, 2);
  auto a = node(map, "hostA", o);
  EXPECT_EQ(a->next_round(1).nodes, 1);
  auto b = node(map, "hostB", o);
  auto rb = std::async(std::launch::async, [&] { return b->next_round(1); });
  std::string why;
  const auto start = std::chrono::steady_clock::now();
  while (why.empty() && std::chrono::steady_clock::now() - start < milliseconds(5000)) {
    why = a->interrupted();
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(why, "a node is waiting to join");
  const auto ra = a->next_round(1);
  const auto r = rb.get();
  EXPECT_EQ(ra.round, 1);
  EXPECT_EQ(r.round, 1);
  EXPECT_EQ(r.nodes, 2);
}

// abort() ends the job on every node: joining again says why.
TEST(ElasticRounds, AbortEndsTheJobEverywhere) {
  auto map = std::make_shared<SharedMap>();
  auto a = node(map, "hostA", options(1, 1));
  a->next_round(1);
  a->abort("a refused input");
  auto b = node(map, "hostB", options(1, 1));
  try {
    b->next_round(1);
    ADD_FAILURE() << "joined an aborted job";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the job was ended: a refused input"), std::string::npos) << e.what();
  }
}

}  // namespace elastic_test
}  // namespace scaletrain::launch

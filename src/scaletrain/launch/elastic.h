#pragma once
// The node-level rendezvous of elastic jobs (`scaletrain launch --nnodes
// MIN:MAX`): NodeRendezvous over a key-value store the launchers share
// (NodeStore). The store itself is comm's (comm/rendezvous_store.h, a c10d
// store); the CLI hands it in, so this layer stays torch-free.
//
// Note [Elastic rounds]
// The launchers of all nodes share one store at --master-addr:--master-port:
// the first launcher that can bind that address serves it (torchrun's c10d
// backend does the same); the others connect. That node must stay for the
// whole job. Keys live under "elastic/". A job is a sequence of rounds:
//  - Joining round R: a node takes a place with add("rR/joined", 1). The
//    round closes at max_nodes places, or at min_nodes or more once no node
//    joined for `last_call`; the first node to see that writes the count with
//    compareSet("rR/closed"), so all agree. A node whose place is beyond the
//    count is late: it says so (add "rR/waiting") and joins round R+1.
//  - Members publish "address<TAB>nproc" under "rR/node<i>"; ranks follow the
//    join order, so every node computes the same placement. The workers'
//    store is served by rank 0 on the first node's address, port + 1.
//  - While its workers run, each node beats ("rR/alive/<i>", a counter) and
//    watches the others: the round ends ("rR/end", first reason wins) when a
//    node reports a failure, when a node's beat stops changing for
//    `keepalive_timeout` (lost: killed, partitioned), or when a late node
//    waits and the round has room. Every member then stops its workers and
//    joins R+1, whose workers resume from the newest checkpoint under the
//    new world size.
//  - Failures are counted once per round ("rR/failed"), listed under
//    "failure/<k>"; "abort" ends the job on every node (a refused input, or
//    the restart budget spent); "done" says the job finished.
// Nodes are not ranked by address, so a round's placement can differ from
// the previous one's; checkpoints reload under any layout, so it need not
// match.
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "scaletrain/launch/launcher.h"

namespace scaletrain::launch {

// The launchers' shared store, as the rounds use it. Every call may throw
// (std::exception) when the store cannot be reached.
class NodeStore {
 public:
  virtual ~NodeStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::string get(const std::string& key) = 0;  // waits for the key up to the store's timeout
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets `key` to `desired` when it holds `expected` ("": when it is absent);
  // returns what it holds afterwards, so every caller learns the one winner.
  virtual std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) = 0;
  virtual bool check(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  virtual std::string local_host() = 0;  // this node's address as the other nodes reach it
};

struct ElasticOptions {
  // The launchers' store (--master-addr, --master-port); the workers' store
  // is at the first node's address, this port + 1.
  std::string host = "127.0.0.1";
  int port = 29500;
  int min_nodes = 1, max_nodes = 1;
  // A round with at least min_nodes closes once no node joined for this long.
  std::chrono::milliseconds last_call = std::chrono::seconds(3);
  // A member whose keep-alive has not changed for this long is lost.
  std::chrono::milliseconds keepalive_timeout = std::chrono::seconds(10);
  // How long a node waits for a round to form before it gives up.
  std::chrono::milliseconds join_timeout = std::chrono::seconds(600);
  // Shared secret of the store (SCALETRAIN_STORE_SECRET); may be empty.
  std::string secret;
};

class ElasticRendezvous : public NodeRendezvous {
 public:
  // `store` is the launchers' store at options.host:options.port.
  ElasticRendezvous(ElasticOptions options, std::unique_ptr<NodeStore> store);
  ~ElasticRendezvous() override;

  Round next_round(int nproc) override;
  std::string interrupted() override;
  int fail_round(const std::string& why) override;
  std::vector<std::string> failures() override;
  void succeeded() override;
  void abort(const std::string& why) override;

 private:
  std::string key(const std::string& k) const;        // "elastic/" + k
  std::string round_key(const std::string& k) const;  // "elastic/r<round>/" + k
  bool has(const std::string& k);
  std::string text(const std::string& k);
  int64_t counter(const std::string& k);  // add(k, 0)
  void end_round(const std::string& why);
  std::string store_gone(const std::exception& e) const;

  ElasticOptions o_;
  std::unique_ptr<NodeStore> store_;
  int next_ = 0;   // the round this node joins next
  Round current_;  // the round its workers run in
  int place_ = 0;  // 1-based place in current_ (join order)
  int64_t beat_ = 0;
  std::string lost_;  // set once the store failed: why (store_gone), so no round is tried after it
  // Last keep-alive value seen from each member, and when it changed.
  std::map<int, std::pair<int64_t, std::chrono::steady_clock::time_point>> seen_;
};

}  // namespace scaletrain::launch

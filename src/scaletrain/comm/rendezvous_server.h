// The rendezvous store's server: the listening socket, one thread serving
// every client with poll(), and the key/value map. Internal to
// RendezvousStore (see rendezvous_store.h); the wire protocol is in
// rendezvous_protocol.h.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "scaletrain/comm/rendezvous_protocol.h"
#include "scaletrain/comm/rendezvous_store.h"

namespace scaletrain::comm {

// ---------------------------------------------------------------------------
// Server: one thread, poll() over the listening socket, a wake-up eventfd and
// every client. All state below the thread is touched only by that thread.
class RendezvousStore::Server {
 public:
  explicit Server(const Options& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const { return port_; }
  // True when the bound address is a wildcard; `v6` tells which family.
  bool wildcard() const { return wildcard_; }
  bool v6() const { return v6_; }

 private:
  struct Client {
    rdzv::UniqueFd fd;
    rdzv::Bytes in;     // bytes received, not yet parsed
    size_t in_off = 0;  // start of the unparsed bytes in `in`
    rdzv::Bytes out;    // replies not yet written (socket was full)
    size_t out_off = 0;
    bool hello = false;   // handshake done
    bool closed = false;  // to be dropped at the end of this loop turn
    rdzv::Clock::time_point accepted;  // the hello is due hello_timeout after this
  };
  // A blocking request (get, wait, wait-for-workers) not yet answerable.
  struct Waiter {
    rdzv::Op op;
    std::vector<std::string> keys;
    int64_t workers = 0;
    rdzv::Deadline deadline;
  };

  void run();
  bool loopOnce();
  void acceptAll();
  bool readFrom(Client& c);
  void flush(Client& c);
  void parse(uint64_t id, Client& c);
  void handle(uint64_t id, Client& c, rdzv::Reader& r);
  void reply(Client& c, rdzv::Writer& w);
  void close(uint64_t id, Client& c);
  void dropWaiter(uint64_t id);
  void setKey(const std::string& key, rdzv::Bytes value);
  // Whether setting `key` to a value of `bytes` keeps the map within max_data_bytes.
  bool fits(const std::string& key, size_t bytes) const;
  void expireHellos();
  // Drops the consumed prefix of a client's input, keeping in_bytes_ true.
  void compact(Client& c);
  bool hasAll(const std::vector<std::string>& keys) const;
  void addWaiter(uint64_t id, Waiter w);
  void tryComplete(uint64_t id);
  void finishWaiter(uint64_t id, rdzv::Writer& reply_frame);
  void expireWaiters();

  const Options options_;
  std::string where_;  // "host:port" for log lines
  rdzv::UniqueFd listen_fd_;
  rdzv::UniqueFd wake_fd_;  // written by the destructor to stop the loop
  uint16_t port_ = 0;
  bool wildcard_ = false;
  bool v6_ = false;

  std::map<std::string, rdzv::Bytes> data_;
  std::map<uint64_t, Client> clients_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Waiter> waiters_;                     // by client id: one per client
  std::map<std::string, std::set<uint64_t>> key_waiters_;  // key -> clients
  std::deque<uint64_t> ready_;                             // clients whose buffered requests may go on
  int64_t joined_ = 0;                                     // clients that joined counting as workers
  int64_t in_bytes_ = 0;    // request bytes buffered over all clients (max_buffered_bytes)
  int64_t data_bytes_ = 0;  // bytes of keys and values in data_ (max_data_bytes)

  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace scaletrain::comm

// RendezvousStore: a c10d::Store over TCP whose server listens on exactly the
// address the user gives (MASTER_ADDR), never on every interface.
//
// Why our own store: libtorch 1.13's c10d::TCPStore server always binds the
// wildcard address, so a rendezvous meant for a private interconnect is also
// reachable from every other network the master is on. This store resolves
// `host` with getaddrinfo and binds that address only (IPv4 or IPv6). A
// wildcard ("0.0.0.0", "::") is bound only if the user literally passes it.
//
// Shape: every RendezvousStore is a client (one TCP connection, a mutex around
// it). Constructed with is_server = true it also owns the server: one thread
// that serves all clients with poll() and keeps the key/value map. The server
// answers blocking get/wait requests when their keys appear (a list of pending
// waiters, no polling) and answers "timed out" itself when their deadline
// passes. See Note [Rendezvous wire protocol] in rendezvous_protocol.h.
//
// Works as the store for c10d::ProcessGroupGloo and through c10d::PrefixStore.
// It compiles against libtorch 1.13 and 2.x: it overrides only what 1.13's
// Store declares, and adds clone() (pure in recent 2.x) without `override`.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace scaletrain::comm {

// Every failure of the store (timeout, lost server, bad address, bad value)
// is one of these; the message names the operation, the key(s) and the
// address, e.g. "rendezvous store 10.0.0.1:29500: timed out after 30s
// waiting for key 'rank3'".
class RendezvousStoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RendezvousStoreOptions {
  // Address the server binds and clients connect to (MASTER_ADDR): a numeric
  // IPv4/IPv6 address or a host name resolved with getaddrinfo. The server
  // binds the first resolved address that it can bind; never the wildcard
  // unless this is literally "0.0.0.0" or "::".
  std::string host = "127.0.0.1";
  // TCP port (MASTER_PORT). 0 lets the server pick a free port (read it back
  // with RendezvousStore::port()); clients need the real port.
  uint16_t port = 29500;
  // True on exactly one process (usually rank 0): it runs the server thread
  // in addition to being a client.
  bool is_server = false;
  // Number of processes expected to connect, counting the server's own
  // client; <= 0 means unknown. Used only with wait_for_workers.
  int world_size = -1;
  // Server only: the constructor blocks until world_size clients have joined
  // (or `timeout` passes), so the caller knows every rank reached the store.
  bool wait_for_workers = false;
  // Whether this client counts toward world_size when it joins. clone()
  // turns it off so extra connections of one rank do not count twice.
  bool counts_as_worker = true;
  // How long a client keeps retrying to connect: workers may start before
  // the server is listening, so refused connections are retried until then.
  std::chrono::milliseconds connect_timeout = std::chrono::seconds(300);
  // Default deadline of every operation: get/wait block at most this long
  // (wait(keys, timeout) overrides it per call). Becomes Store::getTimeout().
  // c10d::Store::kNoTimeout (0) means wait forever.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  // Server only: listen(2) backlog; large worlds connect all at once.
  int listen_backlog = 2048;
  // Largest request or reply frame accepted, in bytes. A bigger frame means
  // a confused peer (or not our protocol) and closes that connection. The
  // values the job stores are small (Gloo addresses, NCCL ids, collective
  // fingerprints, elastic rendezvous records: at most a few KiB), so 1 MiB
  // leaves room without letting one peer make the server buffer much.
  uint32_t max_frame_bytes = 1u << 20;
  // Shared secret (SCALETRAIN_STORE_SECRET; `scaletrain launch` generates one
  // for its workers). A client presents it in its hello; with a non-empty
  // secret the server closes a connection whose hello does not carry the
  // same one, before that connection can read or change anything. Empty on
  // the server: no authentication. At most 256 bytes.
  std::string secret;
  // Server only: connections served at once (authenticated or not). One
  // more is accepted and closed at once, so a flood cannot exhaust the
  // server's descriptors or memory.
  int max_connections = 8192;
  // Server only: a connection must complete its hello within this time, or
  // it is closed (an idle unauthenticated socket holds nothing for long).
  std::chrono::milliseconds hello_timeout = std::chrono::seconds(10);
  // Server only: bytes of request data buffered over all connections, and
  // bytes of keys plus values held in the map. Past the first the
  // connection that would exceed it is closed; past the second a write is
  // refused with an error ("store full").
  int64_t max_buffered_bytes = 256LL << 20;
  int64_t max_data_bytes = 256LL << 20;
};

namespace detail {
// Owns one file descriptor; closes it on destruction (RAII for sockets).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};
}  // namespace detail

class RendezvousStore : public c10d::Store {
 public:
  using Options = RendezvousStoreOptions;

  // Server mode: binds host:port (throws if it cannot), starts the server
  // thread, then connects its own client. Client mode: connects, retrying
  // until connect_timeout. Throws RendezvousStoreError on failure.
  explicit RendezvousStore(Options options);
  // Closes the client connection; in server mode stops and joins the server
  // thread and closes its sockets. Other clients then see "connection lost".
  ~RendezvousStore() override;

  RendezvousStore(const RendezvousStore&) = delete;
  RendezvousStore& operator=(const RendezvousStore&) = delete;

  // --- c10d::Store (the methods libtorch 1.13 declares) ---
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  // Blocks until the key exists or getTimeout() passes, like c10d's stores.
  std::vector<uint8_t> get(const std::string& key) override;
  // Values written by add are decimal text, as in c10d::TCPStore, so get()
  // on a counter returns e.g. "42". Adding to a non-integer value throws.
  int64_t add(const std::string& key, int64_t value) override;
  // Sets `newValue` if the key holds `currentValue` (or is absent and
  // `currentValue` is empty); returns the value the key holds afterwards.
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                  const std::vector<uint8_t>& newValue) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // A new client connected to the same server (a separate connection, so
  // it does not share this object's mutex). Recent libtorch 2.x declares
  // Store::clone() pure virtual; 1.13 does not have it, hence no `override`.
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Winconsistent-missing-override"
#elif defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsuggest-override"
#endif
  c10::intrusive_ptr<c10d::Store> clone();
#if defined(__clang__)
#pragma clang diagnostic pop
#elif defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

  // --- scaletrain additions ---
  // The real port: differs from Options::port when that was 0.
  uint16_t port() const { return port_; }
  const std::string& host() const { return options_.host; }
  // "host:port" ("[v6addr]:port" for IPv6), as used in error messages.
  std::string address() const;
  bool isServer() const { return server_ != nullptr; }
  // Makes a request blocked on this connection (in another thread) fail at
  // once, and every later one too: how a thread waiting on the store is
  // stopped. The server, if this object owns it, keeps serving others.
  void interrupt();
  // The local address of this client's connection ("10.0.0.2"): the
  // interface this host uses to reach the server.
  std::string localHost() const;

 private:
  class Server;
  struct Reply;

  // Sends one request and reads its reply under mutex_. `what` describes
  // the operation for error messages ("set of key 'a'").
  Reply roundTrip(const std::vector<uint8_t>& request, const std::string& what,
                  std::chrono::milliseconds reply_timeout);
  void connectLocked();
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void failBroken(const std::string& what, const std::string& why);
  void waitForWorkers();

  Options options_;
  uint16_t port_ = 0;
  // Host the client dials: options_.host, or loopback when the server bound
  // a wildcard address (a wildcard is not something to connect to).
  std::string connect_host_;
  // Declared before the connection so it is destroyed after it: the server
  // outlives our own client's socket.
  std::unique_ptr<Server> server_;
  std::mutex mutex_;  // guards fd_ and broken_: one request in flight
  detail::UniqueFd fd_;
  // Set once the connection failed mid-request: the byte stream may be out
  // of step, so every later operation fails fast with this reason.
  std::string broken_;
};

}  // namespace scaletrain::comm

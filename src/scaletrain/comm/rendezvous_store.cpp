#include "scaletrain/comm/rendezvous_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

// Note [Rendezvous wire protocol]
// A message is a frame: a 4-byte big-endian body length, then the body. A
// request body is an opcode byte and its fields; a reply body is a status
// byte (ok, timeout, error) and that status's fields. Integers are
// big-endian (u32, i64); a string or value is a u32 length and its bytes; a
// key list is a u32 count and that many strings.
//   request                                 ok reply
//   kHello    u32 magic, u32 version, u8 counts_as_worker   -
//   kSet      key, value                    -
//   kGet      key, i64 timeout_ms           value     (blocks on the server)
//   kAdd      key, i64 delta                i64 new value
//   kCompareSet key, expected, desired      value held afterwards
//   kDelete   key                           u8 existed
//   kCheck    keys                          u8 all exist
//   kNumKeys  -                             i64
//   kWait     keys, i64 timeout_ms          -         (blocks on the server)
//   kWaitWorkers i64 count, i64 timeout_ms  -         (blocks on the server)
// A timeout reply carries the keys still missing (kWaitWorkers: i64 joined);
// an error reply carries a message. timeout_ms <= 0 means no deadline.
// A client has one request in flight. While a client's blocking request is
// pending, the server still reads its socket (to notice a disconnect) but
// parses nothing more from it, so replies stay in request order.
// Blocking requests time out on the server, which answers "timeout" and the
// connection stays usable. The client waits a grace period longer; hearing
// nothing by then means the server is stuck, and the connection is dropped.

namespace scaletrain::comm {

namespace detail {
void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}
}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;
using Deadline = std::optional<Clock::time_point>;
using detail::UniqueFd;

constexpr uint32_t kMagic = 0x53545256;  // "STRV": refuses foreign peers
constexpr uint32_t kVersion = 1;

enum Op : uint8_t {
  kHello = 1, kSet, kGet, kAdd, kCompareSet, kDelete, kCheck, kNumKeys,
  kWait, kWaitWorkers,
};
enum Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

struct ProtocolError : RendezvousStoreError {
  using RendezvousStoreError::RendezvousStoreError;
};

// Builds one frame; the first 4 bytes are filled with the length by take().
class Writer {
 public:
  Writer() : buf_(4, 0) {}
  Writer& u8(uint8_t v) { buf_.push_back(v); return *this; }
  Writer& u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) buf_.push_back(uint8_t(v >> s));
    return *this;
  }
  Writer& i64(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int s = 56; s >= 0; s -= 8) buf_.push_back(uint8_t(u >> s));
    return *this;
  }
  Writer& bytes(const uint8_t* p, size_t n) {
    if (n > UINT32_MAX) throw ProtocolError("value larger than 4 GiB");
    u32(static_cast<uint32_t>(n));
    buf_.insert(buf_.end(), p, p + n);
    return *this;
  }
  Writer& str(const std::string& s) {
    return bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  Writer& blob(const Bytes& b) { return bytes(b.data(), b.size()); }
  Writer& keys(const std::vector<std::string>& ks) {
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) str(k);
    return *this;
  }
  Bytes take() {
    const size_t n = buf_.size() - 4;
    for (int i = 0; i < 4; ++i) buf_[i] = uint8_t(n >> (24 - 8 * i));
    return std::move(buf_);
  }

 private:
  Bytes buf_;
};

// Reads fields of one frame body; throws ProtocolError when it runs short.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  uint8_t u8() { return *take(1); }
  uint32_t u32() {
    const uint8_t* p = take(4);
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 |
        p[3];
  }
  int64_t i64() {
    const uint8_t* p = take(8);
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u = u << 8 | p[i];
    return static_cast<int64_t>(u);
  }
  Bytes blob() {
    const uint32_t n = u32();
    const uint8_t* p = take(n);
    return Bytes(p, p + n);
  }
  std::string str() {
    const uint32_t n = u32();
    return std::string(reinterpret_cast<const char*>(take(n)), n);
  }
  std::vector<std::string> keys() {
    const uint32_t n = u32();
    // Each key needs at least its 4-byte length: a huge count is garbage.
    if (n > size_t(end_ - p_) / 4) throw ProtocolError("malformed key list");
    std::vector<std::string> ks;
    ks.reserve(n);
    for (uint32_t i = 0; i < n; ++i) ks.push_back(str());
    return ks;
  }
  void expectEnd() const {
    if (p_ != end_) throw ProtocolError("trailing bytes in frame");
  }

 private:
  const uint8_t* take(size_t n) {
    if (size_t(end_ - p_) < n) throw ProtocolError("truncated frame");
    const uint8_t* p = p_;
    p_ += n;
    return p;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

uint32_t frameLength(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 |
      p[3];
}

std::string errnoText(int err) { return std::strerror(err); }

std::string joinHostPort(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos)
    return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

std::string formatDuration(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return std::to_string(d.count() / 1000) + "s";
  return std::to_string(d.count()) + "ms";
}

// "key 'a'" or "keys 'a', 'b'"; long lists are cut so messages stay short.
std::string describeKeys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 8;
  std::string s = keys.size() == 1 ? "key " : "keys ";
  for (size_t i = 0; i < keys.size() && i < kShown; ++i)
    s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > kShown)
    s += ", ... (" + std::to_string(keys.size() - kShown) + " more)";
  return s;
}

int64_t wireTimeout(std::chrono::milliseconds t) {
  return t.count() <= 0 ? 0 : static_cast<int64_t>(t.count());
}

Deadline deadlineAfter(std::chrono::milliseconds t) {
  if (t.count() <= 0) return std::nullopt;  // kNoTimeout: wait forever
  return Clock::now() + t;
}

// Milliseconds poll() may sleep before `deadline`; -1 means forever.
int pollTimeout(const Deadline& deadline) {
  if (!deadline) return -1;
  auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
}

void setFlag(int fd, int level, int name) {
  int one = 1;
  ::setsockopt(fd, level, name, &one, sizeof(one));
}

// Blocking-with-deadline I/O on a non-blocking socket. They return "" on
// success, otherwise why they failed.
std::string sendAll(int fd, const uint8_t* p, size_t n, const Deadline& dl) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= size_t(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return errnoText(errno);
    pollfd pfd{fd, POLLOUT, 0};
    int rc = ::poll(&pfd, 1, pollTimeout(dl));
    if (rc == 0) return "timed out sending";
    if (rc < 0 && errno != EINTR) return errnoText(errno);
  }
  return "";
}

std::string recvAll(int fd, uint8_t* p, size_t n, const Deadline& dl) {
  while (n > 0) {
    ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= size_t(k);
      continue;
    }
    if (k == 0) return "connection closed by the server";
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errnoText(errno);
    pollfd pfd{fd, POLLIN, 0};
    int rc = ::poll(&pfd, 1, pollTimeout(dl));
    if (rc == 0) return "timeout";
    if (rc < 0 && errno != EINTR) return errnoText(errno);
  }
  return "";
}

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { ::freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves host:port for TCP; on failure returns null and sets `error`.
AddrInfoPtr resolve(const std::string& host, uint16_t port, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    error = std::string("cannot resolve '") + host + "': " + ::gai_strerror(rc);
    return nullptr;
  }
  return AddrInfoPtr(res);
}

std::string numericHost(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST] = {0};
  if (::getnameinfo(sa, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0)
    return "?";
  return buf;
}

// One connect attempt, bounded by `dl`. Returns the socket or sets `error`.
UniqueFd tryConnect(const addrinfo& ai, const Deadline& dl, std::string& error) {
  UniqueFd fd(::socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    error = errnoText(errno);
    return {};
  }
  if (::connect(fd.get(), ai.ai_addr, ai.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      error = errnoText(errno);
      return {};
    }
    pollfd pfd{fd.get(), POLLOUT, 0};
    int rc;
    do {
      rc = ::poll(&pfd, 1, pollTimeout(dl));
    } while (rc < 0 && errno == EINTR);
    int err = 0;
    socklen_t len = sizeof(err);
    if (rc == 0) err = ETIMEDOUT;
    else if (rc < 0) err = errno;
    else ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      error = errnoText(err);
      return {};
    }
  }
  // Note [TCP self-connect]: dialing a local port nobody listens on can,
  // rarely, "connect" a socket to itself (simultaneous open) when the kernel
  // picks the same ephemeral port. Such a socket talks to nobody; retry.
  sockaddr_storage self{}, peer{};
  socklen_t self_len = sizeof(self), peer_len = sizeof(peer);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&self), &self_len);
  ::getpeername(fd.get(), reinterpret_cast<sockaddr*>(&peer), &peer_len);
  if (self_len == peer_len && std::memcmp(&self, &peer, self_len) == 0) {
    error = "connected to itself (no server listening)";
    return {};
  }
  setFlag(fd.get(), IPPROTO_TCP, TCP_NODELAY);  // small request/reply frames
  setFlag(fd.get(), SOL_SOCKET, SO_KEEPALIVE);  // notice a vanished machine
  return fd;
}

}  // namespace

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
    UniqueFd fd;
    Bytes in;            // bytes received, not yet parsed
    size_t in_off = 0;   // start of the unparsed bytes in `in`
    Bytes out;           // replies not yet written (socket was full)
    size_t out_off = 0;
    bool hello = false;  // handshake done
    bool closed = false; // to be dropped at the end of this loop turn
  };
  // A blocking request (get, wait, wait-for-workers) not yet answerable.
  struct Waiter {
    Op op;
    std::vector<std::string> keys;
    int64_t workers = 0;
    Deadline deadline;
  };

  void run();
  bool loopOnce();
  void acceptAll();
  bool readFrom(Client& c);
  void flush(Client& c);
  void parse(uint64_t id, Client& c);
  void handle(uint64_t id, Client& c, Reader& r);
  void reply(Client& c, Writer& w);
  void close(uint64_t id, Client& c);
  void dropWaiter(uint64_t id);
  void setKey(const std::string& key, Bytes value);
  bool hasAll(const std::vector<std::string>& keys) const;
  void addWaiter(uint64_t id, Waiter w);
  void tryComplete(uint64_t id);
  void finishWaiter(uint64_t id, Writer& reply_frame);
  void expireWaiters();

  const Options options_;
  std::string where_;  // "host:port" for log lines
  UniqueFd listen_fd_;
  UniqueFd wake_fd_;   // written by the destructor to stop the loop
  uint16_t port_ = 0;
  bool wildcard_ = false;
  bool v6_ = false;

  std::map<std::string, Bytes> data_;
  std::map<uint64_t, Client> clients_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Waiter> waiters_;  // by client id: one per client
  std::map<std::string, std::set<uint64_t>> key_waiters_;  // key -> clients
  std::deque<uint64_t> ready_;  // clients whose buffered requests may go on
  int64_t joined_ = 0;          // clients that joined counting as workers

  std::thread thread_;  // last: starts after everything above exists
};

RendezvousStore::Server::Server(const Options& options) : options_(options) {
  std::string error;
  AddrInfoPtr addrs = resolve(options_.host, options_.port, error);
  // Bind the first resolved address that works; never a wildcard we made up.
  for (addrinfo* ai = addrs.get(); ai && !listen_fd_.valid(); ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    bool ok = fd.valid();
    if (ok) {
      // Restarting right after a run must not fail on TIME_WAIT connections.
      setFlag(fd.get(), SOL_SOCKET, SO_REUSEADDR);
      // "::" must mean IPv6 only, not every IPv4 address too.
      if (ai->ai_family == AF_INET6) setFlag(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY);
      ok = ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 &&
          ::listen(fd.get(), options_.listen_backlog) == 0;
    }
    if (!ok) {
      const int err = errno;
      error += (error.empty() ? "" : "; ") + numericHost(ai->ai_addr, ai->ai_addrlen) +
          ": " + errnoText(err);
      continue;
    }
    listen_fd_ = std::move(fd);
  }
  where_ = joinHostPort(options_.host, options_.port);
  if (!listen_fd_.valid())
    throw RendezvousStoreError(
        "rendezvous store " + where_ + ": cannot listen: " + error);

  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(listen_fd_.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  if (bound.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&bound);
    port_ = ntohs(a->sin6_port);
    wildcard_ = IN6_IS_ADDR_UNSPECIFIED(&a->sin6_addr);
    v6_ = true;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&bound);
    port_ = ntohs(a->sin_port);
    wildcard_ = a->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  where_ = joinHostPort(options_.host, port_);
  wake_fd_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_.valid())
    throw RendezvousStoreError("rendezvous store " + where_ +
                               ": eventfd failed: " + errnoText(errno));
  thread_ = std::thread([this] { run(); });
}

RendezvousStore::Server::~Server() {
  uint64_t one = 1;
  if (::write(wake_fd_.get(), &one, sizeof(one)) < 0) {
    // An eventfd write only fails if the counter overflows; the loop is
    // already awake then.
  }
  if (thread_.joinable()) thread_.join();
}

void RendezvousStore::Server::run() {
  try {
    while (loopOnce()) {
    }
  } catch (const std::exception& e) {
    std::cerr << "scaletrain: rendezvous store server " << where_
              << " stopped: " << e.what() << std::endl;
  }
  // Closing every socket turns a stopped server into a clear "connection
  // lost" on the clients instead of a hang.
  clients_.clear();
  listen_fd_.reset();
}

bool RendezvousStore::Server::loopOnce() {
  std::vector<pollfd> fds{{wake_fd_.get(), POLLIN, 0}, {listen_fd_.get(), POLLIN, 0}};
  std::vector<uint64_t> ids;
  for (auto& [id, c] : clients_) {
    short events = POLLIN;
    if (c.out_off < c.out.size()) events |= POLLOUT;
    fds.push_back({c.fd.get(), events, 0});
    ids.push_back(id);
  }
  Deadline next;
  for (auto& [id, w] : waiters_)
    if (w.deadline && (!next || *w.deadline < *next)) next = w.deadline;

  int rc = ::poll(fds.data(), fds.size(), pollTimeout(next));
  if (rc < 0) {
    if (errno == EINTR) return true;
    throw std::runtime_error("poll: " + errnoText(errno));
  }
  if (fds[0].revents != 0) return false;  // stop requested
  if (fds[1].revents != 0) acceptAll();
  for (size_t i = 0; i < ids.size(); ++i) {
    const short ev = fds[i + 2].revents;
    auto it = clients_.find(ids[i]);
    if (ev == 0 || it == clients_.end() || it->second.closed) continue;
    Client& c = it->second;
    if (ev & POLLOUT) flush(c);
    if (ev & (POLLIN | POLLHUP | POLLERR)) {
      const bool eof = readFrom(c);
      parse(ids[i], c);  // requests sent just before a close still count
      if (eof) close(ids[i], c);
    }
  }
  expireWaiters();
  while (!ready_.empty()) {
    const uint64_t id = ready_.front();
    ready_.pop_front();
    auto it = clients_.find(id);
    if (it != clients_.end() && !it->second.closed) parse(id, it->second);
  }
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (!it->second.closed) {
      ++it;
      continue;
    }
    dropWaiter(it->first);
    it = clients_.erase(it);
  }
  return true;
}

void RendezvousStore::Server::acceptAll() {
  while (true) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE) {
        // Out of descriptors: back off instead of spinning on a readable
        // listening socket; the pending connection waits in the backlog.
        std::cerr << "scaletrain: rendezvous store server " << where_
                  << ": accept: " << errnoText(err) << std::endl;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return;
    }
    setFlag(fd, IPPROTO_TCP, TCP_NODELAY);
    clients_[next_id_++].fd = UniqueFd(fd);
  }
}

// Reads what is available. Returns true when the peer closed or failed.
bool RendezvousStore::Server::readFrom(Client& c) {
  uint8_t buf[65536];
  for (int round = 0; round < 16; ++round) {  // bounded: be fair to others
    ssize_t k = ::recv(c.fd.get(), buf, sizeof(buf), 0);
    if (k > 0) {
      c.in.insert(c.in.end(), buf, buf + k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    return !(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }
  return false;
}

void RendezvousStore::Server::flush(Client& c) {
  while (c.out_off < c.out.size()) {
    ssize_t k = ::send(c.fd.get(), c.out.data() + c.out_off,
                       c.out.size() - c.out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      c.out_off += size_t(k);
    } else if (k < 0 && errno == EINTR) {
      continue;
    } else {
      if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) c.closed = true;
      return;  // full: POLLOUT resumes; or broken: dropped this turn
    }
  }
  c.out.clear();
  c.out_off = 0;
}

void RendezvousStore::Server::reply(Client& c, Writer& w) {
  Bytes frame = w.take();
  c.out.insert(c.out.end(), frame.begin(), frame.end());
  flush(c);
}

void RendezvousStore::Server::close(uint64_t id, Client& c) {
  c.closed = true;
  dropWaiter(id);
}

void RendezvousStore::Server::dropWaiter(uint64_t id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  for (const auto& k : it->second.keys) {
    auto kw = key_waiters_.find(k);
    if (kw == key_waiters_.end()) continue;
    kw->second.erase(id);
    if (kw->second.empty()) key_waiters_.erase(kw);
  }
  waiters_.erase(it);
}

void RendezvousStore::Server::parse(uint64_t id, Client& c) {
  while (!c.closed && waiters_.count(id) == 0) {
    const size_t avail = c.in.size() - c.in_off;
    if (avail < 4) break;
    const uint32_t len = frameLength(c.in.data() + c.in_off);
    if (len > options_.max_frame_bytes || len == 0) {
      close(id, c);  // not our protocol, or a confused peer
      break;
    }
    if (avail < 4 + size_t(len)) break;
    Reader r(c.in.data() + c.in_off + 4, len);
    c.in_off += 4 + size_t(len);
    try {
      handle(id, c, r);
    } catch (const ProtocolError&) {
      close(id, c);
    }
  }
  if (c.in_off == c.in.size()) {
    c.in.clear();
    c.in_off = 0;
  } else if (c.in_off > (1u << 16)) {
    c.in.erase(c.in.begin(), c.in.begin() + long(c.in_off));
    c.in_off = 0;
  }
  // A well-behaved client sends nothing while it waits; cap what we buffer.
  if (c.in.size() > size_t(options_.max_frame_bytes) + 4) close(id, c);
}

void RendezvousStore::Server::handle(uint64_t id, Client& c, Reader& r) {
  const auto op = static_cast<Op>(r.u8());
  Writer w;
  if (!c.hello && op != kHello) throw ProtocolError("no handshake");
  switch (op) {
    case kHello: {
      const uint32_t magic = r.u32(), version = r.u32();
      const bool counts = r.u8() != 0;
      r.expectEnd();
      if (magic != kMagic || version != kVersion) {
        w.u8(kError).str("protocol mismatch (server speaks version " +
                         std::to_string(kVersion) + ")");
        reply(c, w);
        close(id, c);
        return;
      }
      c.hello = true;
      reply(c, w.u8(kOk));
      if (counts) {
        ++joined_;
        std::vector<uint64_t> ids;
        for (auto& [wid, waiter] : waiters_)
          if (waiter.op == kWaitWorkers) ids.push_back(wid);
        for (uint64_t wid : ids) tryComplete(wid);
      }
      return;
    }
    case kSet: {
      std::string key = r.str();
      Bytes value = r.blob();
      r.expectEnd();
      reply(c, w.u8(kOk));
      setKey(key, std::move(value));
      return;
    }
    case kGet: {
      std::string key = r.str();
      const int64_t ms = r.i64();
      r.expectEnd();
      auto it = data_.find(key);
      if (it != data_.end()) return reply(c, w.u8(kOk).blob(it->second));
      Waiter waiter{kGet, {key}, 0, deadlineAfter(std::chrono::milliseconds(ms))};
      return addWaiter(id, std::move(waiter));
    }
    case kAdd: {
      std::string key = r.str();
      const int64_t delta = r.i64();
      r.expectEnd();
      int64_t current = 0;
      auto it = data_.find(key);
      if (it != data_.end()) {
        const std::string text(it->second.begin(), it->second.end());
        size_t used = 0;
        try {
          current = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size())
          return reply(c, w.u8(kError).str("add: value of key '" + key +
                                           "' is not an integer"));
      }
      const int64_t next = current + delta;
      const std::string text = std::to_string(next);
      reply(c, w.u8(kOk).i64(next));
      setKey(key, Bytes(text.begin(), text.end()));
      return;
    }
    case kCompareSet: {
      std::string key = r.str();
      Bytes expected = r.blob(), desired = r.blob();
      r.expectEnd();
      // Same rule as c10d::TCPStore: an absent key counts as holding "".
      auto it = data_.find(key);
      const bool matches = it == data_.end() ? expected.empty() : it->second == expected;
      if (!matches) {
        return reply(c, w.u8(kOk).blob(it == data_.end() ? expected : it->second));
      }
      reply(c, w.u8(kOk).blob(desired));
      setKey(key, std::move(desired));
      return;
    }
    case kDelete: {
      std::string key = r.str();
      r.expectEnd();
      return reply(c, w.u8(kOk).u8(data_.erase(key) ? 1 : 0));
    }
    case kCheck: {
      auto keys = r.keys();
      r.expectEnd();
      return reply(c, w.u8(kOk).u8(hasAll(keys) ? 1 : 0));
    }
    case kNumKeys:
      r.expectEnd();
      return reply(c, w.u8(kOk).i64(static_cast<int64_t>(data_.size())));
    case kWait: {
      auto keys = r.keys();
      const int64_t ms = r.i64();
      r.expectEnd();
      if (hasAll(keys)) return reply(c, w.u8(kOk));
      Waiter waiter{kWait, std::move(keys), 0, deadlineAfter(std::chrono::milliseconds(ms))};
      return addWaiter(id, std::move(waiter));
    }
    case kWaitWorkers: {
      const int64_t count = r.i64(), ms = r.i64();
      r.expectEnd();
      if (joined_ >= count) return reply(c, w.u8(kOk));
      Waiter waiter{kWaitWorkers, {}, count, deadlineAfter(std::chrono::milliseconds(ms))};
      return addWaiter(id, std::move(waiter));
    }
  }
  throw ProtocolError("unknown opcode");
}

void RendezvousStore::Server::setKey(const std::string& key, Bytes value) {
  data_[key] = std::move(value);
  auto it = key_waiters_.find(key);
  if (it == key_waiters_.end()) return;
  const std::vector<uint64_t> ids(it->second.begin(), it->second.end());
  for (uint64_t id : ids) tryComplete(id);  // may erase from key_waiters_
}

bool RendezvousStore::Server::hasAll(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [this](const std::string& k) { return data_.count(k) != 0; });
}

void RendezvousStore::Server::addWaiter(uint64_t id, Waiter w) {
  for (const auto& k : w.keys) key_waiters_[k].insert(id);
  waiters_[id] = std::move(w);
}

void RendezvousStore::Server::tryComplete(uint64_t id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  const Waiter& w = it->second;
  Writer reply_frame;
  if (w.op == kWaitWorkers) {
    if (joined_ < w.workers) return;
    reply_frame.u8(kOk);
  } else {
    if (!hasAll(w.keys)) return;
    reply_frame.u8(kOk);
    if (w.op == kGet) reply_frame.blob(data_.at(w.keys.front()));
  }
  finishWaiter(id, reply_frame);
}

// Answers a client's pending blocking request and lets its queued bytes be
// parsed again (later, from the loop, to keep this call non-reentrant).
void RendezvousStore::Server::finishWaiter(uint64_t id, Writer& reply_frame) {
  auto c = clients_.find(id);
  if (c == clients_.end() || c->second.closed) return dropWaiter(id);
  dropWaiter(id);
  reply(c->second, reply_frame);
  ready_.push_back(id);
}

void RendezvousStore::Server::expireWaiters() {
  const auto now = Clock::now();
  std::vector<uint64_t> expired;
  for (auto& [id, w] : waiters_)
    if (w.deadline && *w.deadline <= now) expired.push_back(id);
  for (uint64_t id : expired) {
    const Waiter& w = waiters_.at(id);
    Writer reply_frame;
    reply_frame.u8(kTimeout);
    if (w.op == kWaitWorkers) {
      reply_frame.i64(joined_);
    } else {
      std::vector<std::string> missing;
      for (const auto& k : w.keys)
        if (!data_.count(k)) missing.push_back(k);
      reply_frame.keys(missing);
    }
    finishWaiter(id, reply_frame);
  }
}

// ---------------------------------------------------------------------------
// Client.

struct RendezvousStore::Reply {
  Status status;
  Bytes body;  // the whole reply body; fields start after the status byte
  Reader fields() const { return Reader(body.data() + 1, body.size() - 1); }
};

namespace {
// How much longer than the server-side deadline the client waits for the
// server's own "timed out" answer before it calls the server unresponsive.
std::chrono::milliseconds replyGrace(std::chrono::milliseconds t) {
  using std::chrono::milliseconds;
  return std::clamp<milliseconds>(t / 10, milliseconds(1000), milliseconds(30000));
}
std::chrono::milliseconds withGrace(std::chrono::milliseconds t) {
  return t.count() <= 0 ? t : t + replyGrace(t);
}
}  // namespace

RendezvousStore::RendezvousStore(Options options)
    : c10d::Store(options.timeout), options_(std::move(options)) {
  if (options_.host.empty())
    throw RendezvousStoreError(
        "rendezvous store: empty host; give the master address (MASTER_ADDR)");
  port_ = options_.port;
  connect_host_ = options_.host;
  if (options_.is_server) {
    server_ = std::make_unique<Server>(options_);
    port_ = server_->port();
    if (server_->wildcard()) connect_host_ = server_->v6() ? "::1" : "127.0.0.1";
  } else if (port_ == 0) {
    fail("port 0 is only meaningful for the server; clients need its real port");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    connectLocked();
  }
  if (options_.is_server && options_.wait_for_workers && options_.world_size > 0)
    waitForWorkers();
}

// Members go in reverse order: the client socket closes, then the server
// stops and joins (see the member order in the header).
RendezvousStore::~RendezvousStore() = default;

std::string RendezvousStore::address() const {
  return joinHostPort(options_.host, port_);
}

void RendezvousStore::fail(const std::string& message) const {
  throw RendezvousStoreError("rendezvous store " + address() + ": " + message);
}

void RendezvousStore::failBroken(const std::string& what, const std::string& why) {
  broken_ = why;
  fd_.reset();
  fail("connection lost during " + what + ": " + why +
       " (did the server process exit?)");
}

void RendezvousStore::connectLocked() {
  const auto deadline = Clock::now() + options_.connect_timeout;
  auto backoff = std::chrono::milliseconds(10);
  std::string error = "no attempt made";
  while (true) {
    AddrInfoPtr addrs = resolve(connect_host_, port_, error);
    for (addrinfo* ai = addrs.get(); ai; ai = ai->ai_next) {
      UniqueFd fd = tryConnect(*ai, deadline, error);
      if (fd.valid()) {
        fd_ = std::move(fd);
        break;
      }
    }
    if (fd_.valid()) break;
    const auto now = Clock::now();
    if (now >= deadline)
      fail("could not connect within " + formatDuration(options_.connect_timeout) +
           " (last error: " + error + "); is the server (rank 0) running?");
    // Refused: the server may not be listening yet. Back off, then retry.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  Writer w;
  w.u8(kHello).u32(kMagic).u32(kVersion).u8(options_.counts_as_worker ? 1 : 0);
  const Bytes frame = w.take();
  const Deadline dl = deadlineAfter(options_.connect_timeout);
  std::string err = sendAll(fd_.get(), frame.data(), frame.size(), dl);
  uint8_t head[5];
  if (err.empty()) err = recvAll(fd_.get(), head, sizeof(head), dl);
  if (!err.empty()) failBroken("handshake", err);
  if (frameLength(head) < 1 || head[4] != kOk)
    failBroken("handshake", "the peer does not speak this protocol version");
}

RendezvousStore::Reply RendezvousStore::roundTrip(
    const std::vector<uint8_t>& request,
    const std::string& what,
    std::chrono::milliseconds reply_timeout) {
  // Held for the whole exchange: one request in flight per connection. A
  // blocking get/wait therefore also blocks this object's other callers;
  // threads that must not wait on each other use clone().
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_.empty())
    fail("cannot run " + what + ": the connection was lost earlier (" + broken_ + ")");
  const Deadline dl = deadlineAfter(reply_timeout);
  std::string err = sendAll(fd_.get(), request.data(), request.size(), dl);
  if (!err.empty()) failBroken(what, err);
  uint8_t head[4];
  err = recvAll(fd_.get(), head, sizeof(head), dl);
  Reply reply{kError, {}};
  const uint32_t len = frameLength(head);
  if (err.empty() && (len < 1 || len > options_.max_frame_bytes))
    err = "malformed reply from the server";
  if (err.empty()) {
    reply.body.resize(len);
    err = recvAll(fd_.get(), reply.body.data(), len, dl);
  }
  if (err == "timeout")
    failBroken(what, "the server did not answer within " + formatDuration(reply_timeout));
  if (!err.empty()) failBroken(what, err);
  reply.status = static_cast<Status>(reply.body[0]);
  if (reply.status == kError) fail(what + " failed: " + reply.fields().str());
  if (reply.status != kOk && reply.status != kTimeout)
    failBroken(what, "malformed reply from the server");
  return reply;
}

void RendezvousStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  Writer w;
  w.u8(kSet).str(key).blob(value);
  roundTrip(w.take(), "set of key '" + key + "'", timeout_);
}

std::vector<uint8_t> RendezvousStore::get(const std::string& key) {
  const auto timeout = timeout_;
  Writer w;
  w.u8(kGet).str(key).i64(wireTimeout(timeout));
  Reply reply = roundTrip(w.take(), "get of key '" + key + "'", withGrace(timeout));
  if (reply.status == kTimeout)
    fail("get timed out after " + formatDuration(timeout) + " waiting for key '" +
         key + "'");
  return reply.fields().blob();
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  Writer w;
  w.u8(kAdd).str(key).i64(value);
  return roundTrip(w.take(), "add to key '" + key + "'", timeout_).fields().i64();
}

std::vector<uint8_t> RendezvousStore::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& currentValue,
    const std::vector<uint8_t>& newValue) {
  Writer w;
  w.u8(kCompareSet).str(key).blob(currentValue).blob(newValue);
  return roundTrip(w.take(), "compareSet of key '" + key + "'", timeout_)
      .fields()
      .blob();
}

bool RendezvousStore::deleteKey(const std::string& key) {
  Writer w;
  w.u8(kDelete).str(key);
  return roundTrip(w.take(), "deleteKey of key '" + key + "'", timeout_).fields().u8() != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.u8(kCheck).keys(keys);
  return roundTrip(w.take(), "check of " + describeKeys(keys), timeout_).fields().u8() != 0;
}

int64_t RendezvousStore::getNumKeys() {
  Writer w;
  w.u8(kNumKeys);
  return roundTrip(w.take(), "getNumKeys", timeout_).fields().i64();
}

void RendezvousStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

void RendezvousStore::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& timeout) {
  Writer w;
  w.u8(kWait).keys(keys).i64(wireTimeout(timeout));
  Reply reply = roundTrip(w.take(), "wait for " + describeKeys(keys), withGrace(timeout));
  if (reply.status != kTimeout) return;
  fail("wait timed out after " + formatDuration(timeout) + " waiting for " +
       describeKeys(keys) + " (still missing: " +
       describeKeys(reply.fields().keys()) + ")");
}

void RendezvousStore::waitForWorkers() {
  const auto timeout = timeout_;
  Writer w;
  w.u8(kWaitWorkers).i64(options_.world_size).i64(wireTimeout(timeout));
  Reply reply = roundTrip(w.take(), "wait for workers", withGrace(timeout));
  if (reply.status != kTimeout) return;
  fail("timed out after " + formatDuration(timeout) + " waiting for workers to join: " +
       std::to_string(reply.fields().i64()) + " of " +
       std::to_string(options_.world_size) + " joined");
}

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  Options o = options_;
  o.host = connect_host_;
  o.port = port_;
  o.is_server = false;
  o.wait_for_workers = false;
  o.counts_as_worker = false;
  o.timeout = timeout_;
  return c10::make_intrusive<RendezvousStore>(std::move(o));
}

}  // namespace scaletrain::comm

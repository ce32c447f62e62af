#include "scaletrain/comm/rendezvous_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include "scaletrain/comm/rendezvous_protocol.h"
#include "scaletrain/comm/rendezvous_server.h"

// The client side of RendezvousStore. The server is in rendezvous_server.cpp;
// see Note [Rendezvous wire protocol] in rendezvous_protocol.h.

namespace scaletrain::comm {

namespace detail {
void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}
}  // namespace detail

using namespace rdzv;  // NOLINT(google-build-using-namespace): the protocol's own vocabulary

namespace {

std::string formatDuration(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return std::to_string(d.count() / 1000) + "s";
  return std::to_string(d.count()) + "ms";
}

// "key 'a'" or "keys 'a', 'b'"; long lists are cut so messages stay short.
std::string describeKeys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 8;
  std::string s = keys.size() == 1 ? "key " : "keys ";
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > kShown) s += ", ... (" + std::to_string(keys.size() - kShown) + " more)";
  return s;
}

int64_t wireTimeout(std::chrono::milliseconds t) { return t.count() <= 0 ? 0 : static_cast<int64_t>(t.count()); }

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
    if (rc == 0)
      err = ETIMEDOUT;
    else if (rc < 0)
      err = errno;
    else
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
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
std::chrono::milliseconds withGrace(std::chrono::milliseconds t) { return t.count() <= 0 ? t : t + replyGrace(t); }
}  // namespace

RendezvousStore::RendezvousStore(Options options) : c10d::Store(options.timeout), options_(std::move(options)) {
  if (options_.host.empty())
    throw RendezvousStoreError("rendezvous store: empty host; give the master address (MASTER_ADDR)");
  if (options_.secret.size() > kMaxSecretBytes)
    throw RendezvousStoreError("rendezvous store: the shared secret is longer than " + std::to_string(kMaxSecretBytes) +
                               " bytes");
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
  if (options_.is_server && options_.wait_for_workers && options_.world_size > 0) waitForWorkers();
}

// Members go in reverse order: the client socket closes, then the server
// stops and joins (see the member order in the header).
RendezvousStore::~RendezvousStore() = default;

std::string RendezvousStore::address() const { return joinHostPort(options_.host, port_); }

void RendezvousStore::interrupt() {
  // No lock: the request to stop holds it. shutdown() wakes its poll/recv;
  // the descriptor itself stays open until that request has failed.
  const int fd = fd_.get();
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

std::string RendezvousStore::localHost() const {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  char buf[NI_MAXHOST] = {0};
  if (fd_.get() < 0 || ::getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0 ||
      ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0)
    return connect_host_;
  return buf;
}

void RendezvousStore::fail(const std::string& message) const {
  throw RendezvousStoreError("rendezvous store " + address() + ": " + message);
}

void RendezvousStore::failBroken(const std::string& what, const std::string& why) {
  broken_ = why;
  fd_.reset();
  fail("connection lost during " + what + ": " + why + " (did the server process exit?)");
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
      fail("could not connect within " + formatDuration(options_.connect_timeout) + " (last error: " + error +
           "); is the server (rank 0) running?");
    // Refused: the server may not be listening yet. Back off, then retry.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  Writer w;
  w.u8(kHello).u32(kMagic).u32(kVersion).u8(options_.counts_as_worker ? 1 : 0).str(options_.secret);
  const Bytes frame = w.take();
  const Deadline dl = deadlineAfter(options_.connect_timeout);
  std::string err = sendAll(fd_.get(), frame.data(), frame.size(), dl);
  uint8_t head[4];
  if (err.empty()) err = recvAll(fd_.get(), head, sizeof(head), dl);
  const uint32_t len = err.empty() ? frameLength(head) : 0;
  if (err.empty() && (len < 1 || len > 4096)) err = "the peer does not speak this protocol version";
  Bytes body(len);
  if (err.empty()) err = recvAll(fd_.get(), body.data(), len, dl);
  if (!err.empty()) failBroken("handshake", err);
  if (body[0] == kOk) return;
  std::string why = "the peer does not speak this protocol version";
  if (body[0] == kError) {
    try {
      Reader r(body.data() + 1, body.size() - 1);
      why = r.str();
    } catch (const ProtocolError&) {
    }
  }
  broken_ = why;
  fd_.reset();
  fail("refused the connection: " + why);
}

RendezvousStore::Reply RendezvousStore::roundTrip(const std::vector<uint8_t>& request, const std::string& what,
                                                  std::chrono::milliseconds reply_timeout) {
  // Held for the whole exchange: one request in flight per connection. A
  // blocking get/wait therefore also blocks this object's other callers;
  // threads that must not wait on each other use clone().
  std::lock_guard<std::mutex> lock(mutex_);
  if (!broken_.empty()) fail("cannot run " + what + ": the connection was lost earlier (" + broken_ + ")");
  const Deadline dl = deadlineAfter(reply_timeout);
  std::string err = sendAll(fd_.get(), request.data(), request.size(), dl);
  if (!err.empty()) failBroken(what, err);
  uint8_t head[4];
  err = recvAll(fd_.get(), head, sizeof(head), dl);
  Reply reply{kError, {}};
  const uint32_t len = frameLength(head);
  if (err.empty() && (len < 1 || len > options_.max_frame_bytes)) err = "malformed reply from the server";
  if (err.empty()) {
    reply.body.resize(len);
    err = recvAll(fd_.get(), reply.body.data(), len, dl);
  }
  if (err == "timeout") failBroken(what, "the server did not answer within " + formatDuration(reply_timeout));
  if (!err.empty()) failBroken(what, err);
  reply.status = static_cast<Status>(reply.body[0]);
  if (reply.status == kError) fail(what + " failed: " + reply.fields().str());
  if (reply.status != kOk && reply.status != kTimeout) failBroken(what, "malformed reply from the server");
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
    fail("get timed out after " + formatDuration(timeout) + " waiting for key '" + key + "'");
  return reply.fields().blob();
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  Writer w;
  w.u8(kAdd).str(key).i64(value);
  return roundTrip(w.take(), "add to key '" + key + "'", timeout_).fields().i64();
}

std::vector<uint8_t> RendezvousStore::compareSet(const std::string& key, const std::vector<uint8_t>& currentValue,
                                                 const std::vector<uint8_t>& newValue) {
  Writer w;
  w.u8(kCompareSet).str(key).blob(currentValue).blob(newValue);
  return roundTrip(w.take(), "compareSet of key '" + key + "'", timeout_).fields().blob();
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

void RendezvousStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RendezvousStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  Writer w;
  w.u8(kWait).keys(keys).i64(wireTimeout(timeout));
  Reply reply = roundTrip(w.take(), "wait for " + describeKeys(keys), withGrace(timeout));
  if (reply.status != kTimeout) return;
  fail("wait timed out after " + formatDuration(timeout) + " waiting for " + describeKeys(keys) +
       " (still missing: " + describeKeys(reply.fields().keys()) + ")");
}

void RendezvousStore::waitForWorkers() {
  const auto timeout = timeout_;
  Writer w;
  w.u8(kWaitWorkers).i64(options_.world_size).i64(wireTimeout(timeout));
  Reply reply = roundTrip(w.take(), "wait for workers", withGrace(timeout));
  if (reply.status != kTimeout) return;
  fail("timed out after " + formatDuration(timeout) + " waiting for workers to join: " +
       std::to_string(reply.fields().i64()) + " of " + std::to_string(options_.world_size) + " joined");
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

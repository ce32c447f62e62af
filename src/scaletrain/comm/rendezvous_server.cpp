// The rendezvous store's server. See rendezvous_server.h and Note
// [Rendezvous wire protocol] in rendezvous_protocol.h.
#include "scaletrain/comm/rendezvous_server.h"

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
#include <iostream>
#include <stdexcept>
#include <utility>

namespace scaletrain::comm {

using namespace rdzv;  // NOLINT(google-build-using-namespace): the protocol's own vocabulary

namespace {

// Compares without an early exit, so the time taken says nothing about
// how much of a guess was right.
bool sameSecret(const std::string& a, const std::string& b) {
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < b.size(); ++i) diff |= unsigned(uint8_t(i < a.size() ? a[i] : 0) ^ uint8_t(b[i]));
  return diff == 0;
}

std::string storeFull() { return "store full (max_data_bytes reached)"; }

std::string numericHost(const sockaddr* sa, socklen_t len) {
  char buf[NI_MAXHOST] = {0};
  if (::getnameinfo(sa, len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return buf;
}

// One request's fields as read off the wire; which ones are set depends on the op.
struct Request {
  uint32_t magic = 0, version = 0;  // hello
  bool counts = false;              // hello: the client counts as a worker
  std::string secret;               // hello
  std::string key;                  // set, get, add, compare-set, delete
  Bytes value;                      // set; compare-set's desired value
  Bytes expected;                   // compare-set
  std::vector<std::string> keys;    // check, wait
  int64_t number = 0;               // add's delta; wait-for-workers' count
  int64_t ms = 0;                   // get, wait, wait-for-workers: the timeout
};

// Reads the body of an `op` request to its end (a hello of another protocol
// only as far as its magic and version). Throws ProtocolError.
Request readRequest(Op op, Reader& r) {
  Request q;
  switch (op) {
    case kHello:
      q.magic = r.u32();
      q.version = r.u32();
      if (q.magic != kMagic || q.version != kVersion) return q;
      q.counts = r.u8() != 0;
      q.secret = r.str();
      break;
    case kSet:
      q.key = r.str();
      q.value = r.blob();
      break;
    case kGet:
      q.key = r.str();
      q.ms = r.i64();
      break;
    case kAdd:
      q.key = r.str();
      q.number = r.i64();
      break;
    case kCompareSet:
      q.key = r.str();
      q.expected = r.blob();
      q.value = r.blob();
      break;
    case kDelete:
      q.key = r.str();
      break;
    case kCheck:
      q.keys = r.keys();
      break;
    case kNumKeys:
      break;
    case kWait:
      q.keys = r.keys();
      q.ms = r.i64();
      break;
    case kWaitWorkers:
      q.number = r.i64();
      q.ms = r.i64();
      break;
    default:
      throw ProtocolError("unknown opcode");
  }
  r.expectEnd();
  return q;
}

// Why a hello is refused ("" when it is not): another protocol, or not the
// shared secret `required` (when there is one).
std::string helloRefusal(const Request& q, const std::string& required) {
  if (q.magic != kMagic || q.version != kVersion)
    return "protocol mismatch (server speaks version " + std::to_string(kVersion) + ")";
  if (!required.empty() && !sameSecret(q.secret, required))
    return q.secret.empty() ? "this store requires a shared secret (set SCALETRAIN_STORE_SECRET)"
                            : "wrong shared secret (SCALETRAIN_STORE_SECRET): this is probably another job's store; "
                              "give each job its own --master-port";
  return "";
}

// An add's current value: false unless all of it is a decimal integer.
bool parseInteger(const Bytes& value, int64_t& out) {
  const std::string text(value.begin(), value.end());
  size_t used = 0;
  try {
    out = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  return used != 0 && used == text.size();
}

// A compare-set's answer when it does not set: what `key` holds instead of
// `expected`; null when it holds `expected`. Same rule as c10d::TCPStore: an
// absent key counts as holding "".
const Bytes* heldInstead(const std::map<std::string, Bytes>& data, const std::string& key, const Bytes& expected) {
  auto it = data.find(key);
  if (it == data.end()) return expected.empty() ? nullptr : &expected;
  return it->second == expected ? nullptr : &it->second;
}

}  // namespace

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
      ok = ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), options_.listen_backlog) == 0;
    }
    if (!ok) {
      const int err = errno;
      error += (error.empty() ? "" : "; ") + numericHost(ai->ai_addr, ai->ai_addrlen) + ": " + errnoText(err);
      continue;
    }
    listen_fd_ = std::move(fd);
  }
  where_ = joinHostPort(options_.host, options_.port);
  if (!listen_fd_.valid()) throw RendezvousStoreError("rendezvous store " + where_ + ": cannot listen: " + error);

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
    throw RendezvousStoreError("rendezvous store " + where_ + ": eventfd failed: " + errnoText(errno));
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
    std::cerr << "scaletrain: rendezvous store server " << where_ << " stopped: " << e.what() << std::endl;
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
  for (auto& [id, c] : clients_)
    if (!c.hello && (!next || c.accepted + options_.hello_timeout < *next)) next = c.accepted + options_.hello_timeout;

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
    if (ev & POLLOUT) {
      flush(c);
      parse(ids[i], c);  // requests held back while replies were queued
    }
    if (ev & (POLLIN | POLLHUP | POLLERR)) {
      const bool eof = readFrom(c);
      parse(ids[i], c);  // requests sent just before a close still count
      if (eof) close(ids[i], c);
    }
  }
  expireWaiters();
  expireHellos();
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
    in_bytes_ -= static_cast<int64_t>(it->second.in.size());
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
        std::cerr << "scaletrain: rendezvous store server " << where_ << ": accept: " << errnoText(err) << std::endl;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return;
    }
    if (clients_.size() >= size_t(std::max(options_.max_connections, 1))) {
      ::close(fd);  // over the cap: refused before it can cost anything
      continue;
    }
    setFlag(fd, IPPROTO_TCP, TCP_NODELAY);
    Client& c = clients_[next_id_++];
    c.fd = UniqueFd(fd);
    c.accepted = Clock::now();
  }
}

// Reads what is available. Returns true when the peer closed or failed.
bool RendezvousStore::Server::readFrom(Client& c) {
  uint8_t buf[65536];
  // What one connection may have buffered: one whole frame (a small one
  // before the hello). More means a peer that does not follow the protocol.
  const size_t budget = 4 + size_t(c.hello ? options_.max_frame_bytes : kMaxHelloFrame);
  for (int round = 0; round < 16; ++round) {  // bounded: be fair to others
    const size_t room = c.in.size() - c.in_off >= budget ? 0 : budget - (c.in.size() - c.in_off);
    if (room == 0) return false;  // parse() takes a frame or closes the connection
    ssize_t k = ::recv(c.fd.get(), buf, std::min(room, sizeof(buf)), 0);
    if (k > 0) {
      if (in_bytes_ + k > options_.max_buffered_bytes) {
        std::cerr << "scaletrain: rendezvous store server " << where_
                  << ": closing a connection: the buffered requests of all connections exceed "
                  << options_.max_buffered_bytes << " bytes" << std::endl;
        return true;
      }
      c.in.insert(c.in.end(), buf, buf + k);
      in_bytes_ += k;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    return !(k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
  }
  return false;
}

void RendezvousStore::Server::flush(Client& c) {
  while (c.out_off < c.out.size()) {
    ssize_t k = ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
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

void RendezvousStore::Server::compact(Client& c) {
  if (c.in_off == c.in.size()) {
    in_bytes_ -= static_cast<int64_t>(c.in.size());
    c.in.clear();
    c.in_off = 0;
  } else if (c.in_off > (1u << 16)) {
    in_bytes_ -= static_cast<int64_t>(c.in_off);
    c.in.erase(c.in.begin(), c.in.begin() + long(c.in_off));
    c.in_off = 0;
  }
}

void RendezvousStore::Server::expireHellos() {
  const auto now = Clock::now();
  for (auto& [id, c] : clients_)
    if (!c.hello && !c.closed && c.accepted + options_.hello_timeout <= now) close(id, c);
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
    // A peer that does not read its replies gets no more of them.
    if (c.out.size() - c.out_off > size_t(options_.max_frame_bytes)) break;
    const size_t avail = c.in.size() - c.in_off;
    if (avail < 4) break;
    const uint32_t len = frameLength(c.in.data() + c.in_off);
    if (len > (c.hello ? options_.max_frame_bytes : kMaxHelloFrame) || len == 0) {
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
  compact(c);
}

void RendezvousStore::Server::handle(uint64_t id, Client& c, Reader& r) {
  const auto op = static_cast<Op>(r.u8());
  if (!c.hello && op != kHello) throw ProtocolError("no handshake");
  if (c.hello && op == kHello) throw ProtocolError("second hello");
  Request q = readRequest(op, r);
  Writer w;
  switch (op) {
    case kHello: {
      const std::string refusal = helloRefusal(q, options_.secret);
      if (!refusal.empty()) {
        w.u8(kError).str(refusal);
        reply(c, w);
        close(id, c);
        return;
      }
      c.hello = true;
      reply(c, w.u8(kOk));
      if (q.counts) {
        ++joined_;
        std::vector<uint64_t> ids;
        for (auto& [wid, waiter] : waiters_)
          if (waiter.op == kWaitWorkers) ids.push_back(wid);
        for (uint64_t wid : ids) tryComplete(wid);
      }
      return;
    }
    case kSet: {
      if (!fits(q.key, q.value.size())) return reply(c, w.u8(kError).str(storeFull()));
      reply(c, w.u8(kOk));
      setKey(q.key, std::move(q.value));
      return;
    }
    case kGet: {
      auto it = data_.find(q.key);
      if (it != data_.end()) return reply(c, w.u8(kOk).blob(it->second));
      return addWaiter(id, Waiter{kGet, {q.key}, 0, deadlineAfter(std::chrono::milliseconds(q.ms))});
    }
    case kAdd: {
      int64_t current = 0;
      auto it = data_.find(q.key);
      if (it != data_.end() && !parseInteger(it->second, current))
        return reply(c, w.u8(kError).str("add: value of key '" + q.key + "' is not an integer"));
      const int64_t next = current + q.number;
      const std::string text = std::to_string(next);
      if (!fits(q.key, text.size())) return reply(c, w.u8(kError).str(storeFull()));
      reply(c, w.u8(kOk).i64(next));
      setKey(q.key, Bytes(text.begin(), text.end()));
      return;
    }
    case kCompareSet: {
      if (const Bytes* held = heldInstead(data_, q.key, q.expected)) return reply(c, w.u8(kOk).blob(*held));
      if (!fits(q.key, q.value.size())) return reply(c, w.u8(kError).str(storeFull()));
      reply(c, w.u8(kOk).blob(q.value));
      setKey(q.key, std::move(q.value));
      return;
    }
    case kDelete: {
      auto it = data_.find(q.key);
      if (it == data_.end()) return reply(c, w.u8(kOk).u8(0));
      data_bytes_ -= static_cast<int64_t>(q.key.size() + it->second.size());
      data_.erase(it);
      return reply(c, w.u8(kOk).u8(1));
    }
    case kCheck:
      return reply(c, w.u8(kOk).u8(hasAll(q.keys) ? 1 : 0));
    case kNumKeys:
      return reply(c, w.u8(kOk).i64(static_cast<int64_t>(data_.size())));
    case kWait: {
      if (hasAll(q.keys)) return reply(c, w.u8(kOk));
      return addWaiter(id, Waiter{kWait, std::move(q.keys), 0, deadlineAfter(std::chrono::milliseconds(q.ms))});
    }
    case kWaitWorkers: {
      if (joined_ >= q.number) return reply(c, w.u8(kOk));
      return addWaiter(id, Waiter{kWaitWorkers, {}, q.number, deadlineAfter(std::chrono::milliseconds(q.ms))});
    }
  }
  throw ProtocolError("unknown opcode");
}

bool RendezvousStore::Server::fits(const std::string& key, size_t bytes) const {
  auto it = data_.find(key);
  const int64_t now = it == data_.end() ? 0 : static_cast<int64_t>(key.size() + it->second.size());
  return data_bytes_ - now + static_cast<int64_t>(key.size() + bytes) <= options_.max_data_bytes;
}

void RendezvousStore::Server::setKey(const std::string& key, Bytes value) {
  auto old = data_.find(key);
  if (old != data_.end()) data_bytes_ -= static_cast<int64_t>(key.size() + old->second.size());
  data_bytes_ += static_cast<int64_t>(key.size() + value.size());
  data_[key] = std::move(value);
  auto it = key_waiters_.find(key);
  if (it == key_waiters_.end()) return;
  const std::vector<uint64_t> ids(it->second.begin(), it->second.end());
  for (uint64_t id : ids) tryComplete(id);  // may erase from key_waiters_
}

bool RendezvousStore::Server::hasAll(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [this](const std::string& k) { return data_.count(k) != 0; });
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
}  // namespace scaletrain::comm

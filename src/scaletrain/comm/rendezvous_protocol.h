// Internal to the rendezvous store: the wire format shared by its client
// (rendezvous_store.cpp) and its server (rendezvous_server.cpp), and the
// socket helpers both use. Not part of scaletrain's API.
#pragma once

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaletrain/comm/rendezvous_store.h"

// Note [Rendezvous wire protocol]
// A message is a frame: a 4-byte big-endian body length, then the body. A
// request body is an opcode byte and its fields; a reply body is a status
// byte (ok, timeout, error) and that status's fields. Integers are
// big-endian (u32, i64); a string or value is a u32 length and its bytes; a
// key list is a u32 count and that many strings.
//   request                                 ok reply
//   kHello    u32 magic, u32 version, u8 counts_as_worker, secret   -
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
// Until its hello is accepted a connection may send only frames of at most
// kMaxHelloFrame bytes, and it must send its hello within hello_timeout;
// with a secret set on the server, a hello without the same secret gets an
// error reply and the connection is closed.
// Blocking requests time out on the server, which answers "timeout" and the
// connection stays usable. The client waits a grace period longer; hearing
// nothing by then means the server is stuck, and the connection is dropped.

namespace scaletrain::comm::rdzv {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;
using Deadline = std::optional<Clock::time_point>;
using detail::UniqueFd;

constexpr uint32_t kMagic = 0x53545256;  // "STRV": refuses foreign peers
constexpr uint32_t kVersion = 2;  // 2: the hello carries the shared secret
constexpr uint32_t kMaxSecretBytes = 256;
// Largest frame read from a connection before its hello was accepted.
constexpr uint32_t kMaxHelloFrame = 16 + kMaxSecretBytes;

enum Op : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kCompareSet,
  kDelete,
  kCheck,
  kNumKeys,
  kWait,
  kWaitWorkers,
};
enum Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

struct ProtocolError : RendezvousStoreError {
  using RendezvousStoreError::RendezvousStoreError;
};

// Builds one frame; the first 4 bytes are filled with the length by take().
class Writer {
 public:
  Writer() : buf_(4, 0) {}
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
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
  Writer& str(const std::string& s) { return bytes(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }
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
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
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

inline uint32_t frameLength(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

inline std::string errnoText(int err) { return std::strerror(err); }

inline std::string joinHostPort(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

inline Deadline deadlineAfter(std::chrono::milliseconds t) {
  if (t.count() <= 0) return std::nullopt;  // kNoTimeout: wait forever
  return Clock::now() + t;
}

// Milliseconds poll() may sleep before `deadline`; -1 means forever.
inline int pollTimeout(const Deadline& deadline) {
  if (!deadline) return -1;
  auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, INT_MAX));
}

inline void setFlag(int fd, int level, int name) {
  int one = 1;
  ::setsockopt(fd, level, name, &one, sizeof(one));
}

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { ::freeaddrinfo(ai); }
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves host:port for TCP; on failure returns null and sets `error`.
inline AddrInfoPtr resolve(const std::string& host, uint16_t port, std::string& error) {
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

}  // namespace scaletrain::comm::rdzv

// Tests of RendezvousStore: a server and several clients in one process,
// the key/value semantics c10d expects, timeouts, a vanished server, binding
// only the given address, and ProcessGroupGloo (directly and through
// PrefixStore) rendezvousing over it. Every blocking call has a deadline of a
// few seconds, so a regression fails instead of hanging the suite.
#include "scaletrain/comm/rendezvous_store.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
// libtorch builds Gloo in but does not export this define to its users.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace scaletrain::comm {
namespace rendezvous_store_test {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using StorePtr = c10::intrusive_ptr<RendezvousStore>;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

RendezvousStoreOptions serverOptions(const std::string& host = "127.0.0.1") {
  RendezvousStoreOptions o;
  o.host = host;
  o.port = 0;  // any free port: tests run in parallel
  o.is_server = true;
  o.connect_timeout = 3s;
  o.timeout = 5s;
  return o;
}

StorePtr makeServer(const std::string& host = "127.0.0.1") {
  return c10::make_intrusive<RendezvousStore>(serverOptions(host));
}

StorePtr makeClient(const RendezvousStore& server, std::chrono::milliseconds timeout = 5s) {
  RendezvousStoreOptions o;
  o.host = server.host();
  o.port = server.port();
  o.connect_timeout = 3s;
  o.timeout = timeout;
  return c10::make_intrusive<RendezvousStore>(o);
}

// Runs `fn` and returns the message of the RendezvousStoreError it throws.
template <typename Fn>
std::string errorOf(Fn&& fn) {
  try {
    fn();
  } catch (const RendezvousStoreError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a RendezvousStoreError";
  return "";
}

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Plain connect() to ip:port; returns 0 on success or the errno.
int rawConnect(int family, const std::string& ip, uint16_t port) {
  int fd = ::socket(family, SOCK_STREAM, 0);
  if (fd < 0) return errno;
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    ::inet_pton(AF_INET, ip.c_str(), &a->sin_addr);
    len = sizeof(*a);
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(port);
    ::inet_pton(AF_INET6, ip.c_str(), &a->sin6_addr);
    len = sizeof(*a);
  }
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len);
  int err = rc == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

// A local IPv4 address that is not loopback (what `hostname -I` shows).
std::string nonLoopbackIPv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    auto* a = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
    char buf[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    found = buf;
  }
  ::freeifaddrs(list);
  return found;
}

TEST(RendezvousStore, SetGetAcrossClients) {
  auto server = makeServer();
  EXPECT_NE(server->port(), 0);
  auto client = makeClient(*server);
  const std::vector<uint8_t> binary{0, 1, 255, 0, 7};
  client->set("bin", binary);
  EXPECT_EQ(server->get("bin"), binary);
  server->set("empty", {});
  EXPECT_TRUE(client->get("empty").empty());
  client->set("bin", bytes("overwritten"));
  EXPECT_EQ(text(server->get("bin")), "overwritten");
}

TEST(RendezvousStore, GetBlocksUntilTheKeyIsSet) {
  auto server = makeServer();
  auto client = makeClient(*server);
  auto setter = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(200ms);
    server->set("late", bytes("value"));
  });
  const auto start = Clock::now();
  EXPECT_EQ(text(client->get("late")), "value");
  EXPECT_GE(secondsSince(start), 0.15);
  setter.get();
}

TEST(RendezvousStore, GetTimesOutNamingKeyAndAddress) {
  auto server = makeServer();
  auto client = makeClient(*server, 300ms);
  const auto start = Clock::now();
  const std::string msg = errorOf([&] { client->get("rank3"); });
  EXPECT_LT(secondsSince(start), 3.0);
  EXPECT_NE(msg.find("timed out after 300ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'rank3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("get"), std::string::npos) << msg;
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(server->port())), std::string::npos) << msg;
  // A server-side timeout leaves the connection usable.
  client->set("after", bytes("ok"));
  EXPECT_EQ(text(client->get("after")), "ok");
}

TEST(RendezvousStore, AddFromManyClients) {
  auto server = makeServer();
  constexpr int kThreads = 4, kAdds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      auto c = makeClient(*server);
      for (int i = 0; i < kAdds; ++i) c->add("counter", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(server->add("counter", 0), kThreads * kAdds);
  EXPECT_EQ(text(server->get("counter")), std::to_string(kThreads * kAdds));
  EXPECT_EQ(server->add("neg", -5), -5);
  server->set("word", bytes("abc"));
  const std::string msg = errorOf([&] { server->add("word", 1); });
  EXPECT_NE(msg.find("not an integer"), std::string::npos) << msg;
  EXPECT_EQ(server->add("counter", 1), kThreads * kAdds + 1);  // still usable
}

TEST(RendezvousStore, WaitReturnsWhenAllKeysExist) {
  auto server = makeServer();
  auto client = makeClient(*server);
  auto waiter = std::async(std::launch::async, [&] { client->wait({"a", "b"}, 3s); });
  server->set("a", bytes("1"));
  EXPECT_EQ(waiter.wait_for(150ms), std::future_status::timeout);
  server->set("b", bytes("2"));
  EXPECT_EQ(waiter.wait_for(3s), std::future_status::ready);
  waiter.get();
  client->wait({}, 100ms);  // nothing to wait for
}

TEST(RendezvousStore, WaitTimeoutNamesMissingKeys) {
  auto server = makeServer();
  server->set("present", {});
  const auto start = Clock::now();
  const std::string msg = errorOf([&] { server->wait({"present", "absent"}, 200ms); });
  EXPECT_LT(secondsSince(start), 3.0);
  EXPECT_NE(msg.find("still missing: key 'absent'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("wait"), std::string::npos) << msg;
}

TEST(RendezvousStore, ManyWaitersOneKey) {
  auto server = makeServer();
  constexpr int kWaiters = 6;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  std::vector<StorePtr> clients;
  for (int i = 0; i < kWaiters; ++i) clients.push_back(makeClient(*server));
  for (int i = 0; i < kWaiters; ++i)
    threads.emplace_back([&, i] {
      EXPECT_EQ(text(clients[i]->get("go")), "now");
      ++done;
    });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(done.load(), 0);
  server->set("go", bytes("now"));
  for (auto& t : threads) t.join();
  EXPECT_EQ(done.load(), kWaiters);
}

TEST(RendezvousStore, CompareSetFollowsTcpStoreRules) {
  auto server = makeServer();
  auto client = makeClient(*server);
  // Absent key with a non-empty expectation: nothing set, expectation back.
  EXPECT_EQ(text(client->compareSet("k", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(client->check({"k"}));
  // Absent key with an empty expectation: set.
  EXPECT_EQ(text(client->compareSet("k", {}, bytes("v1"))), "v1");
  // Mismatch: the held value comes back unchanged.
  EXPECT_EQ(text(client->compareSet("k", bytes("nope"), bytes("v2"))), "v1");
  // Match: swapped.
  EXPECT_EQ(text(client->compareSet("k", bytes("v1"), bytes("v2"))), "v2");
  EXPECT_EQ(text(server->get("k")), "v2");
}

TEST(RendezvousStore, DeleteCheckAndNumKeys) {
  auto server = makeServer();
  auto client = makeClient(*server);
  EXPECT_EQ(client->getNumKeys(), 0);
  client->set("a", bytes("1"));
  client->set("b", bytes("2"));
  client->add("c", 3);
  EXPECT_EQ(server->getNumKeys(), 3);
  EXPECT_TRUE(client->check({"a", "b", "c"}));
  EXPECT_FALSE(client->check({"a", "zzz"}));
  EXPECT_TRUE(client->deleteKey("b"));
  EXPECT_FALSE(client->deleteKey("b"));
  EXPECT_FALSE(server->check({"b"}));
  EXPECT_EQ(client->getNumKeys(), 2);
}

TEST(RendezvousStore, ServerGoneIsAClearErrorNotAHang) {
  auto server = makeServer();
  auto client = makeClient(*server, 30s);  // long: only the loss may end the wait
  auto waiter = std::async(std::launch::async, [&] { return errorOf([&] { client->wait({"never"}); }); });
  std::this_thread::sleep_for(100ms);
  const auto start = Clock::now();
  server.reset();  // destructor stops and joins the server thread
  ASSERT_EQ(waiter.wait_for(3s), std::future_status::ready);
  const std::string msg = waiter.get();
  EXPECT_LT(secondsSince(start), 3.0);
  EXPECT_NE(msg.find("connection lost during wait for key 'never'"), std::string::npos) << msg;
  // Later operations fail at once.
  const std::string again = errorOf([&] { client->set("x", {}); });
  EXPECT_NE(again.find("lost earlier"), std::string::npos) << again;
}

TEST(RendezvousStore, StuckServerIsAnErrorNotAHang) {
  // A fake server that completes the handshake and then never answers (a
  // wedged or SIGSTOPped master): the client gives up after its deadline.
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(lfd, 4), 0);
  socklen_t len = sizeof(a);
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  std::atomic<int> conn{-1};
  std::thread fake([&] {
    int fd = ::accept(lfd, nullptr, nullptr);
    char hello[64];
    (void)::recv(fd, hello, sizeof(hello), 0);
    const uint8_t ok[5] = {0, 0, 0, 1, 0};  // frame of length 1: status ok
    (void)::send(fd, ok, sizeof(ok), MSG_NOSIGNAL);
    conn = fd;
  });
  RendezvousStoreOptions o;
  o.host = "127.0.0.1";
  o.port = ntohs(a.sin_port);
  o.connect_timeout = 3s;
  o.timeout = 200ms;
  auto client = c10::make_intrusive<RendezvousStore>(o);
  fake.join();
  const auto start = Clock::now();
  const std::string msg = errorOf([&] { client->get("k"); });
  EXPECT_LT(secondsSince(start), 3.0);  // 200ms plus the reply grace
  EXPECT_NE(msg.find("did not answer"), std::string::npos) << msg;
  ::close(conn);
  ::close(lfd);
}

TEST(RendezvousStore, ClientRetriesUntilTheServerStarts) {
  uint16_t port = 0;
  {
    auto probe = makeServer();  // find a free port, then free it
    port = probe->port();
  }
  RendezvousStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.connect_timeout = 5s;
  o.timeout = 3s;
  auto early = std::async(std::launch::async, [&] {
    auto client = c10::make_intrusive<RendezvousStore>(o);
    return text(client->get("hello"));
  });
  std::this_thread::sleep_for(300ms);
  RendezvousStoreOptions so = o;
  so.is_server = true;
  auto server = c10::make_intrusive<RendezvousStore>(so);
  server->set("hello", bytes("world"));
  ASSERT_EQ(early.wait_for(5s), std::future_status::ready);
  EXPECT_EQ(early.get(), "world");
}

TEST(RendezvousStore, ConnectTimeoutWithoutServer) {
  uint16_t port = 0;
  {
    auto probe = makeServer();
    port = probe->port();
  }
  RendezvousStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.connect_timeout = 400ms;
  const auto start = Clock::now();
  const std::string msg = errorOf([&] { c10::make_intrusive<RendezvousStore>(o); });
  EXPECT_LT(secondsSince(start), 3.0);
  EXPECT_NE(msg.find("could not connect within 400ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
}

TEST(RendezvousStore, ServerWaitsForWorkers) {
  RendezvousStoreOptions o = serverOptions();
  o.port = 0;
  o.world_size = 3;
  o.wait_for_workers = true;
  // Port 0 is only known after the server binds, which happens inside the
  // blocking constructor; so bind a probe port first and reuse it.
  {
    auto probe = makeServer();
    o.port = probe->port();
  }
  auto server = std::async(std::launch::async, [&] { return c10::make_intrusive<RendezvousStore>(o); });
  RendezvousStoreOptions co;
  co.host = "127.0.0.1";
  co.port = o.port;
  co.connect_timeout = 3s;
  auto w1 = c10::make_intrusive<RendezvousStore>(co);
  EXPECT_EQ(server.wait_for(150ms), std::future_status::timeout);  // 2 of 3
  auto w2 = c10::make_intrusive<RendezvousStore>(co);
  ASSERT_EQ(server.wait_for(3s), std::future_status::ready);
  EXPECT_TRUE(server.get()->isServer());

  RendezvousStoreOptions lonely = serverOptions();
  lonely.world_size = 2;
  lonely.wait_for_workers = true;
  lonely.timeout = 200ms;
  const std::string msg = errorOf([&] { c10::make_intrusive<RendezvousStore>(lonely); });
  EXPECT_NE(msg.find("1 of 2 joined"), std::string::npos) << msg;
}

TEST(RendezvousStore, ForeignBytesDropOnlyThatConnection) {
  auto server = makeServer();
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(server->port());
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  const std::string junk = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL), ssize_t(junk.size()));
  char buf[16];
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_LE(::recv(fd, buf, sizeof(buf), 0), 0);  // the server hung up
  ::close(fd);
  auto client = makeClient(*server);
  client->set("still", bytes("serving"));
  EXPECT_EQ(text(server->get("still")), "serving");
}

TEST(RendezvousStore, BindsOnlyTheGivenAddress) {
  auto server = makeServer("127.0.0.1");
  EXPECT_EQ(rawConnect(AF_INET, "127.0.0.1", server->port()), 0);
  const std::string other = nonLoopbackIPv4();
  if (other.empty()) GTEST_SKIP() << "no non-loopback IPv4 address on this machine";
  EXPECT_EQ(rawConnect(AF_INET, other, server->port()), ECONNREFUSED)
      << "server bound to 127.0.0.1 accepted a connection on " << other;
  // And the other way round: bound to the external address, loopback refuses.
  auto external = makeServer(other);
  EXPECT_EQ(rawConnect(AF_INET, other, external->port()), 0);
  EXPECT_EQ(rawConnect(AF_INET, "127.0.0.1", external->port()), ECONNREFUSED);
  auto client = makeClient(*external);
  client->set("k", bytes("v"));
  EXPECT_EQ(text(external->get("k")), "v");
}

TEST(RendezvousStore, IPv6Loopback) {
  StorePtr server;
  try {
    server = makeServer("::1");
  } catch (const RendezvousStoreError& e) {
    GTEST_SKIP() << "no IPv6 loopback: " << e.what();
  }
  EXPECT_EQ(server->address(), "[::1]:" + std::to_string(server->port()));
  EXPECT_EQ(rawConnect(AF_INET, "127.0.0.1", server->port()), ECONNREFUSED);
  auto client = makeClient(*server);
  client->set("six", bytes("6"));
  EXPECT_EQ(text(server->get("six")), "6");
}

TEST(RendezvousStore, CloneIsAnIndependentConnection) {
  auto server = makeServer();
  auto copy = server->clone();
  // The server's own connection blocks in get; the clone must not queue
  // behind it.
  auto getter = std::async(std::launch::async, [&] { return text(server->get("k")); });
  std::this_thread::sleep_for(50ms);
  copy->set("k", bytes("from clone"));
  ASSERT_EQ(getter.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(getter.get(), "from clone");
}

// One ProcessGroupGloo per rank, each rank in its own thread with its own
// store connection (rank 0's store is the server), then an allreduce.
using StoreForRank = std::function<c10::intrusive_ptr<c10d::Store>(int)>;

void runGlooAllreduce(int world, const StoreForRank& storeFor) {
  std::vector<std::future<std::vector<float>>> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.push_back(std::async(std::launch::async, [&, rank] {
      auto options = c10d::ProcessGroupGloo::Options::create();
      options->timeout = 10s;
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(storeFor(rank), rank, world, options);
      std::vector<at::Tensor> tensors{at::full({4}, float(rank + 1))};
      pg->allreduce(tensors)->wait();
      const at::Tensor t = tensors[0].contiguous();
      return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    }));
  const float expected = float(world * (world + 1) / 2);
  for (auto& r : ranks) {
    ASSERT_EQ(r.wait_for(20s), std::future_status::ready);
    for (float v : r.get()) EXPECT_FLOAT_EQ(v, expected);
  }
}

TEST(RendezvousStore, ProcessGroupGlooAllreduce) {
  constexpr int kWorld = 3;
  auto server = makeServer();
  std::vector<c10::intrusive_ptr<c10d::Store>> stores{server};
  for (int r = 1; r < kWorld; ++r) stores.push_back(makeClient(*server));
  runGlooAllreduce(kWorld, [&](int rank) { return stores[rank]; });
}

TEST(RendezvousStore, ProcessGroupGlooThroughPrefixStore) {
  // Two subgroups share one store under different prefixes, as Mesh does.
  auto server = makeServer();
  std::vector<c10::intrusive_ptr<c10d::Store>> base{server, makeClient(*server)};
  for (const std::string prefix : {"dp/", "tp/"})
    runGlooAllreduce(2, [&](int rank) { return c10::make_intrusive<c10d::PrefixStore>(prefix, base[rank]); });
  EXPECT_GT(server->getNumKeys(), 0);
}

// A raw TCP connection to the server, with a receive timeout.
int rawSocket(const RendezvousStore& server, int timeout_s = 3) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(server.port());
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// True when the server hung up on `fd` (reads EOF or a reset, not a timeout).
bool hungUp(int fd) {
  char buf[64];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

TEST(RendezvousStore, SharedSecretIsRequiredBeforeAnything) {
  auto o = serverOptions();
  o.secret = "correct horse";
  auto server = c10::make_intrusive<RendezvousStore>(o);
  server->set("k", bytes("v"));  // the server's own client carries the secret
  RendezvousStoreOptions c;
  c.host = "127.0.0.1";
  c.port = server->port();
  c.connect_timeout = 3s;
  EXPECT_NE(errorOf([&] { RendezvousStore s(c); }).find("requires a shared secret"), std::string::npos);
  c.secret = "wrong horse";
  const std::string wrong = errorOf([&] { RendezvousStore s(c); });
  EXPECT_NE(wrong.find("wrong shared secret"), std::string::npos) << wrong;
  // It names the store reached and the likely cause: another job on the same port.
  EXPECT_NE(wrong.find(":" + std::to_string(c.port) + ": refused"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("probably another job's store"), std::string::npos) << wrong;
  // A peer that skips the hello cannot change anything: its set is not
  // applied and the connection is closed.
  int fd = rawSocket(*server);
  ASSERT_GE(fd, 0);
  const uint8_t set_frame[] = {0, 0, 0, 13, 2 /* kSet */, 0, 0, 0, 3, 'b', 'a', 'd', 0, 0, 0, 1, 'x'};
  ASSERT_EQ(::send(fd, set_frame, sizeof(set_frame), MSG_NOSIGNAL), ssize_t(sizeof(set_frame)));
  EXPECT_TRUE(hungUp(fd));
  ::close(fd);
  EXPECT_FALSE(server->check({"bad"}));
  c.secret = "correct horse";
  RendezvousStore good(c);
  EXPECT_EQ(text(good.get("k")), "v");
}

TEST(RendezvousStore, UnauthenticatedPeersCannotMakeTheServerBuffer) {
  auto o = serverOptions();
  o.hello_timeout = 300ms;
  auto server = c10::make_intrusive<RendezvousStore>(o);
  // Before its hello a connection may send only a small frame: one that
  // announces 1 MiB is cut off after a few hundred bytes, not buffered.
  int fd = rawSocket(*server);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> big(256 << 10, 7);
  big[0] = 0, big[1] = 0x10, big[2] = 0, big[3] = 0;  // a 1 MiB frame
  ::send(fd, big.data(), big.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(hungUp(fd));
  ::close(fd);
  // A connection that says nothing is closed once the hello is overdue.
  const auto t0 = Clock::now();
  fd = rawSocket(*server);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(hungUp(fd));
  EXPECT_LT(secondsSince(t0), 2.5);
  ::close(fd);
  server->set("still", bytes("serving"));
  EXPECT_EQ(text(makeClient(*server)->get("still")), "serving");
}

TEST(RendezvousStore, ConnectionsAndDataAreCapped) {
  auto o = serverOptions();
  o.max_connections = 2;  // the server's own client and one more
  o.max_data_bytes = 1000;
  auto server = c10::make_intrusive<RendezvousStore>(o);
  auto second = makeClient(*server);
  RendezvousStoreOptions c;
  c.host = "127.0.0.1";
  c.port = server->port();
  c.connect_timeout = 2s;
  EXPECT_NE(errorOf([&] { RendezvousStore s(c); }).find("handshake"), std::string::npos);
  // The map holds at most max_data_bytes of keys and values.
  server->set("a", std::vector<uint8_t>(600, 1));
  EXPECT_NE(errorOf([&] { second->set("b", std::vector<uint8_t>(600, 2)); }).find("store full"), std::string::npos);
  second->set("a", std::vector<uint8_t>(700, 3));  // replacing counts the old value out
  EXPECT_TRUE(second->deleteKey("a"));
  second->set("b", std::vector<uint8_t>(900, 4));
  EXPECT_EQ(second->get("b").size(), 900u);
  // A frame above max_frame_bytes (1 MiB) closes that connection only.
  EXPECT_NE(errorOf([&] { second->set("huge", std::vector<uint8_t>(2 << 20, 5)); }).find("connection lost"),
            std::string::npos);
  EXPECT_EQ(server->get("b").size(), 900u);
}

}  // namespace rendezvous_store_test
}  // namespace scaletrain::comm

// The public face of rpc.h: values, futures, remote references (RRef,
// remote, owned), calls (rpc_async, rpc_sync) and the lifecycle (init_rpc,
// shutdown), over the TensorPipe agent of rpc_internal.h whose methods (the
// wire format, Note [RPC messages]) are in agent.cpp.
#include "scaletrain/rpc/rpc_internal.h"

#include <cstdlib>

#include "scaletrain/comm/world.h"
#include "scaletrain/rpc/dist_autograd.h"

namespace scaletrain::rpc {

// ---------------------------------------------------------------- values

Value::Value(const RRef& r) : v_(r.state()) {}

const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::None: return "none";
    case Value::Kind::Tensor: return "tensor";
    case Value::Kind::Int: return "int";
    case Value::Kind::Double: return "double";
    case Value::Kind::Bool: return "bool";
    case Value::Kind::String: return "string";
    case Value::Kind::TensorList: return "tensor list";
    case Value::Kind::RRef: return "rref";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong_kind(Value::Kind want, Value::Kind got) {
  throw RpcError(std::string("rpc: expected a ") + kind_name(want) + " value, got " + kind_name(got));
}
}  // namespace

const at::Tensor& Value::tensor() const {
  if (kind() != Kind::Tensor) wrong_kind(Kind::Tensor, kind());
  return std::get<at::Tensor>(v_);
}
int64_t Value::to_int() const {
  if (kind() != Kind::Int) wrong_kind(Kind::Int, kind());
  return std::get<int64_t>(v_);
}
double Value::to_double() const {
  if (kind() == Kind::Int) return static_cast<double>(std::get<int64_t>(v_));
  if (kind() != Kind::Double) wrong_kind(Kind::Double, kind());
  return std::get<double>(v_);
}
bool Value::to_bool() const {
  if (kind() != Kind::Bool) wrong_kind(Kind::Bool, kind());
  return std::get<bool>(v_);
}
const std::string& Value::str() const {
  if (kind() != Kind::String) wrong_kind(Kind::String, kind());
  return std::get<std::string>(v_);
}
const std::vector<at::Tensor>& Value::tensors() const {
  if (kind() != Kind::TensorList) wrong_kind(Kind::TensorList, kind());
  return std::get<std::vector<at::Tensor>>(v_);
}
RRef Value::rref() const {
  if (kind() != Kind::RRef) wrong_kind(Kind::RRef, kind());
  return RRef(std::get<std::shared_ptr<RRefState>>(v_));
}

// ---------------------------------------------------------------- futures

Value Future::wait() const {
  if (!s_) throw RpcError("rpc: wait() on an empty future");
  std::unique_lock<std::mutex> lock(s_->mu);
  s_->cv.wait(lock, [&] { return s_->done; });
  if (!s_->error.empty()) throw RpcError(s_->error);
  return s_->value;
}

bool Future::done() const {
  if (!s_) return false;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->done;
}

// ---------------------------------------------------------------- the agent

namespace {

std::mutex g_mu;
std::shared_ptr<Agent> g_agent;

std::shared_ptr<Agent> agent() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_agent) throw RpcError("rpc: not initialized (init_rpc), or already shut down");
  return g_agent;
}
std::shared_ptr<Agent> agent_or_null() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_agent;
}
}  // namespace

// ---------------------------------------------------------------- references (Note [RRef counting])

RRefState::~RRefState() {
  if (slot) return;  // the owner's handle: not counted
  auto a = agent_or_null();
  if (!a) return;
  try {
    a->call(owner, "__rref_decref", {Value(id)}, a->opts.timeout);  // waited for by shutdown
  } catch (const std::exception&) {
    // The owner is gone or we are shutting down: nothing left to free.
  }
}

const std::string& RRef::owner() const {
  if (!s_) throw RpcError("rpc: empty RRef");
  return s_->owner;
}
bool RRef::is_owner() const { return s_ && s_->slot != nullptr; }

Value RRef::to_here(std::chrono::milliseconds timeout) const {
  if (!s_) throw RpcError("rpc: empty RRef");
  if (!agent_or_null()) throw RpcError("rpc: RRef used after rpc::shutdown()");
  if (s_->slot) return local_value();
  return agent()->call(s_->owner, "__rref_fetch", {Value(s_->id)}, timeout).wait();
}

Value RRef::local_value() const {
  if (!s_ || !s_->slot) throw RpcError("rpc: local_value() on a worker that does not own the value");
  return Future(s_->slot).wait();
}

RRef owned(Value v) {
  auto a = agent();
  auto s = std::make_shared<RRefState>();
  s->owner = a->name;
  s->slot = std::make_shared<Slot>();
  s->slot->finish(std::move(v), "");
  {
    std::lock_guard<std::mutex> lock(a->mu);
    s->id = a->name + "#" + std::to_string(a->next_rref++);
  }
  return RRef(s);  // counted in the owner's table once it is sent (Note [RRef counting])
}

int64_t owned_count() {
  auto a = agent();
  std::lock_guard<std::mutex> lock(a->mu);
  int64_t n = 0;
  for (const auto& [id, o] : a->owned) n += o.count > 0 ? 1 : 0;
  return n;
}

RRef remote(const std::string& to, const std::string& fn, Args args, std::chrono::milliseconds timeout) {
  auto a = agent();
  auto s = std::make_shared<RRefState>();
  s->owner = to;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    s->id = a->name + "#" + std::to_string(a->next_rref++);
  }
  // The creation is tracked like any call (shutdown waits for it); its
  // failure surfaces at to_here().
  a->call(to, fn, std::move(args), timeout, "remote", s->id);
  if (to == a->name) {
    s->slot = a->find_owned(s->id, a->opts.timeout);
    a->incref(s->id, -1);  // our own handle is not counted
  }
  return RRef(s);
}

// ---------------------------------------------------------------- calls

Future rpc_async(const std::string& to, const std::string& fn, Args args, std::chrono::milliseconds timeout) {
  return agent()->call(to, fn, std::move(args), timeout);
}

Value rpc_sync(const std::string& to, const std::string& fn, Args args, std::chrono::milliseconds timeout) {
  return rpc_async(to, fn, std::move(args), timeout).wait();
}

// ---------------------------------------------------------------- lifecycle

namespace {

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    using K = Value::Kind;
    register_function("__rref_incref", {K::String}, [](const Args& a) {
      agent()->incref(a[0].str(), 1);
      return Value();
    });
    register_function("__rref_decref", {K::String}, [](const Args& a) {
      agent()->incref(a[0].str(), -1);
      return Value();
    });
    register_function("__rref_fetch", {K::String}, [](const Args& a) {
      auto self = agent();
      return Future(self->find_owned(a[0].str(), self->opts.timeout)).wait();
    });
    dist_autograd::detail::register_builtins();
  });
}

bool loopback(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// Options::listen_address; empty: 127.0.0.1 when MASTER_ADDR is a loopback
// address (or unset), else this host's address.
std::string listen_host(const Options& options) {
  std::string host = options.listen_address;
  if (host.empty()) {
    const char* master = std::getenv("MASTER_ADDR");
    if (loopback(master ? master : "")) {
      host = "127.0.0.1";
    } else {
      auto [err, addr] = tp::transport::uv::lookupAddrForHostname();
      if (err) throw RpcError("rpc: no address for this host (" + err.what() + "); set Options::listen_address");
      host = addr;
    }
  }
  return host;
}

// The agent's TensorPipe context, listening on `host`; returns its address.
std::string listen_on(Agent& a, const std::string& host) {
  a.ctx = std::make_shared<tp::Context>(tp::ContextOptions().name(a.name));
  // uv (TCP) carries the headers; tensors go by cross-memory attach between
  // processes of one host where the kernel allows it (TensorPipe picks the
  // highest priority both ends can use), else over the connection. The shm
  // transport is left out: its loop polls, a core's worth of spinning.
  a.ctx->registerTransport(0, "uv", tp::transport::uv::create());
  a.ctx->registerChannel(0, "basic", tp::channel::basic::create());
  if (auto cma = tp::channel::cma::create(); cma->isViable()) a.ctx->registerChannel(10, "cma", cma);
  a.listener = a.ctx->listen({"uv://" + host});
  return a.listener->url("uv");
}

// Accepts the next incoming pipe, reads from it, and waits for the one after.
void accept_next(const std::weak_ptr<Agent>& weak) {
  auto self = weak.lock();
  if (!self) return;
  self->listener->accept([weak](const tp::Error& e, std::shared_ptr<tp::Pipe> pipe) {
    auto self = weak.lock();
    if (!self || e) return;
    {
      std::lock_guard<std::mutex> lock(self->mu);
      self->in_pipes.push_back(pipe);
    }
    self->read_loop(pipe);
    accept_next(weak);
  });
}

// The handler pool, the acceptor and the watchdog (timeouts, every 20 ms).
void start_threads(const std::shared_ptr<Agent>& a, const Options& options) {
  a->pool = std::make_unique<detail::Pool>(std::max(2, options.threads));
  std::weak_ptr<Agent> weak = a;
  accept_next(weak);
  a->watchdog = std::thread([weak] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto self = weak.lock();
      if (!self) return;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        if (self->closing && self->pending.empty()) return;
      }
      self->check_timeouts();
    }
  });
}

// Publishes this worker's name and address in the store and learns every
// worker's; the agent is ready after it.
void exchange_addresses(Agent& a, const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                        const std::string& name, const std::string& url, const Options& options) {
  auto key = [&](const std::string& k) { return a.prefix + k; };
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  store->set(key("name/" + std::to_string(rank)), bytes(name));
  store->set(key("url/" + name), bytes(url));
  std::vector<std::string> names;
  for (int r = 0; r < world_size; ++r) {
    const std::string k = key("name/" + std::to_string(r));
    store->wait({k}, options.timeout);
    names.push_back(text(store->get(k)));
  }
  std::map<std::string, std::string> urls;
  for (const auto& n : names) {
    if (urls.count(n)) throw std::invalid_argument("rpc: two workers are named '" + n + "'");
    const std::string k = key("url/" + n);
    store->wait({k}, options.timeout);
    urls[n] = text(store->get(k));
  }
  {
    std::lock_guard<std::mutex> lock(a.mu);
    a.names = std::move(names);
    a.urls = std::move(urls);
    a.ready = true;
  }
  a.ready_cv.notify_all();
}

// A failed init_rpc: the agent is unpublished, closed and its threads joined.
void abandon(Agent& a) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_agent.reset();
  }
  {
    std::lock_guard<std::mutex> lock(a.mu);
    a.closing = true;
  }
  a.ctx->close();
  a.ctx->join();
  a.pool->stop();
  a.watchdog.join();
}

}  // namespace

void init_rpc(const std::string& name, int rank, int world_size, const c10::intrusive_ptr<c10d::Store>& store,
              const Options& options) {
  if (name.empty() || name.rfind("__", 0) == 0)
    throw std::invalid_argument("rpc: a worker needs a name not starting with __");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("rpc: rank " + std::to_string(rank) + " is not in a world of " +
                                std::to_string(world_size));
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_agent) throw std::logic_error("rpc: init_rpc called twice (shutdown() first)");
  }
  register_builtins();
  auto a = std::make_shared<Agent>();
  a->opts = options;
  a->name = name;
  a->rank = rank;
  a->world = world_size;
  a->store = store;
  // One generation of keys per init of the whole group.
  const int64_t joined = store->add("rpc/joined", 1);
  a->prefix = "rpc/" + std::to_string((joined - 1) / world_size) + "/";
  const std::string url = listen_on(*a, listen_host(options));
  start_threads(a, options);
  // Published before this worker's address: a peer may call as soon as it
  // reads it, and the handlers reach the agent through g_agent.
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_agent = a;
  }
  try {
    exchange_addresses(*a, store, rank, world_size, name, url, options);
  } catch (...) {
    abandon(*a);
    throw;
  }
}

void init_rpc(const std::string& name, const comm::World& world, const Options& options) {
  init_rpc(name, world.rank(), world.size(), world.store(), options);
}

bool initialized() { return agent_or_null() != nullptr; }
const std::string& worker_name() { return agent()->name; }
int worker_rank() { return agent()->rank; }
std::vector<std::string> worker_names() {
  auto a = agent();
  std::unique_lock<std::mutex> lock(a->mu);
  a->ready_cv.wait(lock, [&] { return a->ready || a->closing; });
  return a->names;
}

void shutdown() {
  auto a = agent();
  // 1. This worker's own calls (reference messages included) end: answered,
  // failed, or timed out by the watchdog.
  {
    std::unique_lock<std::mutex> lock(a->mu);
    a->idle_cv.wait(lock, [&] { return a->pending.empty(); });
  }
  // 2. Say so, and wait for every worker not known dead to say the same,
  // serving their calls meanwhile.
  const auto bytes = std::vector<uint8_t>{1};
  a->store->set(a->prefix + "done/" + std::to_string(a->rank), bytes);
  const auto deadline = Clock::now() + a->opts.timeout;
  std::vector<std::string> missing;
  for (int r = 0; r < a->world; ++r) {
    const std::string peer = a->names[static_cast<size_t>(r)];
    for (;;) {
      if (a->store->check({a->prefix + "done/" + std::to_string(r)})) break;
      {
        std::lock_guard<std::mutex> lock(a->mu);
        if (a->dead.count(peer)) break;
      }
      if (Clock::now() > deadline) {
        missing.push_back(peer);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // 3. Close: no callback runs after join().
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->closing = true;
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_agent.reset();
  }
  a->listener->close();
  a->ctx->close();
  a->ctx->join();
  a->pool->stop();
  // Calls started after step 1 (a handler's, a reference's decrement) get no
  // reply any more: they fail now rather than at their timeout.
  std::vector<detail::Pending> left;
  {
    std::lock_guard<std::mutex> lock(a->mu);
    for (auto& [id, p] : a->pending) left.push_back(std::move(p));
    a->pending.clear();
  }
  for (auto& p : left)
    p.state->finish(Value(), "rpc: call to '" + p.fn + "' on worker '" + p.to + "' ended by shutdown()");
  if (a->watchdog.joinable()) a->watchdog.join();
  {
    std::lock_guard<std::mutex> lock(a->mu);
    a->out_pipes.clear();
    a->in_pipes.clear();
    a->owned.clear();
  }
  if (!missing.empty()) {
    std::string list;
    for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
    throw RpcError("rpc: shutdown: worker(s) " + list + " did not finish within " +
                   std::to_string(a->opts.timeout.count()) + " ms");
  }
}

}  // namespace scaletrain::rpc
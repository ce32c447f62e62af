// Longer than 600 lines (issue 35): the TensorPipe agent, its wire format
// (message headers, tensor payloads) and remote references in one file. The
// seam is the wire format, which moves to rpc/wire.cpp when issue 35 cuts it.
#include "scaletrain/rpc/rpc.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <tensorpipe/tensorpipe.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "scaletrain/comm/world.h"
#include "scaletrain/rpc/dist_autograd.h"

namespace scaletrain::rpc {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace tp = tensorpipe;

// ---------------------------------------------------------------- values

struct RRefState {
  std::string owner, id;
  std::shared_ptr<Future::State> slot;  // set on the owner: the value itself
  ~RRefState();
};

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

// ---------------------------------------------------------------- registry

namespace {

struct Registered {
  std::vector<Value::Kind> params;
  Function fn;
};

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, Registered>& registry() {
  static std::map<std::string, Registered> r;
  return r;
}

}  // namespace

void register_function(const std::string& name, std::vector<Value::Kind> params, Function fn) {
  if (name.empty() || !fn) throw std::invalid_argument("rpc::register_function: a name and a function are needed");
  std::lock_guard<std::mutex> lock(registry_mu());
  registry()[name] = Registered{std::move(params), std::move(fn)};
}

// ---------------------------------------------------------------- futures

struct Future::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Value value;
  std::string error;
  void finish(Value v, std::string err) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (done) return;
      done = true;
      value = std::move(v);
      error = std::move(err);
    }
    cv.notify_all();
  }
};

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

// A value owned here (Note [RRef counting]): a future's state, finished when
// its remote() has run.
using Slot = Future::State;

namespace {

thread_local std::string t_caller;

// SCALETRAIN_RPC_TRACE=1: one stderr line per message sent and received.
bool tracing() {
  static const bool on = [] {
    const char* v = std::getenv("SCALETRAIN_RPC_TRACE");
    return v && std::string(v) == "1";
  }();
  return on;
}

class Pool {
 public:
  explicit Pool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~Pool() { stop(); }
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

struct Pending {
  std::shared_ptr<Future::State> state;
  std::string to, fn;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout;
  int64_t context = 0;
};

struct Owned {
  std::shared_ptr<Slot> slot;
  int64_t count = 0;  // references held by other workers
};

// Functions the pipe's loop thread handles itself, in arrival order: the
// reference counts, so a count sent before a call is seen before it.
bool handled_inline(const std::string& fn) { return fn == "__rref_incref" || fn == "__rref_decref"; }

bool loopback(const std::string& host) {
  return host.empty() || host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

}  // namespace

struct Agent : std::enable_shared_from_this<Agent> {
  Options opts;
  std::string name, prefix;
  int rank = 0, world = 0;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<tp::Context> ctx;
  std::shared_ptr<tp::Listener> listener;
  std::vector<std::string> names;
  std::map<std::string, std::string> urls;

  std::mutex mu;
  std::mutex connect_mu;            // pipe_to(): one connect at a time
  std::condition_variable idle_cv;  // pending emptied
  std::map<std::string, std::shared_ptr<tp::Pipe>> out_pipes;
  std::vector<std::shared_ptr<tp::Pipe>> in_pipes;
  std::map<const tp::Pipe*, std::string> peer_of;
  std::map<uint64_t, Pending> pending;
  std::set<std::string> dead;
  std::map<std::string, Owned> owned;
  std::condition_variable owned_cv;
  uint64_t next_id = 1;
  int64_t next_rref = 1;
  bool closing = false;
  bool ready = false;  // names and addresses known (the end of init_rpc)
  std::condition_variable ready_cv;
  std::unique_ptr<Pool> pool;
  std::thread watchdog;

  // Sending.
  void write(const std::shared_ptr<tp::Pipe>& pipe, const json& header, std::vector<at::Tensor> tensors,
             std::function<void(const std::string& error)> on_error);
  json encode(const Value& v, std::vector<at::Tensor>& tensors, std::vector<json>& metas, int64_t context,
              const std::string& key_prefix, const std::string& to);
  Value decode(const json& j, const std::vector<at::Tensor>& wire, const json& metas, int64_t context,
               const std::string& from, const std::string& key_prefix);
  std::shared_ptr<tp::Pipe> pipe_to(const std::string& to);
  Future call(const std::string& to, const std::string& fn, Args args, std::chrono::milliseconds timeout,
              const std::string& kind = "call", const std::string& rref = "");
  // Receiving.
  void read_loop(const std::shared_ptr<tp::Pipe>& pipe);
  void dispatch(const std::shared_ptr<tp::Pipe>& pipe, json header, std::vector<at::Tensor> tensors);
  void handle(const std::shared_ptr<tp::Pipe>& pipe, const json& header, const std::vector<at::Tensor>& tensors);
  void reply(const std::shared_ptr<tp::Pipe>& pipe, const json& request, const Value& result, int64_t context);
  void reply_error(const std::shared_ptr<tp::Pipe>& pipe, const json& request, const std::string& error);
  void broken(const tp::Pipe* pipe, const std::string& what);
  void fail_pending_to(const std::string& worker, const std::string& why);
  void check_timeouts();
  // References.
  std::shared_ptr<Slot> find_owned(const std::string& id, std::chrono::milliseconds timeout);
  void incref(const std::string& id, int64_t n);
  RRef receive_rref(const std::string& owner, const std::string& id);
};

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

// ---- encoding (Note [RPC messages])

json Agent::encode(const Value& v, std::vector<at::Tensor>& tensors, std::vector<json>& metas, int64_t context,
                   const std::string& key_prefix, const std::string& to) {
  auto add_tensor = [&](const at::Tensor& t) {
    if (!t.defined()) throw RpcError("rpc: an undefined tensor cannot be sent");
    if (!t.device().is_cpu()) throw RpcError("rpc: tensors travel from host memory; move it to the CPU first");
    const int64_t index = static_cast<int64_t>(metas.size());
    json m = {{"dtype", static_cast<int>(t.scalar_type())}, {"shape", t.sizes().vec()}};
    if (t.requires_grad() && context != 0) {
      const std::string key = key_prefix + std::to_string(index);
      dist_autograd::detail::on_send(context, key, to, t);
      m["key"] = key;
    }
    at::Tensor data = t.detach().contiguous();
    m["wire"] = data.numel() > 0 ? static_cast<int64_t>(tensors.size()) : -1;
    if (data.numel() > 0) tensors.push_back(data);
    metas.push_back(std::move(m));
    return index;
  };
  switch (v.kind()) {
    case Value::Kind::None: return {{"k", "none"}};
    case Value::Kind::Tensor: return {{"k", "tensor"}, {"t", add_tensor(v.tensor())}};
    case Value::Kind::Int: return {{"k", "int"}, {"v", v.to_int()}};
    case Value::Kind::Double: {
      const double d = v.to_double();
      if (std::isfinite(d)) return {{"k", "double"}, {"v", d}};
      return {{"k", "double"}, {"s", std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf")}};
    }
    case Value::Kind::Bool: return {{"k", "bool"}, {"v", v.to_bool()}};
    case Value::Kind::String: return {{"k", "string"}, {"v", v.str()}};
    case Value::Kind::TensorList: {
      std::vector<int64_t> idx;
      for (const auto& t : v.tensors()) idx.push_back(add_tensor(t));
      return {{"k", "tensors"}, {"t", idx}};
    }
    case Value::Kind::RRef: {
      // Note [RRef counting]: the receiver's reference is counted first.
      const RRef r = v.rref();
      const auto& s = r.state();
      if (!s) throw RpcError("rpc: an empty RRef cannot be sent");
      if (s->owner == name) {
        std::lock_guard<std::mutex> lock(mu);
        Owned& o = owned[s->id];
        if (!o.slot) o.slot = s->slot;
        o.count += 1;
      } else {
        call(s->owner, "__rref_incref", {Value(s->id)}, opts.timeout).wait();
      }
      return {{"k", "rref"}, {"owner", s->owner}, {"id", s->id}};
    }
  }
  throw RpcError("rpc: unknown value kind");
}

Value Agent::decode(const json& j, const std::vector<at::Tensor>& wire, const json& metas, int64_t context,
                    const std::string& from, const std::string& key_prefix) {
  auto tensor_at = [&](int64_t index) {
    const json& m = metas.at(static_cast<size_t>(index));
    at::Tensor t;
    const int64_t w = m.at("wire").get<int64_t>();
    if (w >= 0) {
      t = wire.at(static_cast<size_t>(w));
    } else {
      t = at::empty(m.at("shape").get<std::vector<int64_t>>(),
                    at::TensorOptions().dtype(static_cast<at::ScalarType>(m.at("dtype").get<int>())));
    }
    if (m.contains("key")) t = dist_autograd::detail::on_receive(context, from, m.at("key").get<std::string>(), t);
    return t;
  };
  (void)key_prefix;
  const std::string k = j.at("k").get<std::string>();
  if (k == "none") return Value();
  if (k == "tensor") return Value(tensor_at(j.at("t").get<int64_t>()));
  if (k == "int") return Value(j.at("v").get<int64_t>());
  if (k == "double") {
    if (j.contains("s")) {
      const std::string s = j.at("s").get<std::string>();
      return Value(s == "nan" ? std::nan("") : (s == "inf" ? HUGE_VAL : -HUGE_VAL));
    }
    return Value(j.at("v").get<double>());
  }
  if (k == "bool") return Value(j.at("v").get<bool>());
  if (k == "string") return Value(j.at("v").get<std::string>());
  if (k == "tensors") {
    std::vector<at::Tensor> ts;
    for (const auto& i : j.at("t")) ts.push_back(tensor_at(i.get<int64_t>()));
    return Value(std::move(ts));
  }
  if (k == "rref") return Value(receive_rref(j.at("owner").get<std::string>(), j.at("id").get<std::string>()));
  throw RpcError("rpc: a message holds an unknown value kind '" + k + "'");
}

// ---- sending

void Agent::write(const std::shared_ptr<tp::Pipe>& pipe, const json& header, std::vector<at::Tensor> tensors,
                  std::function<void(const std::string&)> on_error) {
  tp::Message msg;
  msg.metadata = header.dump();
  if (tracing())
    std::fprintf(stderr, "[rpc %s] send %s %s #%s\n", name.c_str(), header.value("kind", "").c_str(),
                 header.value("fn", "").c_str(), header.at("id").dump().c_str());
  for (auto& t : tensors) {
    tp::Message::Tensor mt;
    mt.buffer = tp::CpuBuffer{t.data_ptr()};
    mt.length = t.nbytes();
    msg.tensors.push_back(std::move(mt));
  }
  // The tensors are read until the write's callback: they live in it.
  pipe->write(std::move(msg), [keep = std::move(tensors), on_error = std::move(on_error)](const tp::Error& e) {
    if (e && on_error) on_error(e.what());
  });
}

// TensorPipe may run callbacks on the thread that calls into it (connect,
// read, write), and ours take `mu`: no call into TensorPipe holds it.
// `connect_mu` (which no callback takes) makes one pipe per peer.
std::shared_ptr<tp::Pipe> Agent::pipe_to(const std::string& to) {
  std::lock_guard<std::mutex> connecting(connect_mu);
  std::string url;
  {
    std::unique_lock<std::mutex> lock(mu);
    // A handler may call out while this worker still learns the others' addresses.
    if (!ready_cv.wait_for(lock, opts.timeout, [&] { return ready || closing; }))
      throw RpcError("rpc: worker '" + name + "' did not learn the other workers' addresses in time");
    if (closing) throw RpcError("rpc: shutting down; no new calls to '" + to + "'");
    if (dead.count(to)) throw RpcError("rpc: worker '" + to + "' is gone (its connection broke)");
    auto it = out_pipes.find(to);
    if (it != out_pipes.end()) return it->second;
    auto u = urls.find(to);
    if (u == urls.end()) {
      std::string known;
      for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
      throw RpcError("rpc: unknown worker '" + to + "' (workers: " + known + ")");
    }
    url = u->second;
  }
  auto pipe = ctx->connect(url, tp::PipeOptions().remoteName(to));
  {
    std::lock_guard<std::mutex> lock(mu);
    out_pipes[to] = pipe;
    peer_of[pipe.get()] = to;
  }
  read_loop(pipe);
  return pipe;
}

Future Agent::call(const std::string& to, const std::string& fn, Args args, std::chrono::milliseconds timeout,
                   const std::string& kind, const std::string& rref) {
  if (timeout.count() <= 0) timeout = opts.timeout;
  auto pipe = pipe_to(to);
  const int64_t context = dist_autograd::detail::current();
  uint64_t id;
  auto state = std::make_shared<Future::State>();
  {
    std::lock_guard<std::mutex> lock(mu);
    id = next_id++;
  }
  json header = {{"kind", kind}, {"id", id}, {"from", name}, {"fn", fn}, {"ctx", context}};
  if (!rref.empty()) header["rref"] = rref;
  std::vector<at::Tensor> tensors;
  std::vector<json> metas;
  json encoded = json::array();
  const std::string key_prefix = name + "/" + std::to_string(id) + "/q/";
  for (const auto& a : args) encoded.push_back(encode(a, tensors, metas, context, key_prefix, to));
  header["args"] = std::move(encoded);
  header["tensors"] = metas;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (dead.count(to)) throw RpcError("rpc: worker '" + to + "' is gone (its connection broke)");
    pending[id] = Pending{state, to, fn, Clock::now() + timeout, timeout, context};
  }
  std::weak_ptr<Agent> weak = weak_from_this();
  write(pipe, header, std::move(tensors), [weak, id, to, fn](const std::string& e) {
    if (auto self = weak.lock()) {
      std::shared_ptr<Future::State> st;
      {
        std::lock_guard<std::mutex> lock(self->mu);
        auto it = self->pending.find(id);
        if (it == self->pending.end()) return;
        st = it->second.state;
        self->pending.erase(it);
        if (self->pending.empty()) self->idle_cv.notify_all();
      }
      st->finish(Value(), "rpc: call to '" + fn + "' on worker '" + to + "' could not be sent: " + e);
    }
  });
  return Future(state);
}

// ---- receiving

void Agent::read_loop(const std::shared_ptr<tp::Pipe>& pipe) {
  std::weak_ptr<Agent> weak = weak_from_this();
  pipe->readDescriptor([weak, pipe](const tp::Error& e, tp::Descriptor d) {
    auto self = weak.lock();
    if (!self) return;
    if (e) return self->broken(pipe.get(), e.what());
    json header;
    std::vector<at::Tensor> tensors;
    tp::Allocation a;
    try {
      header = json::parse(d.metadata);
      for (const auto& m : header.at("tensors")) {
        if (m.at("wire").get<int64_t>() < 0) continue;
        at::Tensor t = at::empty(m.at("shape").get<std::vector<int64_t>>(),
                                 at::TensorOptions().dtype(static_cast<at::ScalarType>(m.at("dtype").get<int>())));
        tp::Allocation::Tensor at;
        at.buffer = tp::CpuBuffer{t.data_ptr()};
        a.tensors.push_back(std::move(at));
        tensors.push_back(std::move(t));
      }
      if (a.tensors.size() != d.tensors.size()) throw RpcError("the header and the message disagree on its tensors");
    } catch (const std::exception& ex) {
      return self->broken(pipe.get(), std::string("malformed message: ") + ex.what());
    }
    pipe->read(std::move(a), [weak, pipe, header = std::move(header), tensors = std::move(tensors)](const tp::Error& e) {
      auto self = weak.lock();
      if (!self) return;
      if (e) return self->broken(pipe.get(), e.what());
      self->dispatch(pipe, header, tensors);
      self->read_loop(pipe);
    });
  });
}

void Agent::dispatch(const std::shared_ptr<tp::Pipe>& pipe, json header, std::vector<at::Tensor> tensors) {
  const std::string kind = header.at("kind").get<std::string>();
  const std::string from = header.at("from").get<std::string>();
  if (tracing())
    std::fprintf(stderr, "[rpc %s] recv %s %s #%s from %s\n", name.c_str(), kind.c_str(),
                 header.value("fn", "").c_str(), header.at("id").dump().c_str(), from.c_str());
  {
    std::lock_guard<std::mutex> lock(mu);
    peer_of[pipe.get()] = from;
  }
  if (kind == "reply" || kind == "error") {
    const uint64_t id = header.at("id").get<uint64_t>();
    Pending p;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = pending.find(id);
      if (it == pending.end()) return;  // timed out already
      p = std::move(it->second);
      pending.erase(it);
      if (pending.empty()) idle_cv.notify_all();
    }
    if (kind == "error") return p.state->finish(Value(), header.at("error").get<std::string>());
    // Decoding may call the owner of a returned RRef: not on this thread.
    pool->submit([self = shared_from_this(), p, header = std::move(header), tensors = std::move(tensors)] {
      try {
        const std::string key_prefix = self->name + "/" + std::to_string(header.at("id").get<uint64_t>()) + "/r/";
        p.state->finish(self->decode(header.at("result"), tensors, header.at("tensors"), p.context, p.to, key_prefix),
                        "");
      } catch (const std::exception& e) {
        p.state->finish(Value(), std::string("rpc: reply of '") + p.fn + "' from worker '" + p.to +
                                     "' could not be read: " + e.what());
      }
    });
    return;
  }
  const std::string fn = header.at("fn").get<std::string>();
  if (kind == "call" && handled_inline(fn)) return handle(pipe, header, tensors);
  if (kind == "remote") {
    // Note [RRef counting]: the value exists, with the creator's count,
    // before any later message of the creator is read.
    const std::string id = header.at("rref").get<std::string>();
    std::lock_guard<std::mutex> lock(mu);
    Owned& o = owned[id];
    if (!o.slot) o.slot = std::make_shared<Slot>();
    o.count += 1;
    owned_cv.notify_all();
  }
  pool->submit([self = shared_from_this(), pipe, header = std::move(header), tensors = std::move(tensors)] {
    self->handle(pipe, header, tensors);
  });
}

void Agent::handle(const std::shared_ptr<tp::Pipe>& pipe, const json& header, const std::vector<at::Tensor>& tensors) {
  const std::string fn = header.at("fn").get<std::string>(), from = header.at("from").get<std::string>();
  const std::string kind = header.at("kind").get<std::string>();
  const int64_t context = header.value("ctx", int64_t{0});
  const std::string where = "rpc: '" + fn + "' on worker '" + name + "'";
  std::shared_ptr<Slot> slot;
  if (kind == "remote") {
    std::lock_guard<std::mutex> lock(mu);
    slot = owned.at(header.at("rref").get<std::string>()).slot;
  }
  const std::string previous_caller = t_caller;
  const int64_t previous_context = dist_autograd::detail::current();
  t_caller = from;
  dist_autograd::detail::set_current(context);
  Value result;
  std::string error;
  try {
    Registered r;
    {
      std::lock_guard<std::mutex> lock(registry_mu());
      auto it = registry().find(fn);
      if (it == registry().end()) throw RpcError(where + ": no function of that name is registered there");
      r = it->second;
    }
    const std::string key_prefix = from + "/" + std::to_string(header.at("id").get<uint64_t>()) + "/q/";
    Args args;
    for (const auto& a : header.at("args")) args.push_back(decode(a, tensors, header.at("tensors"), context, from, key_prefix));
    bool match = args.size() == r.params.size();
    for (size_t i = 0; match && i < args.size(); ++i)
      match = args[i].kind() == r.params[i] ||
              (r.params[i] == Value::Kind::Double && args[i].kind() == Value::Kind::Int);
    if (!match) {
      auto list = [](const std::vector<Value::Kind>& ks) {
        std::string s;
        for (auto k : ks) s += (s.empty() ? "" : ", ") + std::string(kind_name(k));
        return "(" + s + ")";
      };
      std::vector<Value::Kind> got;
      for (const auto& a : args) got.push_back(a.kind());
      throw RpcError(where + ": takes " + list(r.params) + ", was called with " + list(got));
    }
    result = r.fn(args);
  } catch (const RpcError& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = where + " raised: " + e.what();
  }
  t_caller = previous_caller;
  if (kind == "remote") {
    slot->finish(result, error);
    result = Value();  // the value stays here; the reply only says it is done
  }
  if (error.empty()) {
    try {
      reply(pipe, header, result, context);
    } catch (const std::exception& e) {
      reply_error(pipe, header, where + ": its result could not be sent: " + e.what());
    }
  } else {
    reply_error(pipe, header, error);
  }
  dist_autograd::detail::set_current(previous_context);
}

void Agent::reply(const std::shared_ptr<tp::Pipe>& pipe, const json& request, const Value& result, int64_t context) {
  const std::string from = request.at("from").get<std::string>();
  std::vector<at::Tensor> tensors;
  std::vector<json> metas;
  const std::string key_prefix = from + "/" + std::to_string(request.at("id").get<uint64_t>()) + "/r/";
  json r = {{"kind", "reply"}, {"id", request.at("id")}, {"from", name}};
  r["result"] = encode(result, tensors, metas, context, key_prefix, from);
  r["tensors"] = metas;
  write(pipe, r, std::move(tensors), nullptr);
}

void Agent::reply_error(const std::shared_ptr<tp::Pipe>& pipe, const json& request, const std::string& error) {
  json r = {{"kind", "error"}, {"id", request.at("id")}, {"from", name}, {"error", error}, {"tensors", json::array()}};
  write(pipe, r, {}, nullptr);
}

// ---- failures

void Agent::fail_pending_to(const std::string& worker, const std::string& why) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->second.to == worker) {
        failed.push_back(std::move(it->second));
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    if (pending.empty()) idle_cv.notify_all();
  }
  for (auto& p : failed) p.state->finish(Value(), "rpc: call to '" + p.fn + "' on worker '" + worker + "' failed: " + why);
}

void Agent::broken(const tp::Pipe* pipe, const std::string& what) {
  std::string peer;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = peer_of.find(pipe);
    if (it == peer_of.end() || closing) return;
    peer = it->second;
    dead.insert(peer);
  }
  fail_pending_to(peer, "worker '" + peer + "' is gone (" + what + ")");
}

void Agent::check_timeouts() {
  std::vector<Pending> expired;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second));
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    if (pending.empty()) idle_cv.notify_all();
  }
  for (auto& p : expired)
    p.state->finish(Value(), "rpc: call to '" + p.fn + "' on worker '" + p.to + "' timed out after " +
                                 std::to_string(p.timeout.count()) + " ms");
}

// ---- references (Note [RRef counting])

std::shared_ptr<Slot> Agent::find_owned(const std::string& id, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu);
  if (!owned_cv.wait_for(lock, timeout, [&] { return owned.count(id) > 0; }))
    throw RpcError("rpc: worker '" + name + "' owns no value '" + id + "' (freed, or never created)");
  return owned.at(id).slot;
}

void Agent::incref(const std::string& id, int64_t n) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = owned.find(id);
  if (it == owned.end()) {
    if (n < 0) return;
    throw RpcError("rpc: worker '" + name + "' owns no value '" + id + "' to count a reference to");
  }
  it->second.count += n;
  if (it->second.count <= 0) owned.erase(it);
}

RRef Agent::receive_rref(const std::string& owner, const std::string& id) {
  auto s = std::make_shared<RRefState>();
  s->owner = owner;
  s->id = id;
  if (owner == name) {
    // A reference come home: the count added for it becomes a local handle.
    s->slot = find_owned(id, opts.timeout);
    incref(id, -1);
  }
  return RRef(s);
}

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

const std::string& current_caller() { return t_caller; }

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

}  // namespace

void init_rpc(const std::string& name, int rank, int world_size, const c10::intrusive_ptr<c10d::Store>& store,
              const Options& options) {
  if (name.empty() || name.rfind("__", 0) == 0) throw std::invalid_argument("rpc: a worker needs a name not starting with __");
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("rpc: rank " + std::to_string(rank) + " is not in a world of " + std::to_string(world_size));
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
  a->ctx = std::make_shared<tp::Context>(tp::ContextOptions().name(name));
  // uv (TCP) carries the headers; tensors go by cross-memory attach between
  // processes of one host where the kernel allows it (TensorPipe picks the
  // highest priority both ends can use), else over the connection. The shm
  // transport is left out: its loop polls, a core's worth of spinning.
  a->ctx->registerTransport(0, "uv", tp::transport::uv::create());
  a->ctx->registerChannel(0, "basic", tp::channel::basic::create());
  if (auto cma = tp::channel::cma::create(); cma->isViable()) a->ctx->registerChannel(10, "cma", cma);
  a->listener = a->ctx->listen({"uv://" + host});
  const std::string url = a->listener->url("uv");
  a->pool = std::make_unique<Pool>(std::max(2, options.threads));
  std::weak_ptr<Agent> weak = a;
  struct Acceptor {
    static void next(const std::weak_ptr<Agent>& weak) {
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
        next(weak);
      });
    }
  };
  Acceptor::next(weak);
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
  // Published before this worker's address: a peer may call as soon as it
  // reads it, and the handlers reach the agent through g_agent.
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_agent = a;
  }
  auto key = [&](const std::string& k) { return a->prefix + k; };
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  try {
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
      std::lock_guard<std::mutex> lock(a->mu);
      a->names = std::move(names);
      a->urls = std::move(urls);
      a->ready = true;
    }
    a->ready_cv.notify_all();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_agent.reset();
    }
    {
      std::lock_guard<std::mutex> lock(a->mu);
      a->closing = true;
    }
    a->ctx->close();
    a->ctx->join();
    a->pool->stop();
    a->watchdog.join();
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
  std::vector<Pending> left;
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

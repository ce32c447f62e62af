// The TensorPipe agent's methods: the registry of callable functions, the
// wire format (Note [RPC messages]: encoding values, writing and reading
// messages), handling a request and replying, failures (Note [RPC failures]:
// broken pipes, timeouts) and the owner's table of referenced values (Note
// [RRef counting]). The agent itself is declared in rpc_internal.h; init_rpc
// and shutdown (rpc.cpp) start and stop it.
#include "scaletrain/rpc/rpc_internal.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "scaletrain/rpc/dist_autograd.h"

namespace scaletrain::rpc {

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

// ---------------------------------------------------------------- the agent

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

// Functions the pipe's loop thread handles itself, in arrival order: the
// reference counts, so a count sent before a call is seen before it.
bool handled_inline(const std::string& fn) { return fn == "__rref_incref" || fn == "__rref_decref"; }

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
    case Value::Kind::None:
      return {{"k", "none"}};
    case Value::Kind::Tensor:
      return {{"k", "tensor"}, {"t", add_tensor(v.tensor())}};
    case Value::Kind::Int:
      return {{"k", "int"}, {"v", v.to_int()}};
    case Value::Kind::Double: {
      const double d = v.to_double();
      if (std::isfinite(d)) return {{"k", "double"}, {"v", d}};
      return {{"k", "double"}, {"s", std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf")}};
    }
    case Value::Kind::Bool:
      return {{"k", "bool"}, {"v", v.to_bool()}};
    case Value::Kind::String:
      return {{"k", "string"}, {"v", v.str()}};
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
        detail::Owned& o = owned[s->id];
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
    pending[id] = detail::Pending{state, to, fn, Clock::now() + timeout, timeout, context};
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
    pipe->read(std::move(a),
               [weak, pipe, header = std::move(header), tensors = std::move(tensors)](const tp::Error& e) {
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
    detail::Pending p;
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
    detail::Owned& o = owned[id];
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
    for (const auto& a : header.at("args"))
      args.push_back(decode(a, tensors, header.at("tensors"), context, from, key_prefix));
    bool match = args.size() == r.params.size();
    for (size_t i = 0; match && i < args.size(); ++i)
      match =
          args[i].kind() == r.params[i] || (r.params[i] == Value::Kind::Double && args[i].kind() == Value::Kind::Int);
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

const std::string& current_caller() { return t_caller; }

// ---- failures

void Agent::fail_pending_to(const std::string& worker, const std::string& why) {
  std::vector<detail::Pending> failed;
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
  for (auto& p : failed)
    p.state->finish(Value(), "rpc: call to '" + p.fn + "' on worker '" + worker + "' failed: " + why);
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
  std::vector<detail::Pending> expired;
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

}  // namespace scaletrain::rpc

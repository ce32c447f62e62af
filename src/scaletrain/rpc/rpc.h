#pragma once
// Remote procedure calls between named workers, over TensorPipe: functions
// registered by name and called with typed arguments (rpc_sync, rpc_async),
// remote values held by their owner (remote, RRef), and the hooks distributed
// autograd (rpc/dist_autograd.h) needs.
//
// Note [RPC messages]: every message is one TensorPipe message whose metadata
// is a JSON header (kind, call id, function, the arguments' encodings) and
// whose tensors are the arguments' or the result's tensors, sent from their
// memory (contiguous CPU tensors; a tensor is read until its message is
// written) and received into tensors allocated from their descriptors. A
// worker connects one pipe to each peer it calls; a request's reply comes
// back on the pipe it came in on. Handlers run on a pool of threads, never on
// TensorPipe's loop, so a handler may itself call other workers.
//
// Note [RRef counting]: the owner of a remote value counts the references
// other workers hold to it (the owner's own handles are not counted). A
// reference is counted before it exists anywhere: remote() asks the owner to
// create the value with one count; a worker that passes a reference on
// (as an argument or a result) first has the owner add one for the receiver,
// synchronously, so the count can never touch zero while a reference is in
// flight. When a worker's last handle to a reference goes, it tells the
// owner (asynchronously, waited for by shutdown); at zero the owner frees the value.
//
// Note [RPC failures]: a call fails on the caller, with an RpcError naming the
// callee, when the callee raises (the handler's message), when the function
// is unknown or its arguments have the wrong kinds (the callee checks and
// keeps serving), when its timeout passes, or when the pipe to the callee
// breaks (the worker died): every call pending on that worker then fails at
// once. shutdown() is graceful: each worker waits for its own calls and
// reference messages, then for every worker not known dead to say the same,
// then closes.
#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}
namespace scaletrain::comm {
class World;
}

namespace scaletrain::rpc {

// A call that failed (remotely, by timeout, or a worker that went away).
class RpcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RRefState;  // rpc_internal.h
class RRef;

// An argument or a result.
class Value {
 public:
  enum class Kind { None, Tensor, Int, Double, Bool, String, TensorList, RRef };
  Value() = default;
  Value(at::Tensor t) : v_(std::move(t)) {}
  Value(int v) : v_(static_cast<int64_t>(v)) {}
  Value(int64_t v) : v_(v) {}
  Value(double v) : v_(v) {}
  Value(bool v) : v_(v) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::vector<at::Tensor> ts) : v_(std::move(ts)) {}
  Value(const RRef& r);

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  // Each throws RpcError naming the kind it holds when it holds another.
  const at::Tensor& tensor() const;
  int64_t to_int() const;
  double to_double() const;  // an Int converts
  bool to_bool() const;
  const std::string& str() const;
  const std::vector<at::Tensor>& tensors() const;
  RRef rref() const;

 private:
  std::variant<std::monostate, at::Tensor, int64_t, double, bool, std::string, std::vector<at::Tensor>,
               std::shared_ptr<RRefState>>
      v_;
};
const char* kind_name(Value::Kind k);

using Args = std::vector<Value>;
using Function = std::function<Value(const Args&)>;

// Registers `fn` as `name`, taking arguments of the kinds `params` (checked
// on the callee before it runs). Every worker that serves it registers it,
// before init_rpc. Names starting with "__" are the module's own.
void register_function(const std::string& name, std::vector<Value::Kind> params, Function fn);

struct Options {
  std::chrono::milliseconds timeout{60000};  // default per-call timeout
  int threads = 8;                            // handler threads
  // Address to listen on; empty: 127.0.0.1 when MASTER_ADDR is a loopback
  // address (or unset), else this host's address.
  std::string listen_address;
};

// Joins the RPC group: `name` must be unique; every worker calls this with
// the same world size and a store all of them reach (comm::World::store()).
void init_rpc(const std::string& name, int rank, int world_size, const c10::intrusive_ptr<c10d::Store>& store,
              const Options& options = {});
// The same from a job's world (the launcher's environment): this process's
// rank and world size, rendezvous through the world's store.
void init_rpc(const std::string& name, const comm::World& world, const Options& options = {});
// Graceful: see Note [RPC failures]. Pending work of this worker is waited for.
void shutdown();
bool initialized();
const std::string& worker_name();
int worker_rank();
std::vector<std::string> worker_names();

// The result of an asynchronous call.
class Future {
 public:
  struct State;
  Future() = default;
  explicit Future(std::shared_ptr<State> s) : s_(std::move(s)) {}
  // Blocks until the reply (or the failure) is there; throws RpcError.
  Value wait() const;
  bool done() const;

 private:
  std::shared_ptr<State> s_;
};

// timeout 0: the default of init_rpc's options.
Future rpc_async(const std::string& to, const std::string& fn, Args args,
                 std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
Value rpc_sync(const std::string& to, const std::string& fn, Args args,
               std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
// Runs `fn` on `to`, which keeps the result; returns at once with a reference to it.
RRef remote(const std::string& to, const std::string& fn, Args args,
            std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

// A reference to a value held by its owner (Note [RRef counting]).
class RRef {
 public:
  RRef() = default;
  explicit RRef(std::shared_ptr<RRefState> s) : s_(std::move(s)) {}
  const std::string& owner() const;
  bool is_owner() const;
  // A copy of the value, from the owner (waits for remote() to finish there).
  Value to_here(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const;
  // The value itself; on its owner only.
  Value local_value() const;
  const std::shared_ptr<RRefState>& state() const { return s_; }

 private:
  std::shared_ptr<RRefState> s_;
};

// A value this worker owns, as a reference others can be given.
RRef owned(Value v);
// Values this worker owns that some reference still names (tests).
int64_t owned_count();

// The worker that sent the request this thread is handling ("" outside a handler).
const std::string& current_caller();

}  // namespace scaletrain::rpc

#pragma once
// Internal to rpc/ (rpc.cpp, agent.cpp): the TensorPipe agent's state and the
// shared pieces behind the public types of rpc.h (a future's and a remote
// reference's state, the handler pool, a pending call, an owned value).
#include "scaletrain/rpc/rpc.h"

#include <tensorpipe/tensorpipe.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace scaletrain::rpc {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace tp = tensorpipe;

struct RRefState {
  std::string owner, id;
  std::shared_ptr<Future::State> slot;  // set on the owner: the value itself
  ~RRefState();
};

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

// A value owned here (Note [RRef counting]): a future's state, finished when
// its remote() has run.
using Slot = Future::State;

namespace detail {

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

}  // namespace detail

// Its methods are in agent.cpp; init_rpc and shutdown (rpc.cpp) start and stop it.
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
  std::map<uint64_t, detail::Pending> pending;
  std::set<std::string> dead;
  std::map<std::string, detail::Owned> owned;
  std::condition_variable owned_cv;
  uint64_t next_id = 1;
  int64_t next_rref = 1;
  bool closing = false;
  bool ready = false;  // names and addresses known (the end of init_rpc)
  std::condition_variable ready_cv;
  std::unique_ptr<detail::Pool> pool;
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

}  // namespace scaletrain::rpc

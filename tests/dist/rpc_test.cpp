// rpc/ on 3 workers (one per rank, named worker0..2) over TensorPipe:
// calls, errors, remote references and their counts, and distributed
// autograd against the same model in one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "dist_env.h"
#include "scaletrain/rpc/dist_autograd.h"
#include "scaletrain/rpc/rpc.h"

namespace scaletrain::test {
namespace rpc_test {

using rpc::Args;
using rpc::Value;
using K = rpc::Value::Kind;
namespace da = rpc::dist_autograd;

std::string name_of(int r) { return "worker" + std::to_string(r); }

// Functions every worker serves, registered once.
void register_test_functions() {
  static std::once_flag once;
  std::call_once(once, [] {
    rpc::register_function("add", {K::Tensor, K::Double}, [](const Args& a) { return Value(a[0].tensor() + a[1].to_double()); });
    rpc::register_function("whoami", {}, [](const Args&) { return Value(rpc::worker_name()); });
    rpc::register_function("caller", {}, [](const Args&) { return Value(rpc::current_caller()); });
    rpc::register_function("fail", {K::String}, [](const Args& a) -> Value { throw std::runtime_error(a[0].str()); });
    rpc::register_function("sleep_ms", {K::Int}, [](const Args& a) {
      std::this_thread::sleep_for(std::chrono::milliseconds(a[0].to_int()));
      return Value();
    });
    rpc::register_function("ones", {K::Int}, [](const Args& a) { return Value(torch::ones({a[0].to_int()}, torch::kDouble)); });
    rpc::register_function("sum_of_rref", {K::RRef}, [](const Args& a) {
      return Value(a[0].rref().to_here().tensor().sum().item<double>());
    });
    rpc::register_function("owned_count", {}, [](const Args&) { return Value(rpc::owned_count()); });
    rpc::register_function("echo_list", {K::TensorList}, [](const Args& a) { return Value(a[0].tensors()); });
  });
}

struct RpcSession {
  RpcSession() {
    register_test_functions();
    rpc::Options o;
    o.timeout = std::chrono::milliseconds(30000);
    rpc::init_rpc(name_of(world().rank()), world(), o);
  }
  ~RpcSession() {
    try {
      rpc::shutdown();
    } catch (const rpc::RpcError& e) {
      ADD_FAILURE() << e.what();
    }
  }
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const rpc::RpcError& e) {
    return e.what();
  }
  return "";
}

TEST(Rpc, CallsRepliesAndErrorsNameTheWorker) {
  RpcSession session;
  const int me = world().rank(), n = world().size();
  const std::string next = name_of((me + 1) % n);
  // Tensors and scalars both ways, to a peer and to itself.
  const auto x = torch::arange(6, torch::kDouble).view({2, 3});
  EXPECT_TRUE(rpc::rpc_sync(next, "add", {Value(x), Value(1.5)}).tensor().equal(x + 1.5));
  EXPECT_TRUE(rpc::rpc_sync(name_of(me), "add", {Value(x), Value(2)}).tensor().equal(x + 2));
  EXPECT_EQ(rpc::rpc_sync(next, "whoami", {}).str(), next);
  EXPECT_EQ(rpc::rpc_sync(next, "caller", {}).str(), name_of(me));
  EXPECT_EQ(rpc::rpc_sync(next, "ones", {Value(0)}).tensor().numel(), 0);
  const auto list = rpc::rpc_sync(next, "echo_list", {Value(std::vector<at::Tensor>{x, x * 2})}).tensors();
  ASSERT_EQ(list.size(), 2u);
  EXPECT_TRUE(list[1].equal(x * 2));
  // Many calls in flight at once.
  std::vector<rpc::Future> fs;
  for (int i = 0; i < 20; ++i) fs.push_back(rpc::rpc_async(next, "add", {Value(x), Value(i)}));
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(fs[i].wait().tensor().equal(x + i));
  // Errors reach the caller with the callee's name; the callee keeps serving.
  std::string e = error_of([&] { rpc::rpc_sync(next, "fail", {Value("boom")}); });
  EXPECT_NE(e.find("'" + next + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("boom"), std::string::npos) << e;
  e = error_of([&] { rpc::rpc_sync(next, "nope", {}); });
  EXPECT_NE(e.find("no function of that name"), std::string::npos) << e;
  e = error_of([&] { rpc::rpc_sync(next, "add", {Value("x"), Value(1.0)}); });
  EXPECT_NE(e.find("takes (tensor, double), was called with (string, double)"), std::string::npos) << e;
  e = error_of([&] { rpc::rpc_sync("worker9", "add", {}); });
  EXPECT_NE(e.find("unknown worker 'worker9'"), std::string::npos) << e;
  e = error_of([&] { rpc::rpc_sync(next, "sleep_ms", {Value(2000)}, std::chrono::milliseconds(100)); });
  EXPECT_NE(e.find("timed out after 100 ms"), std::string::npos) << e;
  EXPECT_EQ(rpc::rpc_sync(next, "whoami", {}).str(), next) << "the callee stopped serving";
}

TEST(Rpc, RemoteReferencesAreCountedByTheirOwner) {
  rpc::RRef late;
  {
    RpcSession session;
    const int me = world().rank(), n = world().size();
    const std::string owner = name_of((me + 1) % n), third = name_of((me + 2) % n);
    {
      rpc::RRef r = rpc::remote(owner, "ones", {Value(4)});
      EXPECT_EQ(r.owner(), owner);
      EXPECT_FALSE(r.is_owner());
      EXPECT_TRUE(r.to_here().tensor().equal(torch::ones({4}, torch::kDouble)));
      // Forwarded to a third worker, which fetches it from the owner.
      EXPECT_DOUBLE_EQ(rpc::rpc_sync(third, "sum_of_rref", {Value(r)}).to_double(), 4.0);
      // Sent back to its owner, it is the owner's own value there.
      EXPECT_DOUBLE_EQ(rpc::rpc_sync(owner, "sum_of_rref", {Value(r)}).to_double(), 4.0);
      // A failing remote() surfaces at to_here().
      rpc::RRef bad = rpc::remote(owner, "fail", {Value("no value")});
      const std::string e = error_of([&] { bad.to_here(); });
      EXPECT_NE(e.find("no value"), std::string::npos) << e;
      // A value this worker owns, given to a peer.
      rpc::RRef mine = rpc::owned(Value(torch::full({3}, 2.0, torch::kDouble)));
      EXPECT_TRUE(mine.is_owner());
      EXPECT_DOUBLE_EQ(rpc::rpc_sync(owner, "sum_of_rref", {Value(mine)}).to_double(), 6.0);
    }

    // Every handle is gone: once all decrements arrived, no owner holds anything.
    world().group()->barrier().wait();
    for (int attempt = 0; attempt < 200 && rpc::owned_count() > 0; ++attempt)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(rpc::owned_count(), 0);
    world().group()->barrier().wait();
    late = rpc::remote(owner, "ones", {Value(1)});  // outlives the session
    EXPECT_EQ(late.to_here().tensor().numel(), 1);
  }
  rpc::RRef none;
  EXPECT_NE(error_of([&] { none.to_here(); }).find("empty RRef"), std::string::npos);
  EXPECT_NE(error_of([&] { late.to_here(); }).find("RRef used after rpc::shutdown()"), std::string::npos);
}

// The same two-stage model, built from the same seed everywhere.
struct Model {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  Model() {
    torch::manual_seed(7);
    l1 = torch::nn::Linear(4, 8);
    l2 = torch::nn::Linear(8, 3);
    l1->to(torch::kDouble);
    l2->to(torch::kDouble);
  }
};
Model& stage_model() {
  static Model m;
  return m;
}

void register_stage_functions() {
  static std::once_flag once;
  std::call_once(once, [] {
    rpc::register_function("stage1", {K::Tensor}, [](const Args& a) { return Value(torch::tanh(stage_model().l1(a[0].tensor()))); });
    rpc::register_function("stage2", {K::Tensor}, [](const Args& a) { return Value(stage_model().l2(a[0].tensor())); });
    // Both stages from worker1, which calls worker2 itself: the context follows the nested call.
    rpc::register_function("stages12", {K::Tensor}, [](const Args& a) {
      const at::Tensor h = torch::tanh(stage_model().l1(a[0].tensor()));
      return rpc::rpc_sync("worker2", "stage2", {Value(h)});
    });
    rpc::register_function("stage_params", {K::Int}, [](const Args& a) {
      auto& m = stage_model();
      auto ps = a[0].to_int() == 1 ? m.l1->parameters() : m.l2->parameters();
      return Value(std::vector<at::Tensor>(ps.begin(), ps.end()));
    });
    rpc::register_function("stage_param_rref", {K::Int, K::Int}, [](const Args& a) {
      auto& m = stage_model();
      auto ps = a[0].to_int() == 1 ? m.l1->parameters() : m.l2->parameters();
      return Value(rpc::owned(Value(ps.at(static_cast<size_t>(a[1].to_int())))));
    });
    rpc::register_function("stage_grads", {K::Int, K::Int}, [](const Args& a) {
      auto& m = stage_model();
      std::vector<at::Tensor> out;
      for (const auto& p : (a[1].to_int() == 1 ? m.l1->parameters() : m.l2->parameters()))
      {
        if (p.grad().defined()) throw std::runtime_error("a distributed backward wrote .grad");
        const at::Tensor g = da::gradient(a[0].to_int(), p);
        out.push_back(g.defined() ? g : torch::zeros_like(p));  // none: zeros, seen as wrong below
      }
      return Value(out);
    });
  });
}

// A model split over 3 workers (worker1: linear + tanh, worker2: linear,
// worker0: the loss), driven from worker0 (calling each stage, or worker1
// calling worker2 itself), equals the model in one process: the gradients of
// the first backward, and the parameters after 4 SGD steps, fp64, within 1e-10.
TEST(Rpc, DistributedAutogradEqualsOneProcess) {
  if (world().size() != 3) GTEST_SKIP() << "needs 3 workers";
  register_stage_functions();
  stage_model();  // built before any handler runs
  RpcSession session;
  if (world().rank() == 0) {
    Model ref;
    torch::optim::SGD ref_opt(std::vector<at::Tensor>{ref.l1->weight, ref.l1->bias, ref.l2->weight, ref.l2->bias},
                              torch::optim::SGDOptions(0.1));
    std::vector<rpc::RRef> params;
    for (int stage : {1, 2})
      for (int i = 0; i < 2; ++i)
        params.push_back(rpc::rpc_sync(name_of(stage), "stage_param_rref", {Value(stage), Value(i)}).rref());
    da::DistributedOptimizer opt("sgd", 0.1, params);
    torch::manual_seed(11);
    for (int step = 0; step < 4; ++step) {
      const auto x = torch::randn({5, 4}, torch::kDouble), y = torch::randn({5, 3}, torch::kDouble);
      da::Context ctx;
      // Odd steps: worker1 calls worker2 (a nested call), even ones: worker0 calls each.
      const auto out = step % 2 ? rpc::rpc_sync("worker1", "stages12", {Value(x)}).tensor()
                                : rpc::rpc_sync("worker2", "stage2",
                                                {rpc::rpc_sync("worker1", "stage1", {Value(x)})}).tensor();
      const auto loss = torch::mse_loss(out, y);
      da::backward(ctx.id(), {loss});
      ref_opt.zero_grad();
      const auto ref_loss = torch::mse_loss(ref.l2(torch::tanh(ref.l1(x))), y);
      ref_loss.backward();
      EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-12) << "step " << step;
      if (step == 0) {  // gradients live in the context on their owners, not in .grad
        for (int stage : {1, 2}) {
          const auto got = rpc::rpc_sync(name_of(stage), "stage_grads", {Value(ctx.id()), Value(stage)}).tensors();
          const auto& mod = stage == 1 ? ref.l1 : ref.l2;
          ASSERT_EQ(got.size(), 2u);
          EXPECT_LE((got[0] - mod->weight.grad()).abs().max().item<double>(), 1e-10) << "stage " << stage;
          EXPECT_LE((got[1] - mod->bias.grad()).abs().max().item<double>(), 1e-10) << "stage " << stage;
        }
      }
      opt.step(ctx.id());
      ref_opt.step();
    }
    for (int stage : {1, 2}) {
      const auto got = rpc::rpc_sync(name_of(stage), "stage_params", {Value(stage)}).tensors();
      const auto& mod = stage == 1 ? ref.l1 : ref.l2;
      EXPECT_LE((got[0] - mod->weight).abs().max().item<double>(), 1e-10) << "stage " << stage;
      EXPECT_LE((got[1] - mod->bias).abs().max().item<double>(), 1e-10) << "stage " << stage;
      const Model init;
      EXPECT_GT((got[0] - (stage == 1 ? init.l1->weight : init.l2->weight)).abs().max().item<double>(), 1e-3)
          << "the parameters of stage " << stage << " did not move";
    }
  }
}

// A synchronous parameter server: worker0 holds a small network; worker1
// and worker2 each fetch its output for their own batch, compute their loss,
// and send the gradients back with distributed autograd; the server averages
// the two and steps once per round. That is one process training on both
// batches' mean loss: after 5 rounds the parameters agree within 1e-10.
struct ParameterServer {
  torch::nn::Sequential net{nullptr};
  std::mutex mu;
  std::condition_variable cv;
  int round = 0, submitted = 0;
  std::vector<at::Tensor> sum;
  static constexpr int kTrainers = 2;
  static constexpr double kLr = 0.2;
  ParameterServer() { net = make_net(); }
  static torch::nn::Sequential make_net() {
    torch::manual_seed(3);
    torch::nn::Sequential n(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
    n->to(torch::kDouble);
    return n;
  }
};
ParameterServer& server() {
  static ParameterServer ps;
  return ps;
}
// Trainer t's batch of round k: the same wherever it is drawn.
std::pair<at::Tensor, at::Tensor> ps_batch(int round, int trainer) {
  auto gen = at::detail::createCPUGenerator(1000 + 10 * round + trainer);
  return {at::randn({6, 4}, gen, torch::kDouble), at::randn({6, 2}, gen, torch::kDouble)};
}

void register_ps_functions() {
  static std::once_flag once;
  std::call_once(once, [] {
    rpc::register_function("ps_forward", {K::Tensor}, [](const Args& a) { return Value(server().net->forward(a[0].tensor())); });
    rpc::register_function("ps_submit", {K::Int}, [](const Args& a) {
      ParameterServer& ps = server();
      std::unique_lock<std::mutex> lock(ps.mu);
      const auto params = ps.net->parameters();
      if (ps.sum.empty())
        for (const auto& p : params) ps.sum.push_back(torch::zeros_like(p));
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor g = da::gradient(a[0].to_int(), params[i]);
        if (g.defined()) ps.sum[i].add_(g);
      }
      const int mine = ps.round;
      if (++ps.submitted == ParameterServer::kTrainers) {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) {
          params[i].sub_(ParameterServer::kLr * ps.sum[i] / ParameterServer::kTrainers);
          ps.sum[i].zero_();
        }
        ps.submitted = 0;
        ++ps.round;
        ps.cv.notify_all();
      }
      ps.cv.wait(lock, [&] { return ps.round > mine; });
      return Value(ps.round);
    });
  });
}

TEST(Rpc, ParameterServerTrainsAsOneProcess) {
  if (world().size() != 3) GTEST_SKIP() << "needs 3 workers";
  register_ps_functions();
  server();
  RpcSession session;
  constexpr int kRounds = 5;
  const int me = world().rank();
  if (me != 0) {
    for (int round = 0; round < kRounds; ++round) {
      const auto [x, y] = ps_batch(round, me);
      da::Context ctx;
      const auto out = rpc::rpc_sync("worker0", "ps_forward", {Value(x)}).tensor();
      EXPECT_TRUE(out.requires_grad()) << "the server's output came without its autograd record";
      da::backward(ctx.id(), {torch::mse_loss(out, y)});
      EXPECT_EQ(rpc::rpc_sync("worker0", "ps_submit", {Value(ctx.id())}).to_int(), round + 1);
    }
    return;
  }
  {
    std::unique_lock<std::mutex> lock(server().mu);
    server().cv.wait(lock, [&] { return server().round == kRounds; });
  }
  auto ref = ParameterServer::make_net();
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(ParameterServer::kLr));
  for (int round = 0; round < kRounds; ++round) {
    opt.zero_grad();
    at::Tensor loss = torch::zeros({}, torch::kDouble);
    for (int t = 1; t <= ParameterServer::kTrainers; ++t) {
      const auto [x, y] = ps_batch(round, t);
      loss = loss + torch::mse_loss(ref->forward(x), y) / ParameterServer::kTrainers;
    }
    loss.backward();
    opt.step();
  }
  const auto got = server().net->parameters(), want = ref->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE((got[i] - want[i]).abs().max().item<double>(), 1e-10) << "parameter " << i;
  EXPECT_GT((want[0] - ParameterServer::make_net()->parameters()[0]).abs().max().item<double>(), 1e-3)
      << "training did not move the parameters";
}

}  // namespace rpc_test
}  // namespace scaletrain::test

namespace scaletrain::test {
namespace rpc_test {

// A worker that dies (worker2 exits in a handler, with calls pending on it
// from the two others): every pending call fails at once with an error
// naming it, long before its timeout, and shutdown() on the survivors
// returns. Run alone: it ends worker2's process.
TEST(RpcFaults, AWorkerThatDiesFailsItsPendingCallsAndShutdownReturns) {
  if (world().size() != 3) GTEST_SKIP() << "needs 3 workers";
  register_test_functions();
  rpc::register_function("die", {}, [](const Args&) -> Value {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::_Exit(0);
  });
  RpcSession session;
  if (world().rank() == 2) return;  // serves until its own handler ends the process
  const auto t0 = std::chrono::steady_clock::now();
  rpc::Future pending = rpc::rpc_async("worker2", "sleep_ms", {Value(20000)});
  if (world().rank() == 0) rpc::rpc_async("worker2", "die", {});
  const std::string e = error_of([&] { pending.wait(); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(e.find("worker 'worker2' is gone"), std::string::npos) << e;
  EXPECT_LT(s, 10.0) << "the pending call failed only after " << s << " s (timeout 30 s)";
  // New calls to it fail at once; the survivors still talk.
  EXPECT_NE(error_of([&] { rpc::rpc_sync("worker2", "whoami", {}); }).find("worker2"), std::string::npos);
  EXPECT_EQ(rpc::rpc_sync(name_of(1 - world().rank()), "whoami", {}).str(), name_of(1 - world().rank()));
}

}  // namespace rpc_test
}  // namespace scaletrain::test

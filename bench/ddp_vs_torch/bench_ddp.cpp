// Step time of scaletrain's DDP on a GPT, with the two times that overlap
// efficiency needs, all measured in one process run:
//
//   comp  forward + backward + AdamW on a plain copy of the model (no DDP):
//         the compute-only step, T_comp
//   comm  the all-reduces DDP issues in a step (same bucket sizes, same
//         order, started back to back, then all waited): T_comm
//   ddp   forward + backward + AdamW under DistributedDataParallel: T_step,
//         and the time backward waited on communication (comm_wait)
//
// overlap efficiency = (T_comp + T_comm - T_step) / min(T_comp, T_comm)
// (1: communication fully hidden; 0: none hidden).
//
// The phases take turns for --rounds rounds, so a disturbance hits all of
// them alike. A step's time is the slowest rank's; each figure is the median
// over all timed steps. Inputs are random tokens (the data pipeline is not
// what is measured). Rank 0 prints one JSON line (read by
// scripts/bench-ddp.sh) and, with --table, a readable summary.
//
// Run: build/scaletrain launch --nproc-per-node 2 --threads 1 -- build-bench/bench/bench_ddp
// (or with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand, as the
// network-namespace runs of scripts/bench-ddp.sh do).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "scaletrain/comm/world.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/parallel/ddp/ddp.h"

namespace {

using namespace scaletrain;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string preset = "tiny";
  int64_t n_layer = 0, n_head = 0, n_embd = 0;  // 0: the preset's
  int64_t global_batch = 16;                    // sequences per step over all ranks
  int64_t seq = 0;                              // 0: the preset's block_size
  int steps = 10;                               // timed steps per phase per round
  int warmup = 3;                               // untimed steps per phase, first round
  int rounds = 3;
  double bucket_mb = 25, first_bucket_mb = 1, last_bucket_mb = 1, tail_growth = 1.5;
  bool table = false;
  std::string phases = "comp,comm,ddp";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto v = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ddp: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--preset") a.preset = v();
    else if (k == "--n-layer") a.n_layer = std::stoll(v());
    else if (k == "--n-head") a.n_head = std::stoll(v());
    else if (k == "--n-embd") a.n_embd = std::stoll(v());
    else if (k == "--global-batch") a.global_batch = std::stoll(v());
    else if (k == "--seq") a.seq = std::stoll(v());
    else if (k == "--steps") a.steps = std::stoi(v());
    else if (k == "--warmup") a.warmup = std::stoi(v());
    else if (k == "--rounds") a.rounds = std::stoi(v());
    else if (k == "--bucket-mb") a.bucket_mb = std::stod(v());
    else if (k == "--first-bucket-mb") a.first_bucket_mb = std::stod(v());
    else if (k == "--last-bucket-mb") a.last_bucket_mb = std::stod(v());
    else if (k == "--tail-growth") a.tail_growth = std::stod(v());
    else if (k == "--phases") a.phases = v();
    else if (k == "--table") a.table = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_ddp [--preset P] [--n-layer L] [--n-head H] [--n-embd E] [--global-batch B] "
                   "[--seq T] [--steps S] [--warmup W] [--rounds R] [--bucket-mb M] [--first-bucket-mb M] "
                   "[--last-bucket-mb M] [--tail-growth G] "
                   "[--phases comp,comm,ddp] [--table]\n");
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int threads_from_env() {
  for (const char* var : {"SCALETRAIN_THREADS", "OMP_NUM_THREADS"})
    if (const char* s = std::getenv(var))
      if (int n = std::atoi(s); n > 0) return n;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  torch::set_num_threads(threads_from_env());
  auto world = comm::World::init();
  comm::Group& g = *world->group();
  const int n = world->size(), rank = world->rank();

  models::GPTConfig cfg = models::gpt_preset(a.preset);
  if (a.n_layer) cfg.n_layer = a.n_layer;
  if (a.n_head) cfg.n_head = a.n_head;
  if (a.n_embd) cfg.n_embd = a.n_embd;
  const int64_t T = a.seq ? a.seq : cfg.block_size;
  if (a.global_batch % n != 0) {
    std::fprintf(stderr, "bench_ddp: global batch %lld is not divisible by %d ranks\n",
                 static_cast<long long>(a.global_batch), n);
    return 2;
  }
  const int64_t B = a.global_batch / n;

  torch::manual_seed(1234);
  models::GPT plain(cfg);  // compute-only twin
  torch::manual_seed(1234);
  models::GPT model(cfg);
  parallel::DDPOptions dopt;
  dopt.bucket_cap_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  dopt.first_bucket_cap_bytes = static_cast<int64_t>(a.first_bucket_mb * (1 << 20));
  dopt.last_bucket_cap_bytes = static_cast<int64_t>(a.last_bucket_mb * (1 << 20));
  dopt.tail_growth = a.tail_growth;
  parallel::DistributedDataParallel ddp(model.ptr(), g, dopt);
  auto params_of = [](models::GPT& m) {
    std::vector<at::Tensor> ps;
    for (auto& p : m->parameters()) ps.push_back(p);
    return ps;
  };
  optim::AdamW opt_plain(params_of(plain), optim::decay_matrices(params_of(plain)));
  optim::AdamW opt_ddp(params_of(model), optim::decay_matrices(params_of(model)));

  // A few fixed random batches, different on each rank.
  torch::manual_seed(99 + rank);
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < 4; ++i) {
    auto tok = torch::randint(cfg.vocab_size, {B, T + 1}, torch::kLong);
    xs.push_back(tok.narrow(1, 0, T).contiguous());
    ys.push_back(tok.narrow(1, 1, T).contiguous());
  }

  // Rank 0's split of a step, compute-only and under DDP: forward (with
  // zero_grad), backward (under DDP: until every bucket is reduced),
  // optimizer.
  struct Split {
    std::vector<double> fwd, bwd, opt;
  };
  Split comp_split, ddp_split;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  auto train_step = [&](models::GPT& m, optim::AdamW& opt, int i, Split* split) {
    auto t0 = Clock::now();
    opt.zero_grad();
    auto loss = m->loss(xs[i % xs.size()], ys[i % ys.size()]);
    auto t1 = Clock::now();
    loss.backward();
    auto t2 = Clock::now();
    opt.step(1e-4);
    if (split) {
      split->fwd.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      split->bwd.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      split->opt.push_back(ms_since(t2));
    }
  };
  // The all-reduce-only phase replays DDP's buckets (same sizes, same order)
  // as they are after the first step has rebuilt them in ready order.
  train_step(model, opt_ddp, 0, nullptr);
  std::map<std::string, int64_t> numel_of;
  for (auto& it : model->named_parameters()) numel_of[it.key()] = it.value().numel();
  std::vector<at::Tensor> buckets;
  for (auto& names : ddp.bucket_layout()) {
    int64_t k = 0;
    for (auto& nm : names) k += numel_of.at(nm);
    buckets.push_back(torch::randn({k}));
  }
  auto comm_step = [&] {
    torch::NoGradGuard ng;
    std::vector<comm::Work> ws;
    for (auto& b : buckets) {
      b.div_(n);  // DDP divides before summing; keep the values bounded too
      ws.push_back(g.all_reduce(b));
    }
    for (auto& w : ws) w.wait();
  };
  auto barrier = [&] { g.barrier().wait(); };

  std::vector<std::string> phases;
  for (size_t s = 0, e; s <= a.phases.size(); s = e + 1) {
    e = a.phases.find(',', s);
    if (e == std::string::npos) e = a.phases.size();
    if (e > s) phases.push_back(a.phases.substr(s, e - s));
  }
  std::map<std::string, std::vector<double>> times;  // ms per step, slowest rank
  // CPU time of the whole process per step (rank 0; every thread, and the
  // kernel's work on its behalf): what communication costs a core that
  // compute would otherwise have.
  std::map<std::string, std::vector<double>> cpu;
  auto cpu_ms = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
  };
  std::vector<double> waits;                         // DDP comm_wait ms per step (rank 0)

  for (int r = 0; r < a.rounds; ++r) {
    for (size_t pi = 0; pi < phases.size(); ++pi) {
      const std::string& ph = phases[(pi + r) % phases.size()];
      const int warm = r == 0 ? a.warmup : 1;
      std::vector<double> local;
      for (int i = 0; i < warm + a.steps; ++i) {
        barrier();  // steps start together, as in a real DDP step
        ddp.reset_stats();
        const double c0 = cpu_ms();
        auto t0 = Clock::now();
        if (ph == "comp")
          train_step(plain, opt_plain, i, i >= warm ? &comp_split : nullptr);
        else if (ph == "ddp")
          train_step(model, opt_ddp, i, i >= warm ? &ddp_split : nullptr);
        else if (ph == "comm")
          comm_step();
        else {
          std::fprintf(stderr, "bench_ddp: unknown phase '%s'\n", ph.c_str());
          return 2;
        }
        double ms = ms_since(t0);
        if (i >= warm) {
          local.push_back(ms);
          cpu[ph].push_back(cpu_ms() - c0);
          if (ph == "ddp") waits.push_back(ddp.comm_wait_ms());
        }
      }
      auto t = torch::tensor(local, torch::kDouble);
      g.all_reduce(t, comm::ReduceOp::Max).wait();
      auto acc = t.accessor<double, 1>();
      for (int64_t i = 0; i < acc.size(0); ++i) times[ph].push_back(acc[i]);
    }
  }

  if (rank == 0) {
    std::string numels;
    for (auto& b : buckets) numels += (numels.empty() ? "" : ", ") + std::to_string(b.numel());
    const double comp = median(times["comp"]), comm_t = median(times["comm"]), step = median(times["ddp"]);
    const double wait = median(waits);
    const double eff = (comp > 0 && comm_t > 0 && step > 0) ? (comp + comm_t - step) / std::min(comp, comm_t) : -1;
    const double tok_s = step > 0 ? a.global_batch * T / (step / 1000.0) : 0;
    std::printf(
        "{\"impl\": \"scaletrain\", \"world\": %d, \"threads\": %d, \"params\": %lld, \"global_batch\": %lld, "
        "\"seq\": %lld, \"buckets\": %d, \"step_ms\": %.3f, \"comp_ms\": %.3f, \"comm_ms\": %.3f, "
        "\"comm_wait_ms\": %.3f, \"overlap_eff\": %.3f, \"tokens_per_s\": %.1f, \"steps_timed\": %zu, "
        "\"comp_fwd_ms\": %.3f, \"comp_bwd_ms\": %.3f, \"comp_opt_ms\": %.3f, \"ddp_fwd_ms\": %.3f, "
        "\"ddp_bwd_ms\": %.3f, \"ddp_opt_ms\": %.3f, \"comp_cpu_ms\": %.3f, \"comm_cpu_ms\": %.3f, "
        "\"ddp_cpu_ms\": %.3f, \"bucket_numels\": [%s]}\n",
        n, torch::get_num_threads(), static_cast<long long>(model->num_parameters()),
        static_cast<long long>(a.global_batch), static_cast<long long>(T), ddp.num_buckets(), step, comp, comm_t, wait,
        eff, tok_s, times["ddp"].size(), median(comp_split.fwd), median(comp_split.bwd), median(comp_split.opt),
        median(ddp_split.fwd), median(ddp_split.bwd), median(ddp_split.opt), median(cpu["comp"]),
        median(cpu["comm"]), median(cpu["ddp"]), numels.c_str());
    if (a.table)
      std::printf(
          "T_step %.1f ms (fwd %.1f, bwd %.1f, opt %.1f), T_comp %.1f ms (fwd %.1f, bwd %.1f, opt %.1f), "
          "T_comm %.1f ms, comm_wait %.1f ms, overlap efficiency %.2f\n",
          step, median(ddp_split.fwd), median(ddp_split.bwd), median(ddp_split.opt), comp, median(comp_split.fwd),
          median(comp_split.bwd), median(comp_split.opt), comm_t, wait, eff);
    std::fflush(stdout);
  }
  barrier();
  return 0;
}

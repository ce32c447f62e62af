// Bus bandwidth of scaletrain's collectives next to raw c10d Gloo, in one run.
//
//   build/scaletrain launch --nproc-per-node 2 -- build-bench/bench/bench_collectives [--reps 9]
//
// Definitions follow nccl-tests (doc/PERFORMANCE.md): S is the size of the
// full buffer (the all-reduce tensor; the reduce-scatter input; the
// all-gather output), algbw = S / t, and busbw = algbw * 2(n-1)/n for
// all_reduce and algbw * (n-1)/n for reduce_scatter and all_gather, so that a
// collective running at the link speed shows the same busbw whatever n is.
//
// Each process holds two process groups over the same transport settings:
// scaletrain's world group (comm::World, what every strategy uses) and a raw
// c10d::ProcessGroupGloo on its own c10d::TCPStore (MASTER_PORT + 1). The raw
// side is the best one can do by hand with c10d primitives on libtorch 1.13:
//   all_reduce      raw: ProcessGroupGloo::allreduce
//   reduce_scatter  raw: alltoall_base of the n chunks + a local sum (Gloo has
//                   no reduce_scatter); "naive": allreduce of the whole buffer
//                   (what one writes without the all_to_all trick: 2x volume)
//   all_gather      raw: list-form allgather into views of the output (Gloo
//                   has no _allgather_base)
//   all_to_all      raw: alltoall_base, equal splits
//   all_to_all_v    raw: alltoall_base with uneven split sizes (expert
//                   parallelism's token exchange: Group::all_to_all_v)
// For each size the implementations take turns within every repetition, so
// a disturbance (another process on the machine) hits all of them alike.
// A repetition times `iters` back-to-back synchronous operations; its time
// is the maximum over ranks; the table shows the median over repetitions.
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "scaletrain/comm/compat.h"
#include "scaletrain/comm/env.h"
#include "scaletrain/comm/world.h"
#include "raw_gloo.h"

namespace {

using namespace scaletrain;
using Clock = std::chrono::steady_clock;

struct Args {
  int64_t min_bytes = 1 << 10;
  int64_t max_bytes = 64ll << 20;
  int reps = 9;
  int64_t bytes_per_rep = 32ll << 20;  // iters per repetition ~ this / size
  bool naive = true;                   // add the allreduce-based reduce_scatter
  std::vector<std::string> ops{"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v"};
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_collectives: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--min-bytes") a.min_bytes = std::stoll(next());
    else if (k == "--max-bytes") a.max_bytes = std::stoll(next());
    else if (k == "--reps") a.reps = std::stoi(next());
    else if (k == "--bytes-per-rep") a.bytes_per_rep = std::stoll(next());
    else if (k == "--no-naive") a.naive = false;
    else if (k == "--ops") {
      a.ops.clear();
      std::string list = next();
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        a.ops.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: bench_collectives [--min-bytes N] [--max-bytes N] [--reps R] [--bytes-per-rep N] "
                   "[--no-naive] [--ops all_reduce,reduce_scatter,all_gather,all_to_all,all_to_all_v]\n");
      std::exit(2);
    }
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Impl {
  std::string name;
  std::function<void()> op;  // one synchronous operation
  std::vector<double> secs;  // per-op time of each repetition
};

std::string human(int64_t b) {
  char s[32];
  if (b >= (1 << 20)) std::snprintf(s, sizeof s, "%lld MiB", static_cast<long long>(b >> 20));
  else std::snprintf(s, sizeof s, "%lld KiB", static_cast<long long>(b >> 10));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  comm::WorldInfo info = comm::world_info_from_env();
  auto world = comm::World::init(info, {});
  comm::Group& g = *world->group();
  auto raw = bench::make_raw_gloo(info);
  const int n = info.world_size, rank = info.rank;
  if (n < 2) {
    std::fprintf(stderr, "bench_collectives: run it under `scaletrain launch --nproc-per-node N` with N >= 2\n");
    return 2;
  }
  torch::NoGradGuard no_grad;

  // The slowest rank's time of a repetition, known on every rank.
  auto max_over_ranks = [&](double s) {
    auto t = torch::tensor({s}, torch::kDouble);
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    raw->allreduce(ts, o)->wait();
    return t.item<double>();
  };
  auto barrier = [&] { raw->barrier()->wait(); };

  if (rank == 0) {
    std::printf("| op | size | ours time (us) | raw time (us) | ours busbw (GB/s) | raw busbw (GB/s) | ours/raw busbw |\n");
    std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  }
  for (const std::string& op : args.ops) {
    for (int64_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= 4) {
      // S = bytes of the full buffer, a multiple of n floats.
      const int64_t numel = std::max<int64_t>(n, (bytes / 4) / n * n);
      const int64_t k = numel / n;
      auto full = torch::randn({numel});
      auto full2 = full.clone();
      auto shard = torch::randn({k});
      auto out = torch::empty({numel});
      std::vector<Impl> impls;
      if (op == "all_reduce") {
        impls.push_back({"ours", [&] { g.all_reduce(full).wait(); }, {}});
        impls.push_back({"raw", [&] {
                           std::vector<at::Tensor> ts{full2};
                           raw->allreduce(ts)->wait();
                         }, {}});
      } else if (op == "reduce_scatter") {
        impls.push_back({"ours", [&] { g.reduce_scatter(full, shard).wait(); }, {}});
        impls.push_back({"raw", [&] {
                           std::vector<int64_t> even;
                           raw->alltoall_base(out, full2, even, even)->wait();
                           shard.copy_(out.view({n, k}).sum(0));
                         }, {}});
        if (args.naive)
          impls.push_back({"naive", [&] {
                             std::vector<at::Tensor> ts{full2};
                             raw->allreduce(ts)->wait();
                             shard.copy_(full2.narrow(0, rank * k, k));
                           }, {}});
      } else if (op == "all_to_all") {
        impls.push_back({"ours", [&] { g.all_to_all(full, out).wait(); }, {}});
        impls.push_back({"raw", [&] {
                           std::vector<int64_t> even;
                           raw->alltoall_base(out, full2, even, even)->wait();
                         }, {}});
      } else if (op == "all_to_all_v") {
        // Uneven rows, as expert parallelism sends them: rank r sends rank j a
        // share proportional to 1 + (r + j) % n of its buffer (rows of 64
        // floats), and every rank's counts are known to its peers.
        const int64_t row = 64, rows = numel / row;
        auto split = [&](int from) {
          std::vector<int64_t> s(static_cast<size_t>(n));
          int64_t weight = 0, given = 0;
          for (int j = 0; j < n; ++j) weight += 1 + (from + j) % n;
          for (int j = 0; j < n; ++j) {
            s[static_cast<size_t>(j)] = j + 1 < n ? rows * (1 + (from + j) % n) / weight : rows - given;
            given += s[static_cast<size_t>(j)];
          }
          return s;
        };
        const std::vector<int64_t> in_rows = split(rank);
        std::vector<int64_t> out_rows(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) out_rows[static_cast<size_t>(i)] = split(i)[static_cast<size_t>(rank)];
        int64_t received = 0;
        for (int64_t v : out_rows) received += v;
        auto x = full.narrow(0, 0, rows * row).view({rows, row});
        auto y = torch::empty({received, row});
        auto y2 = torch::empty({received, row});
        std::vector<int64_t> in_elems, out_elems;
        for (int j = 0; j < n; ++j) {
          in_elems.push_back(in_rows[static_cast<size_t>(j)] * row);
          out_elems.push_back(out_rows[static_cast<size_t>(j)] * row);
        }
        impls.push_back({"ours", [&, x, y, in_rows, out_rows] { g.all_to_all_v(x, y, in_rows, out_rows).wait(); }, {}});
        impls.push_back({"raw", [&, x, y2, in_elems, out_elems] {
                           auto xf = x.reshape({-1}), yf = y2.view({-1});
                           std::vector<int64_t> in_s = in_elems, out_s = out_elems;
                           raw->alltoall_base(yf, xf, out_s, in_s)->wait();
                         }, {}});
      } else {
        impls.push_back({"ours", [&] { g.all_gather(shard, full).wait(); }, {}});
        impls.push_back({"raw", [&] {
                           std::vector<std::vector<at::Tensor>> outs(1);
                           for (int i = 0; i < n; ++i) outs[0].push_back(full2.narrow(0, i * k, k));
                           std::vector<at::Tensor> ins{shard};
                           raw->allgather(outs, ins)->wait();
                         }, {}});
      }
      const int64_t S = numel * 4;
      const int iters = static_cast<int>(std::clamp<int64_t>(args.bytes_per_rep / S, 2, 200));
      // Warm-up: connections, allocations, page faults.
      for (auto& im : impls)
        for (int i = 0; i < 2; ++i) im.op();
      for (int r = 0; r < args.reps; ++r) {
        for (size_t j = 0; j < impls.size(); ++j) {
          auto& im = impls[(j + r) % impls.size()];  // rotate who goes first
          barrier();
          auto t0 = Clock::now();
          for (int i = 0; i < iters; ++i) im.op();
          double s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
          im.secs.push_back(max_over_ranks(s));
        }
      }
      // all_to_all (nccl-tests' alltoall): S = bytes each rank sends, (n-1)/n of them cross the wire.
      const double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : 1.0 * (n - 1) / n;
      auto busbw = [&](double t) { return S / t * factor / 1e9; };
      const double t_ours = median(impls[0].secs), t_raw = median(impls[1].secs);
      if (rank == 0) {
        std::printf("| %s | %s | %.1f | %.1f | %.3f | %.3f | %.2f |\n", op.c_str(), human(S).c_str(), t_ours * 1e6,
                    t_raw * 1e6, busbw(t_ours), busbw(t_raw), t_raw / t_ours);
        if (impls.size() > 2) {
          const double t_naive = median(impls[2].secs);
          std::printf("| %s (naive: raw allreduce + slice) | %s | | %.1f | | %.3f | %.2f |\n", op.c_str(),
                      human(S).c_str(), t_naive * 1e6, busbw(t_naive), t_naive / t_ours);
        }
        std::fflush(stdout);
      }
    }
  }
  if (rank == 0) std::printf("\nworld size %d, %d repetitions per size, median of the slowest rank's per-op time\n", n, args.reps);
  barrier();
  return 0;
}

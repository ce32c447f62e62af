// Round trips of rpc_sync (rpc/, over TensorPipe) next to raw c10d Gloo
// send/recv, in one run, on 2 ranks.
//
// A round trip carries S bytes each way: rpc_sync(worker1, "echo", {x})
// returns x; the raw one is rank 0 sending x to rank 1, which receives it and
// sends it back. Per size: the median over --reps repetitions (each of
// --iters round trips, after warm-up ones), the two interleaved; bandwidth =
// 2 S / t.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "scaletrain/comm/env.h"
#include "scaletrain/comm/world.h"
#include "raw_gloo.h"
#include "scaletrain/rpc/rpc.h"

using namespace scaletrain;

namespace {


double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string human(int64_t b) {
  char s[32];
  if (b >= (1 << 20))
    std::snprintf(s, sizeof s, "%lld MiB", static_cast<long long>(b >> 20));
  else
    std::snprintf(s, sizeof s, "%lld KiB", static_cast<long long>(b >> 10));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  int64_t max_bytes = int64_t{64} << 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (a == "--max-mib" && i + 1 < argc) {
      max_bytes = static_cast<int64_t>(std::atoi(argv[++i])) << 20;
    } else {
      std::fprintf(stderr, "usage: bench_rpc [--reps K] [--max-mib M]\n");
      return 2;
    }
  }
  torch::set_num_threads(1);
  const comm::WorldInfo info = comm::world_info_from_env();
  if (info.world_size != 2) {
    std::fprintf(stderr, "bench_rpc: runs on 2 ranks\n");
    return 2;
  }
  auto world = comm::World::init(info, {});
  auto raw = bench::make_raw_gloo(info);
  rpc::register_function("echo", {rpc::Value::Kind::Tensor}, [](const rpc::Args& a) { return a[0]; });
  rpc::init_rpc("worker" + std::to_string(info.rank), info.rank, 2, world->store());
  const int peer = 1 - info.rank;
  if (info.rank == 0) {
    std::printf("| size | rpc_sync round trip (us) | raw send/recv round trip (us) | rpc_sync GB/s | raw GB/s | rpc/raw |\n");
    std::printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
  }
  for (int64_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
    at::Tensor x = torch::rand({bytes / 4});
    const int iters = bytes <= (1 << 20) ? 50 : (bytes <= (16 << 20) ? 5 : 2);
    std::vector<double> t_rpc, t_raw;
    auto raw_round = [&] {
      std::vector<at::Tensor> ts{x};
      if (info.rank == 0) {
        raw->send(ts, peer, 0)->wait();
        raw->recv(ts, peer, 1)->wait();
      } else {
        raw->recv(ts, peer, 0)->wait();
        raw->send(ts, peer, 1)->wait();
      }
    };
    for (int r = -1; r < reps; ++r) {  // r = -1: warm-up
      raw->barrier()->wait();
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) raw_round();
      const double raw_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
      raw->barrier()->wait();
      double rpc_s = 0;
      if (info.rank == 0) {
        t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
          const at::Tensor back = rpc::rpc_sync("worker1", "echo", {rpc::Value(x)}).tensor();
          if (back.numel() != x.numel()) return 1;
        }
        rpc_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
      }
      raw->barrier()->wait();
      if (r >= 0) {
        t_raw.push_back(raw_s);
        t_rpc.push_back(rpc_s);
      }
    }
    if (info.rank == 0) {
      const double a = median(t_rpc), b = median(t_raw);
      std::printf("| %s | %.1f | %.1f | %.3f | %.3f | %.2f |\n", human(bytes).c_str(), a * 1e6, b * 1e6,
                  2.0 * static_cast<double>(bytes) / a / 1e9, 2.0 * static_cast<double>(bytes) / b / 1e9, b / a);
      std::fflush(stdout);
    }
  }
  rpc::shutdown();
  raw->barrier()->wait();
  return 0;
}

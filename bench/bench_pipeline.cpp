// Pipeline and tensor-parallel measurements, one process per rank under
// `scaletrain launch` (or in network namespaces for wire bytes).
//
//   bench_pipeline pp [--layers L --embd C --heads H --seq T --micro B --steps S --ms 1,2,4,8 --v V]
//     For each schedule and micro-batch count m, with p = world size stages:
//     median step time, measured bubble (1 - time in forward/backward
//     actions / step time, averaged over stages), the textbook bubble, and
//     the peak heap bytes held by activations on each stage. One JSON line per case.
//   bench_pipeline tp [--layers L ...] [--sp]
//     Forward+backward steps of a tensor-parallel GPT (tp = world size);
//     with BENCH_IFACE set, the bytes this rank sent on that interface
//     (/sys/class/net/IFACE/statistics/tx_bytes) during the timed steps.
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "scaletrain/comm/env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/parallel/pipeline/pipeline.h"
#include "scaletrain/parallel/tensor/tensor_parallel.h"

namespace st = scaletrain;
namespace pl = scaletrain::parallel::pipeline;

namespace {

struct Args {
  std::string mode;
  int64_t layers = 8, embd = 256, heads = 8, seq = 128, micro = 2;
  int steps = 6, v = 2;
  std::vector<int> ms{1, 2, 4, 8};
  bool sp = false;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw std::invalid_argument("usage: bench_pipeline pp|tp [options]");
  a.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&] { return std::string(argv[++i]); };
    if (k == "--layers") a.layers = std::stoll(next());
    else if (k == "--embd") a.embd = std::stoll(next());
    else if (k == "--heads") a.heads = std::stoll(next());
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--micro") a.micro = std::stoll(next());
    else if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--v") a.v = std::stoi(next());
    else if (k == "--sp") a.sp = true;
    else if (k == "--ms") {
      a.ms.clear();
      std::stringstream ss(next());
      for (std::string t; std::getline(ss, t, ',');) a.ms.push_back(std::stoi(t));
    } else throw std::invalid_argument("unknown option " + k);
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

st::models::GPTConfig model(const Args& a) { return {256, a.seq, a.layers, a.heads, a.embd}; }

std::vector<at::Tensor> tokens(int n, const Args& a, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(torch::randint(0, 256, {a.micro, a.seq}, gen, torch::kLong));
  return out;
}

void run_pp(st::comm::World& world, const Args& a) {
  auto& g = *world.group();
  const int p = g.size();
  for (pl::Schedule s : {pl::Schedule::GPipe, pl::Schedule::OneFOneB, pl::Schedule::Interleaved})
    for (int m : a.ms) {
      const int v = s == pl::Schedule::Interleaved ? a.v : 1;
      if (s == pl::Schedule::Interleaved && m % p != 0) continue;
      torch::manual_seed(1);
      st::models::GPT gpt(model(a));
      pl::PipelineOptions po;
      po.schedule = s;
      po.microbatches = m;
      po.virtual_stages = v;
      po.micro_batch = a.micro;
      pl::Pipeline pipe(gpt.ptr(), g, nullptr, po);
      std::vector<double> step, compute;
      int64_t peak = 0;
      const auto xs = tokens(m, a, 2), ys = tokens(m, a, 3);
      for (int i = 0; i < a.steps + 1; ++i) {
        g.barrier().wait();
        pipe.step(xs, ys);
        for (auto c : pipe.chunks()) c->zero_grad();
        pipe.zero_grad();
        if (i == 0) continue;  // warm-up: first-touch allocations
        step.push_back(pipe.last_stats().step_ms);
        compute.push_back(pipe.last_stats().compute_ms);
        peak = std::max(peak, pipe.last_stats().peak_activation_bytes);
      }
      // Per stage: [step ms, bubble, peak bytes]; gathered by summing one-hot rows.
      at::Tensor row = torch::zeros({p, 3}, torch::kDouble);
      row[g.rank()][0] = median(step);
      row[g.rank()][1] = 1.0 - median(compute) / median(step);
      row[g.rank()][2] = static_cast<double>(peak);
      g.all_reduce(row, st::comm::ReduceOp::Sum).wait();
      if (g.rank() != 0) continue;
      double step_ms = 0, bubble = 0;
      std::string peaks;
      for (int r = 0; r < p; ++r) {
        step_ms = std::max(step_ms, row[r][0].item<double>());
        bubble += row[r][1].item<double>() / p;
        peaks += (r ? "," : "") + std::to_string(static_cast<int64_t>(row[r][2].item<double>()));
      }
      std::printf(
          "{\"schedule\": \"%s\", \"p\": %d, \"m\": %d, \"v\": %d, \"step_ms\": %.2f, \"bubble\": %.4f, "
          "\"expected_bubble\": %.4f, \"peak_activation_bytes\": [%s]}\n",
          pl::to_string(s).c_str(), p, m, v, step_ms, bubble, pl::expected_bubble({s, p, m, v}), peaks.c_str());
      std::fflush(stdout);
    }
}

int64_t tx_bytes() {
  const char* iface = std::getenv("BENCH_IFACE");
  if (!iface) return -1;
  std::ifstream in(std::string("/sys/class/net/") + iface + "/statistics/tx_bytes");
  int64_t b = -1;
  in >> b;
  return b;
}

void run_tp(st::comm::World& world, const Args& a) {
  auto& g = *world.group();
  torch::manual_seed(1);
  st::models::GPT gpt(model(a));
  st::parallel::tensor::TensorParallelOptions to;
  to.sequence_parallel = a.sp;
  st::parallel::tensor::parallelize_tensor(*gpt, g, to);
  const auto xs = tokens(1, a, 2), ys = tokens(1, a, 3);
  auto step = [&] {
    gpt->zero_grad();
    gpt->loss(xs[0], ys[0]).backward();
  };
  step();  // warm-up
  g.barrier().wait();
  const int64_t before = tx_bytes();
  for (int i = 0; i < a.steps; ++i) step();
  const int64_t after = tx_bytes();
  g.barrier().wait();
  if (g.rank() == 0)
    std::printf("{\"tp\": %d, \"layers\": %lld, \"sp\": %s, \"steps\": %d, \"tx_bytes_per_step\": %.0f}\n", g.size(),
                static_cast<long long>(a.layers), a.sp ? "true" : "false", a.steps,
                before < 0 ? -1.0 : static_cast<double>(after - before) / a.steps);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    torch::set_num_threads(1);
    auto world = st::comm::World::init(st::comm::world_info_from_env(), {});
    if (a.mode == "pp") run_pp(*world, a);
    else if (a.mode == "tp") run_tp(*world, a);
    else throw std::invalid_argument("mode must be pp or tp");
    world->group()->barrier().wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
    return 2;
  }
  return 0;
}

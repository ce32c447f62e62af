// Peak resident memory of loading a Hugging Face Hub directory into a model
// sharded with ZeRO-3, per rank (scripts/bench-hub-load.sh writes the
// checkpoint and runs it on 1 and on 4 ranks; figures in bench/RESULTS.md).
//
//   scaletrain launch --nproc-per-node N -- bench_hub_load DIR [--whole]
//
// Each rank builds the model without parameter bytes and the sharded engine
// fills its shards: by default every rank reads only its own part of each
// tensor from the memory-mapped files (ShardedOptions::deferred_slice_init);
// --whole is the path model.init_from takes where slices are not possible
// (rank 0 reads each tensor whole, broadcasts it, every rank keeps its part).
// Parameters and shards are fp32, as the trainer's default.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "scaletrain/comm/world.h"
#include "scaletrain/hub/hub_load.h"
#include "scaletrain/observe/memory.h"
#include "scaletrain/parallel/fsdp/fsdp.h"
#include "scaletrain/parallel/zero/zero.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/model_config.h"

namespace st = scaletrain;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_hub_load DIR [--whole]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const bool whole = argc > 2 && std::strcmp(argv[2], "--whole") == 0;
  try {
    auto world = st::comm::World::init(st::comm::world_info_from_env(), {});
    st::config::ModelOptions mo;
    mo.init_from = dir;
    const st::models::ModelConfig config = st::train::resolve_model_config(mo);
    const double rss_before = st::observe::rss_peak_mb();
    const auto t0 = std::chrono::steady_clock::now();

    auto model = st::models::make_model(config, /*materialize=*/false);
    st::parallel::zero::ZeroOptions z;
    z.stage = 3;
    st::parallel::fsdp::ShardedOptions o = st::parallel::zero::sharded_options(z);
    o.master_dtype = at::kFloat;
    if (whole)
      o.deferred_init = st::hub::hub_init(*model, dir);
    else
      o.deferred_slice_init = st::hub::hub_slice_init(*model, dir);
    st::parallel::fsdp::ShardedDataParallel engine(model, *model, *world, *world->group(), nullptr, o);
    world->group()->barrier().wait();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    double shard_mib = 0;
    for (const auto& t : engine.shards()) shard_mib += static_cast<double>(t.nbytes()) / (1 << 20);
    std::printf(
        "rank %d of %d (%s): peak RSS %.0f MiB (%.0f before loading), file-backed now %.0f MiB, "
        "shards %.0f MiB, %.1f s\n",
        world->rank(), world->size(), whole ? "whole tensors from rank 0" : "own slices", st::observe::rss_peak_mb(),
        rss_before, st::observe::rss_file_mb(), shard_mib, seconds);
    std::fflush(stdout);
    world->group()->barrier().wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_hub_load: %s\n", e.what());
    return 1;
  }
  return 0;
}

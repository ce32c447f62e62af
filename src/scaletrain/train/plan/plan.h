#pragma once
// A run's config turned into one validated plan: the model's dimensions, the
// mesh degrees, the batch layout, the schedule's shape and the dtypes. Every
// check that needs no peer lives here and runs before any peer is contacted,
// and every problem found is reported at once (Note [One plan]).
//
// Note [One plan]
// make_plan() runs each check, collects the problems instead of stopping at
// the first, and throws one UsageError: "3 problems in the config: A; B; C".
// A check whose inputs failed (the mesh when the world does not fit it, say)
// is skipped rather than reported twice. Besides values and combinations, it
// refuses settings that would be accepted and then ignored: a key of a
// section that does not apply to the run (parallel.fsdp.* under zero2,
// pipeline keys without parallel.pp > 1, loss-scaling keys without loss
// scaling...) set to a value other than its default (Note [Settings that
// apply]). What is accepted but works differently from what a reader might
// expect is said once at start (notices).
#include <cstdint>
#include <string>
#include <vector>

#include "scaletrain/comm/mesh.h"
#include "scaletrain/models/causal_lm.h"
#include "scaletrain/precision/policy.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/train/plan/device.h"
#include "scaletrain/train/plan/engine_plan.h"

namespace scaletrain::train {

// MS-AMP's optimization levels (precision.fp8_opt_level; kNone: unset).
enum class Fp8OptLevel { kNone, kO1, kO2, kO3 };
inline bool fp8_moments(Fp8OptLevel l) { return l == Fp8OptLevel::kO2 || l == Fp8OptLevel::kO3; }

// Where the sharded engine keeps shards off the device (parallel.zero.offload_*
// and parallel.fsdp.offload_params, which is kCpu).
enum class Offload { kNone, kCpu, kNvme };

struct Plan {
  models::ModelConfig model;             // dimensions after preset, overrides and model.init_from
  precision::PrecisionPolicy policy;   // dtypes of compute, parameters, reduction, buffers
  comm::MeshDims dims;                 // resolved for the world size
  at::Device device{at::DeviceType::CPU};  // host: until resolved; where this rank computes (train.device)
  bool cuda = false;                   // device is a CUDA device
  int64_t micro_batch = 0;             // sequences per forward (parallel.microbatches may set it)
  int64_t accum = 0;                   // micro-batches per step on each data-parallel rank
  bool deferred_init = false;          // parameters are initialized shard by shard (zero3, cpu_ram_efficient_loading)
  bool full_state_dict = false;        // checkpoints are consolidated by rank 0 (FULL_STATE_DICT)
  config::DataParallelism data_parallel = config::DataParallelism::kDdp;
  Fp8OptLevel fp8_level = Fp8OptLevel::kNone;
  Offload offload_params = Offload::kNone;     // sharded parameters (zero3, fsdp)
  Offload offload_optimizer = Offload::kNone;  // the fp32 shards and Adam moments (zero1-3)
  std::vector<std::string> notices;    // lines rank 0 prints once at start ("scaletrain: note: ...")
  EnginePlan engines;                  // what parallelize() builds (train/plan/engine_plan.h)
};

// Validates `config` for `world_size` ranks, the device resolved for the rank
// with `local_rank`; throws UsageError listing every problem (Note [One plan]).
Plan make_plan(const config::Config& config, int world_size, int local_rank = 0,
               const DeviceEnvironment& env = DeviceEnvironment::probe());

}  // namespace scaletrain::train

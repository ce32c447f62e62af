#pragma once
// Hugging Face Accelerate config files (written by `accelerate config`) as
// scaletrain configs: `scaletrain train accelerate.yaml` and
// `scaletrain launch --config_file accelerate.yaml -- scaletrain train ...`.
// See accelerate_config.cpp, Note [Accelerate keys].
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>

#include "scaletrain/config/config.h"

namespace scaletrain::config {

// What an Accelerate file said that is settled only after the whole config
// (YAML, overrides) is known.
struct AccelerateSettings {
  std::string file;                        // the file these came from ("" = none)
  std::string strategy;                    // parallel.strategy implied by distributed_type / fsdp_config ("" = none)
  std::string implied_by;                  // the key that implied it, for messages
  std::string mixed_precision;             // precision.mode implied by mixed_precision ("" = none)
  std::map<std::string, std::string> fp8;  // precision.fp8* keys implied by mixed_precision: fp8 and fp8_config
  bool fp8_config = false;                 // the file has an fp8_config section
  nlohmann::json deepspeed;                // deepspeed_config translated to DeepSpeed JSON (null = none)
  std::string deepspeed_file;              // deepspeed_config.deepspeed_config_file, resolved ("" = none)
  std::vector<std::string> launcher;       // launcher keys present (notice: read by `scaletrain launch`)
};

// True for the top-level keys `accelerate config` writes.
bool is_accelerate_key(const std::string& name);

// Applies one top-level Accelerate key of `file` to `config` (fsdp_config's
// keys map onto parallel.fsdp.*, no-effect keys append to config.notices)
// and records in `out` what finish_accelerate() settles. Throws UsageError
// naming the key.
void read_accelerate_key(Config& config, AccelerateSettings& out, const std::string& name, const YAML::Node& value,
                         const std::string& file);

// After overrides: the implied strategy and precision (an explicit,
// disagreeing parallel.strategy / precision.mode in `given` is an error), the
// DeepSpeed section or file, and the notices. `given` holds the
// "section.key" names set explicitly; `model_width` as for load_config.
void finish_accelerate(Config& config, const AccelerateSettings& s, const std::set<std::string>& given,
                       const ModelWidth& model_width);

// The launcher's part of an Accelerate file (`accelerate launch --config_file`).
struct AccelerateLaunch {
  int num_processes = 1;           // over all machines (Accelerate's convention)
  int num_machines = 1;            // nodes
  int machine_rank = 0;            // this node's index
  std::string main_process_ip;     // rank 0's host ("" = not given)
  int main_process_port = 0;       // rendezvous port (0 = not given)
  std::vector<std::string> notes;  // launcher keys accepted without effect, one line each
};

// Reads the launcher keys of an Accelerate file; the training keys are left
// to `scaletrain train` (the launcher passes the file to the workers in
// SCALETRAIN_ACCELERATE_CONFIG). Throws UsageError for an unreadable file,
// a num_processes not divisible by num_machines, or a rendezvous this
// launcher cannot do.
AccelerateLaunch read_accelerate_launch(const std::string& path);

// Environment variable through which `scaletrain launch --config_file` hands
// the Accelerate file to each `scaletrain train` worker (load_config reads it
// after the worker's own config file).
inline constexpr const char* kAccelerateConfigEnv = "SCALETRAIN_ACCELERATE_CONFIG";

}  // namespace scaletrain::config

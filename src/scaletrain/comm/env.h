#pragma once
// Where this process sits in the job, read from the environment that a
// launcher left: torchrun / `scaletrain launch` (RANK, WORLD_SIZE, ...), Open
// MPI's mpirun (OMPI_COMM_WORLD_*), or Slurm's srun (SLURM_PROCID, ...).
// No variables at all means a single process.
#include <cstdint>
#include <functional>
#include <string>

namespace scaletrain::comm {

struct WorldInfo {
  int rank = 0;              // global rank, 0 <= rank < world_size
  int world_size = 1;        // number of processes in the job
  int local_rank = 0;        // rank among the processes on this host
  int local_world_size = 1;  // processes on this host
  std::string master_addr = "127.0.0.1";  // host of the rendezvous store (rank 0's host)
  int master_port = 29500;                // port of the rendezvous store
  std::string source = "single";          // "torchrun", "openmpi", "slurm" or "single"
  // Note [torchrun's agent store]: torchrun's agent (static rendezvous)
  // serves a c10d TCPStore at MASTER_ADDR:MASTER_PORT itself
  // (TORCHELASTIC_USE_AGENT_STORE=True); every rank is then its client, under
  // the prefix of the agent's restart count.
  bool agent_store = false;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  // The store secret the launcher's job identity gives when
  // SCALETRAIN_STORE_SECRET is not set: Slurm's job and step ids, Open MPI's
  // job id, torchrun's run id; empty when the launcher gives none. It keeps
  // two jobs apart (one cannot join the other's store by a port collision),
  // not an attacker out: job ids are public on the host.
  std::string job_secret;
};

using GetEnv = std::function<const char*(const char*)>;

// Reads the launcher's variables through `getenv` (tests pass a fake one).
// Precedence: torchrun's RANK/WORLD_SIZE, then Open MPI, then Slurm.
// Inconsistent values throw UsageError naming the variable.
WorldInfo world_info_from_env(const GetEnv& getenv);
WorldInfo world_info_from_env();

// First host of a Slurm node list: "gpu[07-09,12],cpu1" -> "gpu07".
std::string first_slurm_host(const std::string& nodelist);

// Whether this process is a task of an srun step (SLURM_STEP_ID, or the
// older SLURM_STEPID, is set); a batch script is not (Note [Slurm's batch
// step] in env.cpp).
bool in_slurm_step(const GetEnv& getenv);
// The rendezvous store's port and secret of a Slurm job step: one port per
// step, so two jobs sharing a node or two steps of one job running at once
// do not meet in one store (the step moves the port by a prime, so
// consecutive jobs and steps differ); the secret keeps jobs apart.
int slurm_step_port(int64_t job, int step);
std::string slurm_step_secret(int64_t job, int step);

}  // namespace scaletrain::comm

#include "scaletrain/comm/env.h"

#include <cctype>
#include <cstdlib>
#include <string>

#include "scaletrain/util/error.h"

namespace scaletrain::comm {
namespace {

int parse_int(const GetEnv& getenv, const char* name, int fallback, bool required) {
  const char* v = getenv(name);
  if (!v || !*v) {
    if (required) throw UsageError(std::string("environment variable ") + name + " is not set");
    return fallback;
  }
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > 1 << 24)
    throw UsageError(std::string("environment variable ") + name + "='" + v + "' is not a valid count");
  return static_cast<int>(x);
}

std::string str(const GetEnv& getenv, const char* name, const std::string& fallback) {
  const char* v = getenv(name);
  return (v && *v) ? std::string(v) : fallback;
}

// "2(x3),1" -> 2: tasks on the first node, which is the one we cannot tell
// apart from others without more variables; SLURM_NTASKS_PER_NODE wins if set.
int leading_int(const std::string& s, int fallback) {
  size_t i = 0;
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
  return i ? std::stoi(s.substr(0, i)) : fallback;
}

void validate(const WorldInfo& w) {
  if (w.world_size < 1) throw UsageError("world size must be at least 1");
  if (w.rank >= w.world_size)
    throw UsageError("rank " + std::to_string(w.rank) + " is not below world size " +
                     std::to_string(w.world_size) + " (from " + w.source + " variables)");
  if (w.local_world_size < 1 || w.local_rank >= w.local_world_size)
    throw UsageError("local rank " + std::to_string(w.local_rank) + " is not below local world size " +
                     std::to_string(w.local_world_size) + " (from " + w.source + " variables)");
  if (w.master_port < 1 || w.master_port > 65535)
    throw UsageError("MASTER_PORT " + std::to_string(w.master_port) + " is not a TCP port");
}

}  // namespace

bool in_slurm_step(const GetEnv& getenv) { return getenv("SLURM_STEP_ID") || getenv("SLURM_STEPID"); }

int slurm_step_port(int64_t job, int step) { return 20000 + static_cast<int>((job + 7919LL * step) % 20000); }

std::string slurm_step_secret(int64_t job, int step) {
  return "slurm-" + std::to_string(job) + "." + std::to_string(step);
}

std::string first_slurm_host(const std::string& nodelist) {
  std::string first = nodelist.substr(0, nodelist.find_first_of(",["));
  size_t open = nodelist.find('[');
  size_t comma = nodelist.find(',');
  if (open == std::string::npos || (comma != std::string::npos && comma < open)) return first;
  // prefix[07-09,12] -> prefix07 (keeping leading zeros)
  size_t end = nodelist.find_first_of("-,]", open + 1);
  return first + nodelist.substr(open + 1, end - open - 1);
}

// Note [Slurm's batch step]: measured with Slurm 22.05 on one node, an
// sbatch -n2 script sees SLURM_PROCID=0, SLURM_NTASKS=2 and no
// SLURM_STEP_ID (nor the older SLURM_STEPID); each task of an srun inside it
// sees SLURM_STEP_ID=0, 1, ... A trainer run directly in the script would
// serve the store as rank 0 of 2 and wait out the timeout for a rank that
// never starts, so it is refused at once. (A world of one in a batch script
// is a real run.) tests/launchers/cluster.sh runs both for real.
//
// Note [Open MPI's job id]: every mpirun gives its processes one job id
// (OMPI_MCA_ess_base_jobid, also PMIX_NAMESPACE), the same on every rank and
// different for the next mpirun: measured with Open MPI 4.1, 1105199105 and
// 1104871425 for two runs, i.e. 0x41E0 0001 and 0x41DB 0001, a 16-bit job
// family above a 16-bit job number. Mixing the halves before the modulo
// keeps the family's 16 bits; the job id itself modulo 20000 would take
// only 625 values (65536 = 5536 mod 20000, which shares 32 with 20000).
// Note [Stale RANK and WORLD_SIZE]: RANK and WORLD_SIZE win over the other
// launchers' variables, since `scaletrain launch` and torchrun set them for
// workers that may sit inside an srun step or an mpirun (whose own counts
// are then the launchers', not the workers'). Both also set
// TORCHELASTIC_RESTART_COUNT. Without it, RANK and WORLD_SIZE were exported
// by hand or by a script, and when mpirun, an srun step or MPICH says
// otherwise, every rank would train as the same rank of a world they do
// not form: refused, naming both.
void check_not_stale(const GetEnv& getenv, int rank, int world_size) {
  if (getenv("TORCHELASTIC_RESTART_COUNT")) return;
  // A PyTorchJob pod: its RANK and WORLD_SIZE count pods, and
  // PET_NPROC_PER_NODE processes per pod need a launcher in the pod.
  const int per_pod = parse_int(getenv, "PET_NPROC_PER_NODE", 1, false);
  if (per_pod > 1)
    throw UsageError("PET_NPROC_PER_NODE=" + std::to_string(per_pod) + " asks for " + std::to_string(per_pod) +
                     " processes per pod, but this one process was started with RANK and WORLD_SIZE counting "
                     "pods: make the pod's command `scaletrain launch -- scaletrain train ...`");
  struct Other {
    const char* rank;
    const char* size;
    const char* who;
  };
  const bool srun_step = in_slurm_step(getenv);
  for (const Other& o : {Other{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun"},
                         Other{"SLURM_PROCID", "SLURM_NTASKS", "srun"}, Other{"PMI_RANK", "PMI_SIZE", "mpiexec"}}) {
    if (!getenv(o.rank) || (std::string(o.who) == "srun" && !srun_step)) continue;
    const int r = parse_int(getenv, o.rank, 0, true), n = parse_int(getenv, o.size, 1, false);
    if (r != rank || n != world_size)
      throw UsageError("RANK=" + std::to_string(rank) + " and WORLD_SIZE=" + std::to_string(world_size) +
                       " are set, but " + o.who + " started this process as rank " + std::to_string(r) + " of " +
                       std::to_string(n) + " (" + o.rank + ", " + o.size + "): unset RANK and WORLD_SIZE (exported "
                       "by hand?) or start the job with scaletrain launch");
  }
}

WorldInfo world_info_from_env(const GetEnv& getenv) {
  WorldInfo w;
  if (getenv("RANK") || getenv("WORLD_SIZE")) {
    w.source = "torchrun";
    w.rank = parse_int(getenv, "RANK", 0, true);
    w.world_size = parse_int(getenv, "WORLD_SIZE", 1, true);
    check_not_stale(getenv, w.rank, w.world_size);
    w.local_rank = parse_int(getenv, "LOCAL_RANK", w.rank, false);
    const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    w.agent_store = agent != nullptr && std::string(agent) == "True";
    if (w.agent_store) w.restart_count = parse_int(getenv, "TORCHELASTIC_RESTART_COUNT", 0, false);
    w.local_world_size = parse_int(getenv, "LOCAL_WORLD_SIZE", w.world_size, false);
    const std::string run_id = str(getenv, "TORCHELASTIC_RUN_ID", "");
    if (!run_id.empty() && run_id != "none") w.job_secret = "torchrun-" + run_id;
  } else if (getenv("OMPI_COMM_WORLD_RANK")) {
    w.source = "openmpi";
    w.rank = parse_int(getenv, "OMPI_COMM_WORLD_RANK", 0, true);
    w.world_size = parse_int(getenv, "OMPI_COMM_WORLD_SIZE", 1, true);
    w.local_rank = parse_int(getenv, "OMPI_COMM_WORLD_LOCAL_RANK", 0, false);
    w.local_world_size = parse_int(getenv, "OMPI_COMM_WORLD_LOCAL_SIZE", w.world_size, false);
    // One port per mpirun, so two jobs on one host do not meet in one store
    // (Note [Open MPI's job id]).
    const std::string job = str(getenv, "OMPI_MCA_ess_base_jobid", "");
    if (!job.empty()) {
      char* end = nullptr;
      const unsigned long long id = std::strtoull(job.c_str(), &end, 10);
      if (end == job.c_str() || *end != '\0')
        throw UsageError("OMPI_MCA_ess_base_jobid '" + job + "' is not a job id (a non-negative integer)");
      w.master_port = 20000 + static_cast<int>(((id >> 16) ^ (id & 0xffff)) % 20000);
      w.job_secret = "openmpi-" + job;
    }
  } else if (getenv("SLURM_PROCID")) {
    w.source = "slurm";
    w.rank = parse_int(getenv, "SLURM_PROCID", 0, true);
    w.world_size = parse_int(getenv, "SLURM_NTASKS", 1, true);
    // Note [Slurm's batch step]: the batch script itself has SLURM_PROCID 0
    // and the job's SLURM_NTASKS but no step id; every srun step has one.
    if (!in_slurm_step(getenv) && w.world_size > 1)
      throw UsageError("this is the batch script of Slurm job " + str(getenv, "SLURM_JOB_ID", "?") + ", one task of " +
                       std::to_string(w.world_size) + " (SLURM_NTASKS): start the ranks with `srun scaletrain ...`, "
                       "or with `scaletrain launch` inside the script");
    w.local_rank = parse_int(getenv, "SLURM_LOCALID", 0, false);
    std::string per_node = str(getenv, "SLURM_NTASKS_PER_NODE", str(getenv, "SLURM_TASKS_PER_NODE", ""));
    w.local_world_size = leading_int(per_node, w.world_size);
    std::string nodes = str(getenv, "SLURM_JOB_NODELIST", str(getenv, "SLURM_NODELIST", ""));
    if (!nodes.empty()) w.master_addr = first_slurm_host(nodes);
    const int job = parse_int(getenv, "SLURM_JOB_ID", 0, false);
    const int step = parse_int(getenv, "SLURM_STEP_ID", parse_int(getenv, "SLURM_STEPID", 0, false), false);
    w.master_port = slurm_step_port(job, step);
    if (job > 0) w.job_secret = slurm_step_secret(job, step);
  } else if (getenv("PMI_RANK")) {
    // MPICH's Hydra (mpiexec.hydra); no job id reaches the environment, so
    // the port stays 29500 unless MASTER_PORT is set.
    w.source = "mpich";
    w.rank = parse_int(getenv, "PMI_RANK", 0, true);
    w.world_size = parse_int(getenv, "PMI_SIZE", 1, true);
    w.local_rank = parse_int(getenv, "MPI_LOCALRANKID", 0, false);
    w.local_world_size = parse_int(getenv, "MPI_LOCALNRANKS", w.world_size, false);
  }
  // An explicit MASTER_ADDR / MASTER_PORT overrides whatever the launcher implied.
  w.master_addr = str(getenv, "MASTER_ADDR", w.master_addr);
  w.master_port = parse_int(getenv, "MASTER_PORT", w.master_port, false);
  validate(w);
  return w;
}

WorldInfo world_info_from_env() {
  return world_info_from_env([](const char* name) { return std::getenv(name); });
}

}  // namespace scaletrain::comm

#pragma once
// The process launcher: `scaletrain launch`, the C++ counterpart of torchrun.
//
// run() starts nproc_per_node copies of a worker command on this node, each
// with the environment contract that comm/ reads to join the world (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, OMP_NUM_THREADS, SCALETRAIN_THREADS), and supervises them:
//
//  - every line a worker writes to stdout/stderr is printed by the launcher,
//    prefixed with "[rank N] ", on its own stdout/stderr (and copied, without
//    the prefix, to <log_dir>/rank<N>.log when log_dir is set);
//  - SIGINT/SIGTERM sent to the launcher are forwarded to all workers;
//  - the first worker that exits non-zero or dies from a signal stops the job:
//    the others get SIGTERM, then SIGKILL after a grace period; with
//    max_restarts the whole group is then started again (torchrun's
//    --max-restarts), each worker told the attempt number;
//  - nothing outlives run(): workers die with the launcher (PR_SET_PDEATHSIG),
//    live in one process group that is killed as a whole, and are all reaped.
//
// This layer is torch-free on purpose (DESIGN.md rule 4): rendezvous happens
// in the workers, never here. Linux only (prctl, pipe2).
#include <memory>
#include <string>
#include <vector>

namespace scaletrain::launch {

// Elastic membership (--nnodes MIN:MAX): how the launchers of the nodes agree
// on each round of the job. launch/elastic.h implements it over any NodeStore
// (Note [Elastic rounds] there describes the protocol); the CLI hands it the
// rendezvous store of comm/, so this layer stays torch-free.
class NodeRendezvous {
 public:
  virtual ~NodeRendezvous() = default;
  // One round's membership, the same on every node of the round.
  struct Round {
    int round = 0;       // 0, 1, ...: the workers' SCALETRAIN_RESTART_COUNT
    int nodes = 0;       // nodes in the round
    int node_index = 0;  // this node's place among them (GROUP_RANK)
    int world_size = 0;  // workers of all nodes
    int first_rank = 0;  // RANK of this node's local rank 0
    std::string master_addr;  // where the workers' rank 0 runs its store
    int master_port = 0;
  };
  // Joins the next round with `nproc` workers and blocks until it closes:
  // at max nodes, or at least min nodes and no new one for the last-call
  // period. Throws std::runtime_error when the job ended (every node of the
  // last round succeeded, or it gave up) or no round formed in time.
  virtual Round next_round(int nproc) = 0;
  // Polled (about twice a second) while the round's workers run; refreshes
  // this node's keep-alive. Non-empty: why this node must stop its workers
  // and join the next round (another node failed or was lost, or a node
  // waits to join).
  virtual std::string interrupted() = 0;
  // This node's workers failed: the other nodes are told (interrupted()).
  // Returns the failures of the whole job so far, counting this one once
  // however many nodes report the same round. Throws std::runtime_error
  // naming the store and the round when the store cannot be reached.
  virtual int fail_round(const std::string& why) = 0;
  // Failures of the whole job so far, one line each ("round 0: node 1: rank 3
  // exited with code 1"), for the give-up message.
  virtual std::vector<std::string> failures() = 0;
  // Every worker of this node exited 0 in the current round: the job is done.
  // Waits (briefly) for the other nodes of the round to say so too, so the
  // node serving the store does not leave while others still use it.
  virtual void succeeded() = 0;
  // A node refused input (exit 2) or gave up: the job ends on every node.
  virtual void abort(const std::string& why) = 0;
};

// Exit status run() returns when the job hit LaunchOptions::timeout_s; the
// same code as coreutils `timeout`, so scripts can tell it from a failure.
inline constexpr int kTimeoutExitCode = 124;

struct LaunchOptions {
  // Workers started on this node (torchrun --nproc-per-node). Must be >= 1.
  int nproc_per_node = 1;
  // Nodes in the job; WORLD_SIZE = nnodes * nproc_per_node. Must be >= 1.
  int nnodes = 1;
  // Elastic membership (--nnodes MIN:MAX; torchrun's meaning): when > 0 the
  // job runs in rounds of between min_nodes and max_nodes nodes, formed
  // through `rendezvous`; node_rank and nnodes are then unused. A node that
  // leaves (its workers fail, or it stops answering) or joins starts a new
  // round in which every node's workers start again with the new world size
  // (`scaletrain train` resumes from the newest checkpoint). Failures count
  // against max_restarts; joins do not.
  int min_nodes = 0, max_nodes = 0;
  std::shared_ptr<NodeRendezvous> rendezvous;
  // Index of this node in [0, nnodes); RANK = node_rank * nproc_per_node +
  // local_rank, so each node must be given a distinct node_rank.
  int node_rank = 0;
  // Address of the rank-0 node, where the workers' TCPStore rendezvous lives.
  std::string master_addr = "127.0.0.1";
  // Port of that rendezvous on master_addr, in [1, 65535].
  int master_port = 29500;
  // If non-empty, each worker's output is also written to
  // <log_dir>/rank<RANK>.log (stdout and stderr interleaved in arrival order,
  // without the prefix; restarted workers append). The directory is created
  // if missing.
  std::string log_dir;
  // Intra-op threads per worker (OMP_NUM_THREADS and SCALETRAIN_THREADS).
  // > 0: used as given, overriding any OMP_NUM_THREADS in the environment.
  // 0 (auto): an OMP_NUM_THREADS already in the environment is kept; else
  // usable cores / nproc_per_node, at least 1, so that workers sharing a node
  // do not oversubscribe it.
  int threads = 0;
  // Kill all workers and return kTimeoutExitCode after this many seconds;
  // 0 = no limit.
  double timeout_s = 0;
  // Seconds between the SIGTERM sent to the workers on a stop (failure,
  // forwarded signal, timeout) and the SIGKILL that follows if they have not
  // exited. Short, so a failed job ends within seconds.
  double grace_s = 3.0;
  // Times the whole group is started again after a worker failed (torchrun
  // --max-restarts): every worker is stopped, then all are spawned anew with
  // SCALETRAIN_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT set to the
  // attempt (0 first) and TORCHELASTIC_MAX_RESTARTS to this value, and
  // SCALETRAIN_RESTART_REASON to the failure that ended the attempt before
  // ("attempt 0: rank 1 exited with code 3"; empty on a first start). Every
  // failure counts, however quick. A worker that exits 2 refused its input
  // (a usage error) and would refuse it again: no restart. Signals sent to
  // the launcher and the timeout end the job without one. Single node only
  // (several nodes would have to agree on the restart: validate() refuses it).
  int max_restarts = 0;
  // Seconds a worker may go without a heartbeat (torchelastic's watchdog):
  // each worker gets the write end of a pipe (SCALETRAIN_HEARTBEAT_FD) and
  // heartbeat() writes to it; the trainer beats while it sets up and after
  // every step. A worker whose last beat is older than this (stopped with
  // SIGSTOP, stuck in a kernel or a loop) is killed and reported, and the
  // restart policy applies. The clock starts at a worker's first beat, so a
  // command that never beats is never killed for it. 0 = off.
  double heartbeat_timeout_s = 0;
  // Where the prefixed stdout lines of the workers go. Tests point it at a file.
  int stdout_fd = 1;
  // Where the prefixed stderr lines of the workers and the launcher's own
  // messages ("scaletrain launch: ...") go.
  int stderr_fd = 2;
};

// Throws UsageError, naming the field, for options that cannot work
// (nproc_per_node < 1, node_rank outside [0, nnodes), a bad port, a negative
// timeout, ...) or an empty command.
void validate(const LaunchOptions& opts, const std::vector<std::string>& command);

// Threads per worker as described at LaunchOptions::threads; `omp_env` is the
// current OMP_NUM_THREADS (nullptr if unset). Exposed for tests and --help.
int resolve_threads(const LaunchOptions& opts, const char* omp_env);

// Cores this process may run on (its CPU affinity mask), at least 1.
int usable_cores();

// A worker's heartbeat to its launcher (LaunchOptions::heartbeat_timeout_s):
// one byte on SCALETRAIN_HEARTBEAT_FD, never blocking; a no-op when the
// process was not started by `scaletrain launch`. Call it on progress.
void heartbeat();

// Stops this process (SIGTERM, after one line on stderr) when the launcher
// that started it is gone, even when a wrapper (`sh -c`, a script) stands
// between them and the launcher died by SIGKILL: Note [No process left
// behind], mechanism 4. Starts one thread, once; a no-op outside the launcher.
// The trainers call it; a program of your own may too.
void follow_launcher();

// Runs `command` (argv; command[0] is looked up in PATH unless it contains a
// '/') once per local rank and supervises the workers until all have exited.
// Returns 0 if every worker exited 0; 1 if one failed (the first failure is
// reported on stderr_fd as "scaletrain launch: rank 1 exited with code 3" or
// "... rank 0 was killed by signal 9 (SIGKILL)"; after restarts, a line
// lists every attempt's failure by rank and cause; when a worker's error
// named the rank that caused a collective to fail (a line "culprit: rank N
// ..."), the launcher's last line repeats it); 2 when the first failing rank
// exited 2 (it refused its input); 128 + signo if the launcher
// was stopped by SIGINT/SIGTERM; kTimeoutExitCode on timeout. Throws
// UsageError for invalid options, an unknown command or an unusable log_dir,
// before any worker is started.
//
// run() installs process-wide handlers for SIGINT, SIGTERM and SIGCHLD while
// it runs (restored on return), so only one run() may be active per process;
// a second concurrent call throws std::logic_error. Call it from the thread
// that lives longest: PR_SET_PDEATHSIG fires when the *thread* that forked the
// workers exits.
int run(const LaunchOptions& opts, const std::vector<std::string>& command);

// This node's failure as the next attempt's SCALETRAIN_RESTART_REASON:
// `failure` ("rank 1 exited with code 1"), unless the workers named a culprit
// ("rank 3 (it did not answer ...) (reported by rank 1)") that is not one of
// this node's ranks [first_rank, first_rank + nproc): when a node is lost,
// the survivors' collectives fail first, and the reason names the lost rank.
std::string failure_reason(const std::string& failure, const std::string& culprit, int first_rank, int nproc);

// A TCP port that nothing listens on now, chosen by the kernel (bind to port
// 0): what `scaletrain launch` on one node uses when no --master-port is
// given, so that two jobs on one host do not meet at one store (torchrun's
// standalone mode does the same). Another process may still take it before
// the workers' store binds it; the store then fails naming the port.
int free_port();

}  // namespace scaletrain::launch

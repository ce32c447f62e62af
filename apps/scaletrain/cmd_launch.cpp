// `scaletrain launch`: start and supervise the workers of one node, the way
// torchrun does. All the work is in scaletrain/launch/launcher.h; this file
// only maps flags to LaunchOptions.
//
//   scaletrain launch --nproc-per-node 4 [--nnodes 2 --node-rank 0
//       --master-addr host0 --master-port 29500] [--log-dir logs]
//       [--threads 8] [--timeout 3600] [--max-restarts 3] -- ./my_trainer --config run.yaml
//
// Elastic (torchrun's --nnodes MIN:MAX): every node runs the same command,
//   scaletrain launch --nproc-per-node 4 --nnodes 2:4 --master-addr host0
//       --master-port 29500 --max-restarts 3 -- scaletrain train run.yaml
// and the launchers form rounds of 2 to 4 nodes (launch/elastic.h) over a
// store of comm/'s (comm/rendezvous_store.h), which NodeStoreAdapter hands in.
//
// The `--` is needed whenever the worker command has options of its own:
// without it those would be parsed as the launcher's.
//
// `--config_file FILE` reads an Accelerate config file as `accelerate launch
// --config_file` does: num_processes (over all machines) / num_machines
// workers per node, machine_rank, main_process_ip and main_process_port;
// flags given explicitly win over the file. The file is also handed to each
// worker (SCALETRAIN_ACCELERATE_CONFIG) so that `scaletrain train` applies
// its training keys (distributed_type, mixed_precision, fsdp_config, ...).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "scaletrain/comm/env.h"
#include "scaletrain/comm/rendezvous_store.h"
#include "scaletrain/config/accelerate_config.h"
#include "scaletrain/launch/elastic.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/util/error.h"

namespace scaletrain::cli {
namespace {

// The launchers' store for the elastic rounds: serves it when this host can
// bind host:port (the first launcher there), else connects to the one that does.
class NodeStoreAdapter : public launch::NodeStore {
 public:
  explicit NodeStoreAdapter(const launch::ElasticOptions& o) {
    comm::RendezvousStoreOptions s;
    s.host = o.host;
    s.port = static_cast<uint16_t>(o.port);
    s.secret = o.secret;
    s.connect_timeout = o.join_timeout;
    s.timeout = o.join_timeout;
    s.is_server = true;
    try {
      store_ = c10::make_intrusive<comm::RendezvousStore>(s);
    } catch (const comm::RendezvousStoreError& e) {
      // Another node's launcher serves it (or this host does not own the address).
      if (std::string(e.what()).find("cannot listen") == std::string::npos) throw;
      s.is_server = false;
      store_ = c10::make_intrusive<comm::RendezvousStore>(s);
    }
  }
  void set(const std::string& key, const std::string& value) override { store_->set(key, bytes(value)); }
  std::string get(const std::string& key) override { return text(store_->get(key)); }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    return text(store_->compareSet(key, bytes(expected), bytes(desired)));
  }
  bool check(const std::string& key) override { return store_->check({key}); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    store_->wait(keys, timeout);
  }
  std::string local_host() override { return store_->localHost(); }

 private:
  static std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
  static std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
  c10::intrusive_ptr<comm::RendezvousStore> store_;
};

// What the flags of `scaletrain launch` are parsed into. Shared (through a
// shared_ptr) with the callback, which runs after parsing, when add_launch()
// has long returned, and with the runner it stores.
struct LaunchFlags {
  launch::LaunchOptions opts;
  std::vector<std::string> command;
  std::string config_file;
  std::string nnodes_text = "1";  // "N" or "MIN:MAX"
  launch::ElasticOptions elastic;
  double last_call_s = 3, keepalive_s = 10, join_s = 600;  // --rdzv-last-call, --rdzv-keepalive-timeout, --rdzv-timeout
  // The flags that --config_file can also set.
  CLI::Option *nproc = nullptr, *nnodes = nullptr, *node_rank = nullptr, *addr = nullptr, *port = nullptr;
};

// Which of those flags were given explicitly: those win over the file.
struct GivenFlags {
  bool nproc = false, nnodes = false, node_rank = false, addr = false, port = false;
};

// How many workers and nodes: --nproc-per-node, --nnodes, and the --rdzv-*
// times of the elastic rounds.
void add_size_options(CLI::App* sub, LaunchFlags& f) {
  f.nproc = sub->add_option("--nproc-per-node", f.opts.nproc_per_node,
                            "Workers to start on this node (required unless --config_file gives num_processes)")
                ->envname("PET_NPROC_PER_NODE");
  f.nnodes = sub->add_option("--nnodes", f.nnodes_text,
                             "Nodes in the job: N, or MIN:MAX for an elastic job whose nodes may leave and join "
                             "(rounds formed through the store at --master-addr:--master-port)")
                 ->capture_default_str()
                 ->envname("PET_NNODES");
  sub->add_option("--rdzv-last-call", f.last_call_s,
                  "Elastic: a round with at least MIN nodes closes once no node joined for S seconds")
      ->capture_default_str();
  sub->add_option("--rdzv-keepalive-timeout", f.keepalive_s,
                  "Elastic: a node whose launcher has not beaten for S seconds is lost, and the round ends")
      ->capture_default_str();
  sub->add_option("--rdzv-timeout", f.join_s, "Elastic: give up when no round forms within S seconds")
      ->capture_default_str();
}

// Where this node sits and where the job meets: --node-rank, --master-addr,
// --master-port, and the Accelerate config file that can set them.
//
// Note [torchrun's PET_ variables]: torchrun reads each of its flags from
// PET_<FLAG> when the flag is not given, and Kubernetes' training operators
// (Kubeflow's PyTorchJob and Trainer's TrainJob) start pods with PET_NNODES,
// PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT
// set. The same five set ours; a flag given on the command line wins, and
// either wins over --config_file.
void add_placement_options(CLI::App* sub, LaunchFlags& f) {
  f.node_rank =
      sub->add_option("--node-rank", f.opts.node_rank, "Index of this node, in [0, nnodes)")
          ->capture_default_str()
          ->envname("PET_NODE_RANK");
  f.addr = sub->add_option("--master-addr", f.opts.master_addr, "Host of the rank-0 node (rendezvous)")
               ->capture_default_str()
               ->envname("PET_MASTER_ADDR");
  f.port = sub->add_option("--master-port", f.opts.master_port,
                           "Rendezvous port on the master; default: a free port when one node runs the job "
                           "(--nnodes 1), else 29500")
               ->envname("PET_MASTER_PORT");
  sub->add_option("--config_file,--config-file", f.config_file,
                  "Accelerate config file (as `accelerate launch --config_file`): its launcher keys set the flags "
                  "not given, its training keys reach each `scaletrain train` worker");
}

// How the workers run (logs, threads, timeout, restarts, heartbeat), then
// the worker command itself.
void add_worker_options(CLI::App* sub, LaunchFlags& f) {
  launch::LaunchOptions& opts = f.opts;
  sub->add_option("--log-dir", opts.log_dir, "Also write each rank's output to DIR/rank<N>.log");
  sub->add_option("--threads", opts.threads,
                  "Intra-op threads per worker (OMP_NUM_THREADS, SCALETRAIN_THREADS); default: an "
                  "inherited OMP_NUM_THREADS, else usable cores / nproc-per-node (at least 1)");
  sub->add_option("--timeout", opts.timeout_s, "Kill all workers and fail (exit 124) after S seconds; 0 = none")
      ->capture_default_str();
  sub->add_option("--max-restarts", opts.max_restarts,
                  "Start the whole group again up to N times after a worker fails (not after exit 2, a refused "
                  "input); workers see SCALETRAIN_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT, and `scaletrain "
                  "train` goes on from the newest intact checkpoint")
      ->capture_default_str();
  sub->add_option("--heartbeat-timeout", opts.heartbeat_timeout_s,
                  "Kill a worker whose heartbeat (sent by `scaletrain train` while it sets up and after every "
                  "step) is older than S seconds, and report it; the restart policy applies; 0 = off")
      ->capture_default_str();
  sub->add_option("command", f.command, "Worker command and its arguments, after --")->required();
}

// --nnodes: "N" or "MIN:MAX".
void parse_nnodes(const std::string& nn, launch::LaunchOptions& opts) {
  const auto colon = nn.find(':');
  auto whole = [&](const std::string& v) {
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size()) throw UsageError("launch: --nnodes must be N or MIN:MAX, got '" + nn + "'");
    return n;
  };
  if (colon == std::string::npos) {
    opts.nnodes = whole(nn);
  } else {
    opts.min_nodes = whole(nn.substr(0, colon));
    opts.max_nodes = whole(nn.substr(colon + 1));
  }
}

// Note [Launch inside a Slurm allocation]: with SLURM_JOB_ID set, the flags
// not given come from the allocation, and a given one that contradicts it
// is refused. In the batch script (no SLURM_STEP_ID: Note [Slurm's batch
// step] in comm/env.cpp) the launcher runs on the first node only: one node,
// its tasks (SLURM_TASKS_PER_NODE) as workers; an allocation of several
// nodes needs one launcher per node, started by srun. Under srun, each task
// is a launcher: the step's node count and this task's SLURM_NODEID place
// it, the store is at the first host of the node list on the job step's
// port, and the workers per node must be given (the step's tasks are the
// launchers, not the workers). Where each value came from is printed.
const char* slurm_var(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int slurm_int(const char* name, int fallback) {
  const char* v = slurm_var(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);  // "2(x3)": the leading count
  if (end == v || x < 0 || x > 1 << 24)
    throw UsageError(std::string("launch: ") + name + "='" + v + "' is not a count");
  return static_cast<int>(x);
}

// Returns whether it chose the port.
bool apply_slurm(launch::LaunchOptions& o, const GivenFlags& given) {
  const char* job = slurm_var("SLURM_JOB_ID");
  if (!job || o.max_nodes > 0) return false;
  const bool batch = !comm::in_slurm_step([](const char* name) { return slurm_var(name); });
  const int step = slurm_int("SLURM_STEP_ID", slurm_int("SLURM_STEPID", 0));
  const std::string where = std::string("Slurm job ") + job + (batch ? " (its batch script)" : " step " + std::to_string(step));
  const int nodes = batch ? slurm_int("SLURM_JOB_NUM_NODES", slurm_int("SLURM_NNODES", 1))
                          : slurm_int("SLURM_STEP_NUM_NODES", slurm_int("SLURM_NNODES", 1));
  if (batch && nodes > 1)
    throw UsageError("launch: this batch script runs on the first of the " + std::to_string(nodes) + " nodes of " +
                     where + ": start one launcher per node, `srun --ntasks-per-node=1 scaletrain launch ...`");
  const int launchers_here = slurm_int("SLURM_STEP_TASKS_PER_NODE", slurm_int("SLURM_TASKS_PER_NODE", 1));
  if (!batch && launchers_here > 1)
    throw UsageError("launch: srun started " + std::to_string(launchers_here) + " launchers on this node (" + where +
                     "): start one per node (--ntasks-per-node=1); each starts --nproc-per-node workers");
  const int node = batch ? 0 : slurm_int("SLURM_NODEID", 0);
  if (given.nnodes && o.nnodes != nodes)
    throw UsageError("launch: --nnodes " + std::to_string(o.nnodes) + ", but " + where + " runs on " +
                     std::to_string(nodes) + " node(s)");
  if (given.node_rank && o.node_rank != node)
    throw UsageError("launch: --node-rank " + std::to_string(o.node_rank) + ", but this is node " +
                     std::to_string(node) + " of " + where + " (SLURM_NODEID)");
  std::string said;
  auto say = [&](const std::string& s) { said += (said.empty() ? "" : ", ") + s; };
  if (!given.nnodes) say("nnodes " + std::to_string(o.nnodes = nodes) + (batch ? " (batch script)" : " (SLURM_STEP_NUM_NODES)"));
  if (!given.node_rank) say("node rank " + std::to_string(o.node_rank = node) + (batch ? "" : " (SLURM_NODEID)"));
  if (!given.nproc) {
    if (!batch)
      throw UsageError("launch: --nproc-per-node is needed under srun (" + where +
                       "): the step's tasks are the launchers, one per node");
    say("nproc-per-node " + std::to_string(o.nproc_per_node = slurm_int("SLURM_TASKS_PER_NODE", 1)) +
        " (SLURM_TASKS_PER_NODE)");
  }
  bool port_set = false;
  if (nodes > 1) {
    const char* list = slurm_var("SLURM_STEP_NODELIST") ? slurm_var("SLURM_STEP_NODELIST") : slurm_var("SLURM_JOB_NODELIST");
    if (!given.addr && list) say("master " + (o.master_addr = comm::first_slurm_host(list)) + " (first of the node list)");
    if (!given.port) {
      o.master_port = comm::slurm_step_port(std::strtoll(job, nullptr, 10), step);
      say("port " + std::to_string(o.master_port) + " (of the job step)");
      port_set = true;
    }
    if (!std::getenv("SCALETRAIN_STORE_SECRET"))  // the job's identity (WorldInfo::job_secret)
      ::setenv("SCALETRAIN_STORE_SECRET", comm::slurm_step_secret(std::strtoll(job, nullptr, 10), step).c_str(), 1);
  }
  if (!said.empty()) std::fprintf(stderr, "scaletrain launch: from %s: %s\n", where.c_str(), said.c_str());
  return port_set;
}

// Note [torchrun's PET_ variables]: which were read, said once.
void say_operator_variables() {
  std::string said;
  for (const char* v : {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"})
    if (const char* x = std::getenv(v)) said += std::string(said.empty() ? "" : ", ") + v + "=" + x;
  if (!said.empty())
    std::fprintf(stderr, "scaletrain launch: from the training operator's variables: %s (a flag given wins)\n",
                 said.c_str());
}

// The runner: the config file's launcher keys for the flags not given, the
// port, the elastic rendezvous, then launch::run().
int run_launch(LaunchFlags& f, bool from_file, const GivenFlags& given) {
  launch::LaunchOptions& opts = f.opts;
  bool port_chosen = given.port;
  say_operator_variables();
  if (!from_file) port_chosen = apply_slurm(opts, given) || port_chosen;
  if (from_file) {
    const auto l = config::read_accelerate_launch(f.config_file);
    if (!given.nnodes) opts.nnodes = l.num_machines;
    if (!given.nproc) opts.nproc_per_node = l.num_processes / l.num_machines;
    if (!given.node_rank) opts.node_rank = l.machine_rank;
    if (!given.addr && !l.main_process_ip.empty()) opts.master_addr = l.main_process_ip;
    if (!given.port && l.main_process_port > 0) {
      opts.master_port = l.main_process_port;
      port_chosen = true;
    }
    for (const auto& n : l.notes) std::fprintf(stderr, "scaletrain launch: note: %s\n", n.c_str());
    // Inherited by every worker: `scaletrain train` reads the training keys.
    const std::string abs = std::filesystem::absolute(f.config_file).string();
    ::setenv(config::kAccelerateConfigEnv, abs.c_str(), 1);
  }
  // One node and no port given: a free one, so two jobs on one host do not meet at one store.
  if (!port_chosen && opts.nnodes == 1 && opts.max_nodes == 0) opts.master_port = launch::free_port();
  if (opts.max_nodes > 0) {
    if (opts.min_nodes < 1 || opts.max_nodes < opts.min_nodes)
      throw UsageError("launch: --nnodes MIN:MAX needs 1 <= MIN <= MAX, got " + std::to_string(opts.min_nodes) + ":" +
                       std::to_string(opts.max_nodes));
    auto ms = [](double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); };
    launch::ElasticOptions& elastic = f.elastic;
    elastic.host = opts.master_addr;
    elastic.port = opts.master_port;
    elastic.min_nodes = opts.min_nodes;
    elastic.max_nodes = opts.max_nodes;
    elastic.last_call = ms(f.last_call_s);
    elastic.keepalive_timeout = ms(f.keepalive_s);
    elastic.join_timeout = ms(f.join_s);
    if (const char* s = std::getenv("SCALETRAIN_STORE_SECRET")) elastic.secret = s;
    opts.rendezvous = std::make_shared<launch::ElasticRendezvous>(elastic, std::make_unique<NodeStoreAdapter>(elastic));
  }
  return launch::run(opts, f.command);
}

}  // namespace

void add_launch(CLI::App& app, Runner& run) {
  auto* sub =
      app.add_subcommand("launch",
                         "Run a worker command once per local rank with the torchrun environment "
                         "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), relaying its output prefixed by rank");
  // Shared with the callback, which runs after parsing, when this function
  // has long returned.
  auto f = std::make_shared<LaunchFlags>();
  add_size_options(sub, *f);
  add_placement_options(sub, *f);
  add_worker_options(sub, *f);

  sub->callback([&run, f] {
    parse_nnodes(f->nnodes_text, f->opts);
    for (double* v : {&f->last_call_s, &f->keepalive_s, &f->join_s})
      if (!(*v > 0) || *v > 1e7) throw UsageError("launch: --rdzv-* times must be positive seconds");
    const bool from_file = !f->config_file.empty();
    if (!from_file && f->nproc->count() == 0 && !slurm_var("SLURM_JOB_ID"))
      throw CLI::RequiredError("--nproc-per-node (or --config_file with num_processes, or a Slurm allocation)");
    // Which flags were given explicitly: those win over the file.
    const GivenFlags given{f->nproc->count() > 0, f->nnodes->count() > 0, f->node_rank->count() > 0,
                           f->addr->count() > 0, f->port->count() > 0};
    run = [f, from_file, given] { return run_launch(*f, from_file, given); };
  });
}

}  // namespace scaletrain::cli

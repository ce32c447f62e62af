// `scaletrain launch`: start and supervise the workers of one node, the way
// torchrun does. All the work is in scaletrain/launch/launcher.h; this file
// only maps flags to LaunchOptions.
//
//   scaletrain launch --nproc-per-node 4 [--nnodes 2 --node-rank 0
//       --master-addr host0 --master-port 29500] [--log-dir logs]
//       [--threads 8] [--timeout 3600] -- ./my_trainer --config run.yaml
//
// The `--` is needed whenever the worker command has options of its own:
// without it those would be parsed as the launcher's.
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "scaletrain/launch/launcher.h"

namespace scaletrain::cli {

void add_launch(CLI::App& app, Runner& run) {
  auto* sub = app.add_subcommand(
      "launch", "Run a worker command once per local rank with the torchrun environment "
                "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), relaying its output prefixed by rank");
  // Shared with the callback, which runs after parsing, when this function
  // has long returned.
  auto opts = std::make_shared<launch::LaunchOptions>();
  auto command = std::make_shared<std::vector<std::string>>();

  sub->add_option("--nproc-per-node", opts->nproc_per_node, "Workers to start on this node")->required();
  sub->add_option("--nnodes", opts->nnodes, "Nodes in the job")->capture_default_str();
  sub->add_option("--node-rank", opts->node_rank, "Index of this node, in [0, nnodes)")->capture_default_str();
  sub->add_option("--master-addr", opts->master_addr, "Host of the rank-0 node (rendezvous)")->capture_default_str();
  sub->add_option("--master-port", opts->master_port, "Rendezvous port on the master")->capture_default_str();
  sub->add_option("--log-dir", opts->log_dir, "Also write each rank's output to DIR/rank<N>.log");
  sub->add_option("--threads", opts->threads,
                  "Intra-op threads per worker (OMP_NUM_THREADS, SCALETRAIN_THREADS); default: an "
                  "inherited OMP_NUM_THREADS, else usable cores / nproc-per-node (at least 1)");
  sub->add_option("--timeout", opts->timeout_s, "Kill all workers and fail (exit 124) after S seconds; 0 = none")
      ->capture_default_str();
  sub->add_option("command", *command, "Worker command and its arguments, after --")->required();

  sub->callback([&run, opts, command] {
    run = [opts, command] { return launch::run(*opts, *command); };
  });
}

}  // namespace scaletrain::cli

// Bad input through the real CLI: one line naming the problem, exit code 2,
// no stack trace.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.h"
#include "scaletrain/launch/launcher.h"

namespace cli_test {

using namespace scaletrain::test;

TEST(Cli, MalformedYaml) {
  auto cfg = write("bad.yaml", "train:\n  steps: [1, 2\n");
  expect_usage_error(run("train " + cfg.string()), "not valid YAML");
}

TEST(Cli, UnknownConfigKey) {
  auto cfg = write("unknown.yaml", "train:\n  stpes: 3\n");
  expect_usage_error(run("train " + cfg.string()), "unknown config key 'train.stpes'");
}

TEST(Cli, UnknownOverrideKey) {
  auto cfg = write("ok.yaml", "train:\n  steps: 3\n");
  expect_usage_error(run("train " + cfg.string() + " --train.nope=1"), "unknown config key 'train.nope'");
}

TEST(Cli, IllTypedValue) {
  auto cfg = write("typed.yaml", "train:\n  steps: many\n");
  expect_usage_error(run("train " + cfg.string()), "train.steps");
}

TEST(Cli, MissingConfigFile) { expect_usage_error(run("train /nonexistent/config.yaml"), "/nonexistent/config.yaml"); }

TEST(Cli, MissingDataFile) {
  auto cfg = write("nodata.yaml", "data:\n  path: /nonexistent/tokens.bin\n");
  expect_usage_error(run("train " + cfg.string()), "/nonexistent/tokens.bin");
}

TEST(Cli, MeshThatDoesNotFitTheWorld) {
  auto cfg = write("mesh.yaml", "data:\n  path: " + tokens().string() + "\nparallel:\n  dp_replicate: 3\n");
  auto r = run("train " + cfg.string());
  expect_usage_error(r, "world size 1");
  EXPECT_NE(r.err.find("dp_replicate"), std::string::npos);
}

// estimate-memory --ep: an expert-parallel degree the trainer would refuse is
// refused in one line; one it takes is estimated.
TEST(Cli, EstimateMemoryExpertParallelDegree) {
  EXPECT_EQ(run("estimate-memory mixtral-8x7b --world-size 8 --zero-stage 3 --ep 4").code, 0);
  expect_usage_error(run("estimate-memory mixtral-8x7b --world-size 8 --ep 3"), "ep=3 does not divide num_experts=8");
  expect_usage_error(run("estimate-memory mistral-7b --world-size 8 --ep 2"), "needs a model with MoE layers");
}

TEST(Cli, UnsupportedStrategy) {
  auto cfg = write("strategy.yaml", "data:\n  path: " + tokens().string() + "\nparallel:\n  strategy: zero9\n");
  expect_usage_error(run("train " + cfg.string()), "zero9");
}

TEST(Cli, DeepSpeedConfigErrors) {
  auto cfg = write("ds.yaml", "data:\n  path: " + tokens().string() + "\n");
  auto bad_json = write("bad.json", "{\"train_batch_size\": 8,,}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + bad_json.string()), "bad.json");
  auto stage4 = write("stage4.json", "{\"zero_optimization\": {\"stage\": 4}}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + stage4.string()), "zero_optimization.stage");
  auto unknown = write("unknown.json", "{\"steps_per_print\": 5, \"flops_profiler\": {}}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + unknown.string()), "'flops_profiler'");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed /nonexistent/ds.json"), "/nonexistent/ds.json");
  // Note [Strict JSON]: a repeated key and a number beyond double's range.
  auto twice = write("twice.json", "{\"zero_optimization\": {\"stage\": 2, \"stage\": 3}}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + twice.string()),
                     "key 'zero_optimization.stage' appears twice");
  auto huge = write("huge.json", "{\"gradient_clipping\": 1e400}");
  expect_usage_error(run("train " + cfg.string() + " --deepspeed " + huge.string()), "1e400");
}

// Without --master-port, a one-node launch takes a free port: a job runs
// while another holds the old default, 29500 (as two jobs on one host would).
TEST(Cli, LaunchWithoutPortAvoidsABusyDefault) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(29500);
  // Held by this test, or already by another program on the machine: either way the default is busy.
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  const bool held = bound ? ::listen(fd, 4) == 0 : errno == EADDRINUSE;
  auto cfg = write("port.yaml", "data:\n  path: " + tokens().string() +
                                    "\nmodel:\n  block_size: 16\ntrain:\n  steps: 1\n  global_batch: 4\n"
                                    "  micro_batch: 2\n  sample_tokens: 0\n");
  auto r = run("launch --nproc-per-node 2 --threads 1 --timeout 120 -- " + std::string(SCALETRAIN_BIN) + " train " +
               cfg.string());
  ::close(fd);
  ASSERT_TRUE(held) << "port 29500 is neither held by the test nor busy";
  EXPECT_EQ(r.code, 0) << r.err;
}

// A rank started with another setting (issue 52: ZeRO-3 with another
// model.n_layer on rank 1) is named with the setting at start-up, before
// any collective, with exit 2, instead of a timeout that blames rank 0.
TEST(Cli, ARankWithAnotherConfigIsNamedAtStart) {
  auto cfg = write("odd_rank.yaml", "data:\n  path: " + tokens().string() +
                                        "\nmodel:\n  block_size: 16\n  n_layer: 2\ntrain:\n  steps: 1\n"
                                        "  global_batch: 4\n  micro_batch: 2\n  sample_tokens: 0\n"
                                        "parallel:\n  strategy: zero3\n");
  const std::string train = std::string(SCALETRAIN_BIN) + " train " + cfg.string();
  auto r = run("launch --nproc-per-node 2 --threads 1 --timeout 120 -- /bin/sh -c 'if [ $RANK = 1 ]; then exec " +
               train + " --model.n_layer=3; fi; exec " + train + "'");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("rank 1's resolved config differs from rank 0's: model.n_layer=3 (rank 0: model.n_layer=2)"),
            std::string::npos)
      << r.err;
}

// Processes whose command line holds `marker` (other than this test's).
std::vector<pid_t> processes_with(const std::string& marker) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "cmdline");
    std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find(marker) != std::string::npos && std::stoi(name) != ::getpid()) out.push_back(std::stoi(name));
  }
  return out;
}

// Note [No process left behind], mechanism 4: the launcher killed by SIGKILL
// while its worker is a trainer forked by a wrapper (`sh -c '...; true'`,
// which the kernel's parent-death signal does not reach). The trainer stops
// once the launcher is gone; without follow_launcher() it trains on alone
// (issue 52: a killed node's launcher left its trainer running).
TEST(Cli, ATrainerBehindAWrapperStopsWithItsKilledLauncher) {
  const auto metrics = scratch() / "orphan_marker.jsonl";
  fs::remove(metrics);
  auto cfg = write("orphan.yaml", "data:\n  path: " + tokens().string() +
                                      "\nmodel:\n  block_size: 16\ntrain:\n  steps: 1000000\n  global_batch: 4\n"
                                      "  micro_batch: 2\n  sample_tokens: 0\nmetrics:\n  progress: false\n");
  const std::string worker =
      std::string(SCALETRAIN_BIN) + " train " + cfg.string() + " --metrics.path=" + metrics.string() + "; true";
  const pid_t launcher = ::fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const std::string cmd = std::string(SCALETRAIN_BIN) + " launch --nproc-per-node 1 --threads 1 --timeout 600 -- " +
                            "/bin/sh -c '" + worker + "' >/dev/null 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Until the trainer has written a step (or 5 minutes on a loaded machine).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  const auto trained = [&] {
    std::ifstream in(metrics);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return text.find("\"loss\"") != std::string::npos;  // a line may be half written: no parse
  };
  while (!trained() && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(trained()) << "the trainer never trained";
  const auto trainers = processes_with(metrics.string());
  ASSERT_FALSE(trainers.empty());
  for (pid_t p : processes_with("launch --nproc-per-node 1 --threads 1 --timeout 600"))
    ::kill(p, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  // Event-driven: the trainer goes when the kernel reports the pipe's reader
  // gone; the minute is only there so that a failure ends.
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!processes_with(metrics.string()).empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto left = processes_with(metrics.string());
  for (pid_t p : left) ::kill(p, SIGKILL);
  EXPECT_TRUE(left.empty()) << "the trainer outlived its launcher by a minute";
}

// Note [torchrun's PET_ variables]: a pod of a Kubernetes training operator
// gets its place in the job from PET_*; a flag given explicitly wins.
TEST(Cli, LaunchTakesItsPlaceFromTorchrunVariables) {
  const std::vector<std::pair<const char*, const char*>> pet = {{"PET_NNODES", "2"},
                                                                {"PET_NPROC_PER_NODE", "2"},
                                                                {"PET_NODE_RANK", "1"},
                                                                {"PET_MASTER_ADDR", "127.0.0.7"},
                                                                {"PET_MASTER_PORT", "23456"}};
  for (const auto& [k, v] : pet) ::setenv(k, v, 1);
  const std::string worker = " -- /bin/sh -c 'echo at $RANK of $WORLD_SIZE via $MASTER_ADDR:$MASTER_PORT >&2'";
  const auto from_env = run("launch --threads 1 --timeout 60" + worker);
  const auto flag_wins = run("launch --threads 1 --timeout 60 --node-rank 0" + worker);
  ::setenv("PET_NPROC_PER_NODE", "many", 1);
  const auto bad = run("launch --threads 1 --timeout 60" + worker);
  for (const auto& [k, v] : pet) ::unsetenv(k);
  ASSERT_EQ(from_env.code, 0) << from_env.err;
  EXPECT_NE(from_env.err.find("[rank 2] at 2 of 4 via 127.0.0.7:23456"), std::string::npos) << from_env.err;
  EXPECT_NE(from_env.err.find("[rank 3] at 3 of 4 via 127.0.0.7:23456"), std::string::npos) << from_env.err;
  EXPECT_NE(from_env.err.find("scaletrain launch: from the training operator's variables: PET_NNODES=2, "
                              "PET_NPROC_PER_NODE=2, PET_NODE_RANK=1, PET_MASTER_ADDR=127.0.0.7, PET_MASTER_PORT=23456"),
            std::string::npos)
      << from_env.err;
  ASSERT_EQ(flag_wins.code, 0) << flag_wins.err;
  EXPECT_NE(flag_wins.err.find("[rank 0] at 0 of 4"), std::string::npos) << flag_wins.err;
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("many"), std::string::npos) << bad.err;
}

// Note [Launch inside a Slurm allocation] (cmd_launch.cpp), with a
// two-node srun step's variables: node 1 of 2 takes ranks 2-3, the store at
// the first host on the step's port, with the step's secret; a flag that
// contradicts the allocation, and a batch script of two nodes, are refused.
// (tests/launchers/cluster.sh runs the one-node cases under a real Slurm.)
TEST(Cli, LaunchTakesItsPlaceFromASlurmStep) {
  const std::vector<std::pair<const char*, const char*>> step = {
      {"SLURM_JOB_ID", "4242"},          {"SLURM_STEP_ID", "1"},       {"SLURM_STEP_NUM_NODES", "2"},
      {"SLURM_NODEID", "1"},             {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
      {"SLURM_STEP_NODELIST", "localhost,n2"}};
  for (const auto& [k, v] : step) ::setenv(k, v, 1);
  ::unsetenv("SCALETRAIN_STORE_SECRET");
  const std::string worker =
      " -- /bin/sh -c 'echo at $RANK of $WORLD_SIZE via $MASTER_ADDR:$MASTER_PORT with $SCALETRAIN_STORE_SECRET >&2'";
  const auto placed = run("launch --nproc-per-node 2 --threads 1 --timeout 60" + worker);
  const auto contradicted = run("launch --nproc-per-node 2 --node-rank 0 --threads 1 --timeout 60" + worker);
  const auto no_nproc = run("launch --threads 1 --timeout 60" + worker);
  ::unsetenv("SLURM_STEP_ID");
  ::setenv("SLURM_JOB_NUM_NODES", "2", 1);
  const auto batch = run("launch --threads 1 --timeout 60" + worker);
  for (const auto& [k, v] : step) ::unsetenv(k);
  ::unsetenv("SLURM_JOB_NUM_NODES");
  ASSERT_EQ(placed.code, 0) << placed.err;
  const std::string port = std::to_string(20000 + (4242 + 7919) % 20000);
  EXPECT_NE(placed.err.find("[rank 3] at 3 of 4 via localhost:" + port + " with slurm-4242.1"), std::string::npos)
      << placed.err;
  EXPECT_NE(placed.err.find("from Slurm job 4242 step 1: nnodes 2 (SLURM_STEP_NUM_NODES), node rank 1 (SLURM_NODEID), "
                            "master localhost (first of the node list), port " + port + " (of the job step)"),
            std::string::npos)
      << placed.err;
  expect_usage_error(contradicted, "--node-rank 0, but this is node 1 of Slurm job 4242 step 1 (SLURM_NODEID)");
  expect_usage_error(no_nproc, "--nproc-per-node is needed under srun");
  expect_usage_error(batch, "start one launcher per node, `srun --ntasks-per-node=1 scaletrain launch ...`");
}

// Note [torchrun's agent store] (comm/env.h): under torchrun's default
// (static) rendezvous its agent serves the store on MASTER_PORT, so rank 0
// could not listen there ("Address already in use"). The ranks join the
// agent's store instead, and train as under our own launcher.
TEST(Cli, TorchrunTrainsAsOurLauncherDoes) {
  ASSERT_TRUE(fs::exists("/usr/bin/torchrun")) << "Debian's python3-torch (a test dependency) provides torchrun";
  auto cfg = write("torchrun.yaml", "data:\n  path: " + tokens().string() +
                                        "\nmodel:\n  block_size: 16\ntrain:\n  steps: 3\n  global_batch: 4\n"
                                        "  micro_batch: 2\n  sample_tokens: 0\nmetrics:\n  progress: false\n");
  const auto ours = scratch() / "launch_peer.jsonl", theirs = scratch() / "torchrun.jsonl";
  fs::remove(ours);
  fs::remove(theirs);
  const std::string train = std::string(SCALETRAIN_BIN) + " train " + cfg.string() + " --metrics.path=";
  const auto launched = run("launch --nproc-per-node 2 --threads 1 --timeout 120 -- " + train + ours.string());
  ASSERT_EQ(launched.code, 0) << launched.err;
  // Debian's torchrun 1.13 starts workers only with its output redirected (--redirects/--tee).
  const std::string cmd = "env -u RANK -u WORLD_SIZE OMP_NUM_THREADS=1 timeout 120 /usr/bin/torchrun "
                          "--nproc_per_node 2 --redirects 9:0 --tee 9:0 --no_python --master_port " +
                          std::to_string(scaletrain::launch::free_port()) + " " + train + theirs.string() + " >" +
                          (scratch() / "torchrun.log").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream log(scratch() / "torchrun.log");
  const std::string out((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  const auto a = metric_losses(ours), b = metric_losses(theirs);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u) << out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_DOUBLE_EQ(a[i], b[i]) << "step " << i + 1;
}

// A store without a secret (mpirun, srun, a launch across nodes without
// SCALETRAIN_STORE_SECRET) serves any client: the rank that serves it says so, once.
TEST(Cli, AStoreWithoutASecretIsNamedOnce) {
  auto cfg = write("no_secret.yaml", "data:\n  path: " + tokens().string() +
                                         "\nmodel:\n  block_size: 16\ntrain:\n  steps: 1\n  global_batch: 4\n"
                                         "  micro_batch: 2\n  sample_tokens: 0\n");
  const std::string train = std::string(SCALETRAIN_BIN) + " train " + cfg.string();
  const std::string warning = "scaletrain: warning: SCALETRAIN_STORE_SECRET is not set, so the rendezvous store at ";
  const auto open = run("launch --nproc-per-node 2 --threads 1 --timeout 120 -- /bin/sh -c "
                        "'unset SCALETRAIN_STORE_SECRET; exec " + train + "'");
  ASSERT_EQ(open.code, 0) << open.err;
  const size_t at = open.err.find("[rank 0] " + warning);
  EXPECT_NE(at, std::string::npos) << open.err;
  EXPECT_EQ(open.err.find(warning, at + warning.size()), std::string::npos) << "said twice:\n" << open.err;
  const auto closed = run("launch --nproc-per-node 2 --threads 1 --timeout 120 -- " + train);
  ASSERT_EQ(closed.code, 0) << closed.err;
  EXPECT_EQ(closed.err.find(warning), std::string::npos) << closed.err;
}

TEST(Cli, TrainsTwoStepsAndWritesMetrics) {
  auto metrics = scratch() / "m.jsonl";
  auto cfg = write("tiny.yaml", "data:\n  path: " + tokens().string() +
                                    "\nmodel:\n  block_size: 32\ntrain:\n  steps: 2\n  global_batch: 4\n"
                                    "  micro_batch: 2\n  sample_tokens: 10\nmetrics:\n  peak_flops: 1e10\n"
                                    "  path: " +
                                    metrics.string() + "\n");
  auto r = run("train " + cfg.string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(metrics);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    if (line.find("\"record\"") != std::string::npos) continue;  // the memory report, checked below
    ++lines;
    for (const char* key : {"\"step\"", "\"loss\"", "\"lr\"", "\"step_ms\"", "\"tokens_per_s\"", "\"mfu\"",
                            "\"peak_rss_mb\"", "\"comm_wait_ms\""})
      EXPECT_NE(line.find(key), std::string::npos) << key << " in " << line;
  }
  EXPECT_EQ(lines, 2);
  // Predicted next to measured memory, once after setup and once at the end.
  const auto mem = memory_records(metrics);
  ASSERT_EQ(mem.size(), 2u);
  EXPECT_EQ(mem[0].at("phase"), "setup");
  EXPECT_EQ(mem[1].at("phase"), "end");
  for (const char* key : {"states", "activations", "total"}) EXPECT_GT(mem[1]["predicted_mib"][key].get<double>(), 0);
  for (const char* key : {"states", "activations", "tensor_peak", "rss_baseline", "rss_peak"})
    EXPECT_GT(mem[1]["measured_mib"][key].get<double>(), 0) << key;
}

// docs/kernels.md, "Threads": two threads over OpenBLAS's pthreads build get
// a notice naming the OpenMP build; over the OpenMP build (what
// scripts/install-deps.sh selects, and so the default here) and on one
// thread, none. scripts/install-deps.sh installs both builds.
TEST(Cli, TwoThreadsOverThePthreadsBlasGetANotice) {
  const std::string notice = "OpenBLAS's pthreads build";
  const fs::path cfg = small_train_config("threads.yaml", 0), out = scratch() / "threads_out.txt";
  auto train = [&](const std::string& env) {
    const std::string cmd = "env -u OMP_NUM_THREADS " + env + " " + std::string(SCALETRAIN_BIN) + " train " +
                            cfg.string() + " --train.steps=1 >" + out.string() + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << env;
    std::ifstream in(out);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  const std::string libs = "/usr/lib/x86_64-linux-gnu/openblas-";
  EXPECT_NE(train("SCALETRAIN_THREADS=2 LD_LIBRARY_PATH=" + libs + "pthread").find(notice), std::string::npos);
  EXPECT_EQ(train("SCALETRAIN_THREADS=1 LD_LIBRARY_PATH=" + libs + "pthread").find(notice), std::string::npos);
  EXPECT_EQ(train("SCALETRAIN_THREADS=2 LD_LIBRARY_PATH=" + libs + "openmp").find(notice), std::string::npos);
  EXPECT_EQ(train("SCALETRAIN_THREADS=2").find(notice), std::string::npos) << "the pthreads build is selected";
}

}  // namespace cli_test

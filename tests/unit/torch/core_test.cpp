// Single-process pieces of the engine: environment contract, mesh arithmetic,
// model presets, optimizer schedule, config overrides.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <filesystem>
#include <map>

#include "scaletrain/comm/env.h"
#include "scaletrain/comm/mesh.h"
#include "scaletrain/comm/world.h"
#include "scaletrain/models/gpt.h"
#include "scaletrain/optim/adamw.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/launch/launcher.h"
#include "scaletrain/util/error.h"

namespace scaletrain {
namespace core_test {

comm::GetEnv fake(std::map<std::string, std::string> vars) {
  auto store = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [store](const char* name) -> const char* {
    auto it = store->find(name);
    return it == store->end() ? nullptr : it->second.c_str();
  };
}

TEST(WorldEnv, Torchrun) {
  auto w = comm::world_info_from_env(fake({{"RANK", "3"},
                                           {"WORLD_SIZE", "4"},
                                           {"LOCAL_RANK", "1"},
                                           {"LOCAL_WORLD_SIZE", "2"},
                                           {"MASTER_ADDR", "10.0.0.1"},
                                           {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.world_size, 4);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.master_addr, "10.0.0.1");
  EXPECT_EQ(w.master_port, 1234);
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_FALSE(w.agent_store);
  // Note [torchrun's agent store]: torchrun's static rendezvous serves the store itself.
  auto a = comm::world_info_from_env(fake({{"RANK", "1"},
                                           {"WORLD_SIZE", "2"},
                                           {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                           {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_TRUE(a.agent_store);
  EXPECT_EQ(a.restart_count, 2);
  EXPECT_FALSE(comm::world_info_from_env(fake({{"RANK", "1"},
                                               {"WORLD_SIZE", "2"},
                                               {"TORCHELASTIC_USE_AGENT_STORE", "False"}}))
                   .agent_store);
}

TEST(WorldEnv, OpenMpi) {
  auto w = comm::world_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "5"},
                                           {"OMPI_COMM_WORLD_SIZE", "8"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                                           {"MASTER_ADDR", "node1"}}));
  EXPECT_EQ(w.rank, 5);
  EXPECT_EQ(w.world_size, 8);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.master_port, 29500) << "no job id: the default";
  // Two mpirun jobs (their ids as Open MPI 4.1 gave them) meet in two stores.
  auto port = [&](const char* job) {
    return comm::world_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "0"},
                                           {"OMPI_COMM_WORLD_SIZE", "2"},
                                           {"OMPI_MCA_ess_base_jobid", job}}))
        .master_port;
  };
  EXPECT_EQ(port("1105199105"), 20000 + ((0x41E0 ^ 1) % 20000));
  EXPECT_NE(port("1105199105"), port("1104871425"));
  // ... and each has its own store secret, the same on all its ranks.
  EXPECT_EQ(comm::world_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "1"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_MCA_ess_base_jobid", "1105199105"}}))
                .job_secret,
            "openmpi-1105199105");
  EXPECT_EQ(w.job_secret, "") << "no job id: no secret (the store host warns)";
  EXPECT_EQ(comm::world_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "7f3a"}}))
                .job_secret,
            "torchrun-7f3a");
  EXPECT_EQ(comm::world_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "none"}}))
                .job_secret,
            "");
  EXPECT_EQ(comm::world_info_from_env(fake({{"OMPI_COMM_WORLD_RANK", "0"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"},
                                            {"OMPI_MCA_ess_base_jobid", "1105199105"},
                                            {"MASTER_PORT", "31000"}}))
                .master_port,
            31000)
      << "MASTER_PORT wins";
  EXPECT_THROW(port("job7"), UsageError);
}

// MPICH's mpiexec.hydra, with the variables it set for rank 1 of 2 (measured).
TEST(WorldEnv, Mpich) {
  auto w = comm::world_info_from_env(
      fake({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}, {"PMI_FD", "8"}}));
  EXPECT_EQ(w.source, "mpich");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.world_size, 2);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_world_size, 2);
  EXPECT_EQ(w.master_port, 29500);
  // Under srun with a PMI plugin Slurm's own variables win.
  EXPECT_EQ(comm::world_info_from_env(fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"},
                                            {"PMI_RANK", "0"}, {"PMI_SIZE", "2"}}))
                .source,
            "slurm");
}

// A batch script that runs the trainer itself is one task of a job whose
// SLURM_NTASKS says 2: rank 0 waits for a rank that never starts, and the
// error says how the ranks are started.
TEST(WorldEnv, MissingRanksUnderSlurmSayHowToStartThem) {
  comm::WorldInfo info;
  info.source = "slurm";
  info.world_size = 2;
  info.local_world_size = 2;
  info.master_addr = "127.0.0.1";
  info.master_port = launch::free_port();
  comm::WorldOptions o;
  o.backend = comm::Backend::Gloo;
  o.timeout = std::chrono::seconds(1);
  try {
    comm::World::init(info, o);
    ADD_FAILURE() << "a world of 2 formed with one rank";
  } catch (const comm::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2, from slurm variables; a command run directly in an sbatch "
                                         "script is one task"),
              std::string::npos)
        << e.what();
  }
}

TEST(WorldEnv, Slurm) {
  std::map<std::string, std::string> step{{"SLURM_PROCID", "6"},          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "2"},         {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                          {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "4242"},
                                          {"SLURM_STEP_ID", "0"}};
  auto w = comm::world_info_from_env(fake(step));
  EXPECT_EQ(w.rank, 6);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_world_size, 4);
  EXPECT_EQ(w.master_addr, "gpu07");
  EXPECT_EQ(w.master_port, 20000 + 4242);
  EXPECT_EQ(w.job_secret, "slurm-4242.0");  // two jobs never meet in one store
  // Another step of the job running at once, and the next job: other ports.
  step["SLURM_STEP_ID"] = "1";
  EXPECT_EQ(comm::world_info_from_env(fake(step)).master_port, 20000 + (4242 + 7919) % 20000);
  step["SLURM_STEP_ID"] = "0";
  step["SLURM_JOB_ID"] = "4243";
  EXPECT_EQ(comm::world_info_from_env(fake(step)).master_port, 20000 + 4243);
  // Note [Slurm's batch step]: the script of an sbatch -n8 job is one task.
  step.erase("SLURM_STEP_ID");
  step["SLURM_PROCID"] = "0";
  try {
    comm::world_info_from_env(fake(step));
    ADD_FAILURE() << "a batch script became rank 0 of 8";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("batch script of Slurm job 4243, one task of 8"), std::string::npos)
        << e.what();
  }
  step["SLURM_NTASKS"] = "1";
  step["SLURM_TASKS_PER_NODE"] = "1";
  step["SLURM_LOCALID"] = "0";
  EXPECT_EQ(comm::world_info_from_env(fake(step)).world_size, 1);
  EXPECT_EQ(comm::first_slurm_host("a1,b2"), "a1");
  EXPECT_EQ(comm::first_slurm_host("n[003-004,9],x"), "n003");
}

// Note [Stale RANK and WORLD_SIZE]: exported by hand, they would make every
// rank of an mpirun or srun train as rank 0 of 1; under a launcher that set
// them (TORCHELASTIC_RESTART_COUNT), they are the workers' and win.
TEST(WorldEnv, StaleRankAndWorldSizeAreRefused) {
  try {
    comm::world_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"OMPI_COMM_WORLD_RANK", "1"},
                                    {"OMPI_COMM_WORLD_SIZE", "2"}}));
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=0 and WORLD_SIZE=1 are set, but mpirun started this process as rank 1 "
                                         "of 2 (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(comm::world_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"SLURM_PROCID", "1"},
                                               {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"}})),
               UsageError);
  // A PyTorchJob pod with 4 processes per pod, running the trainer itself.
  try {
    comm::world_info_from_env(fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"PET_NPROC_PER_NODE", "4"}}));
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("PET_NPROC_PER_NODE=4 asks for 4 processes per pod"), std::string::npos)
        << e.what();
  }
  // A launcher's workers inside an srun step or an mpirun: theirs win.
  EXPECT_EQ(comm::world_info_from_env(fake({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"TORCHELASTIC_RESTART_COUNT", "0"},
                                            {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"}}))
                .rank,
            3);
  // The same counts agree; a batch script's SLURM_NTASKS is not a step's.
  EXPECT_EQ(comm::world_info_from_env(fake({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"},
                                            {"OMPI_COMM_WORLD_SIZE", "2"}}))
                .world_size,
            2);
  EXPECT_EQ(comm::world_info_from_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "4"}}))
                .world_size,
            1);
}

TEST(WorldEnv, NoVariablesIsOneProcess) {
  auto w = comm::world_info_from_env(fake({}));
  EXPECT_EQ(w.world_size, 1);
  EXPECT_EQ(w.source, "single");
}

TEST(WorldEnv, InconsistentValuesAreUsageErrors) {
  EXPECT_THROW(comm::world_info_from_env(fake({{"RANK", "4"}, {"WORLD_SIZE", "4"}})), UsageError);
  EXPECT_THROW(comm::world_info_from_env(fake({{"RANK", "x"}, {"WORLD_SIZE", "4"}})), UsageError);
  EXPECT_THROW(comm::world_info_from_env(fake({{"RANK", "0"}})), UsageError);
}

TEST(MeshDims, ResolvesAndRoundTrips) {
  comm::MeshDims d{2, 2, -1, 2};
  auto r = d.resolved(16);
  EXPECT_EQ(r.dp_shard, 2);
  for (int rank = 0; rank < 16; ++rank) EXPECT_EQ(comm::Mesh::rank_of(r, comm::Mesh::coord_of(r, rank)), rank);
  // tp innermost: ranks 0 and 1 differ only in tp
  EXPECT_EQ(comm::Mesh::coord_of(r, 1).tp, 1);
  EXPECT_EQ(comm::Mesh::coord_of(r, 1).dp_shard, 0);
}

TEST(MeshDims, MismatchNamesEveryDegree) {
  try {
    comm::MeshDims{1, 1, 3, 2}.resolved(4);
    FAIL();
  } catch (const UsageError& e) {
    std::string m = e.what();
    for (const char* s : {"pp=1", "dp=3", "replicate=1", "shard=3", "tp=2", "world size 4"})
      EXPECT_NE(m.find(s), std::string::npos) << m;
  }
  EXPECT_THROW(comm::MeshDims({1, 1, -1, 3}).resolved(4), UsageError);
}

TEST(Gpt, PresetParameterCounts) {
  // gpt2 with the head tied to wte: 124,439,808 (Hugging Face's count).
  auto counts = [](const std::string& preset) {
    auto c = models::gpt_preset(preset);
    const int64_t n = c.n_embd, L = c.n_layer;
    // wte + wpe + L x (2 LN + qkv + proj + fc + proj) + ln_f
    return c.vocab_size * n + c.block_size * n +
           L * (4 * n + (3 * n * n + 3 * n) + (n * n + n) + (4 * n * n + 4 * n) + (4 * n * n + n)) + 2 * n;
  };
  EXPECT_EQ(counts("gpt2"), 124439808);
  torch::NoGradGuard ng;
  EXPECT_EQ(models::GPT(models::gpt_preset("gpt2"))->num_parameters(), 124439808);
  auto tiny = models::GPT(models::gpt_preset("tiny"));
  EXPECT_EQ(tiny->num_parameters(), counts("tiny"));
  EXPECT_THROW(models::gpt_preset("gpt5"), UsageError);
  EXPECT_THROW(models::GPT(models::GPTConfig{256, 16, 1, 3, 32}), UsageError);
}

TEST(Gpt, IsCausal) {
  torch::manual_seed(0);
  auto m = models::GPT(models::GPTConfig{32, 8, 1, 2, 16});
  auto a = torch::randint(0, 32, {1, 8}, torch::kLong), b = a.clone();
  b[0][7] = (a[0][7].item<int64_t>() + 1) % 32;  // change only the last token
  auto la = m->forward(a), lb = m->forward(b);
  EXPECT_TRUE(torch::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7)));
  EXPECT_FALSE(torch::allclose(la.narrow(1, 7, 1), lb.narrow(1, 7, 1)));
}

TEST(Schedule, WarmupThenCosine) {
  optim::ScheduleOptions s{10, 110, 0.1};
  EXPECT_NEAR(optim::lr_at(0, 1.0, s), 0.1, 1e-12);
  EXPECT_NEAR(optim::lr_at(9, 1.0, s), 1.0, 1e-12);
  EXPECT_NEAR(optim::lr_at(60, 1.0, s), 0.55, 1e-12);
  EXPECT_NEAR(optim::lr_at(110, 1.0, s), 0.1, 1e-12);
}

TEST(AdamW, MatchesLibtorchAdamW) {
  torch::manual_seed(0);
  auto p1 = torch::randn({5, 3}).requires_grad_(), p2 = p1.detach().clone().requires_grad_();
  optim::AdamW ours({p1}, std::vector<bool>{true}, {1e-2, 0.9, 0.95, 1e-8, 0.1});
  torch::optim::AdamW theirs({p2}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  for (int i = 0; i < 5; ++i) {
    auto g = torch::randn({5, 3});
    p1.mutable_grad() = g.clone();
    p2.mutable_grad() = g.clone();
    ours.step(1e-2);
    theirs.step();
  }
  EXPECT_TRUE(torch::allclose(p1, p2, 1e-6, 1e-7));
}

TEST(ClipGradNorm, ScalesToMaxNorm) {
  auto p = torch::zeros({2}).requires_grad_();
  p.mutable_grad() = torch::tensor({3.0f, 4.0f});
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm({p}, 1.0), 5.0);
  EXPECT_NEAR(p.grad().norm().item<double>(), 1.0, 1e-5);
}

TEST(Config, OverridesAndErrors) {
  config::Config c;
  config::apply_override(c, "--train.steps=7");
  config::apply_override(c, "parallel.comm_dtype=bf16");
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.parallel.comm_dtype, "bf16");
  EXPECT_THROW(config::apply_override(c, "--train.steps"), UsageError);
  EXPECT_THROW(config::apply_override(c, "--nosection.x=1"), UsageError);
  EXPECT_THROW(config::apply_override(c, "--metrics.progress=maybe"), UsageError);
}

// Note [Broken pipes]: joining a world ignores SIGPIPE, so a write to a peer
// that has gone fails with EPIPE instead of ending the process; a handler the
// program installed is left alone.
TEST(World, JoiningIgnoresBrokenPipesUnlessTheProgramChose) {
  struct sigaction before {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &before), 0);
  ::signal(SIGPIPE, SIG_DFL);
  comm::WorldInfo one;  // a single process: no store server, no sockets
  comm::World::init(one, {});
  struct sigaction now {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const char byte = 'x';
  errno = 0;
  EXPECT_EQ(::write(fds[0], &byte, 1), -1);  // without the disposition this test process would end here
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[0]);
  // A program's own choice stays.
  static std::atomic<int> seen{0};
  ::signal(SIGPIPE, [](int) { seen.fetch_add(1); });
  comm::World::init(one, {});
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_NE(now.sa_handler, SIG_IGN);
  ::raise(SIGPIPE);
  EXPECT_EQ(seen.load(), 1);
  ::sigaction(SIGPIPE, &before, nullptr);
}

}  // namespace core_test
}  // namespace scaletrain

// Optimizer-state offload: moment estimates in file-backed mappings give the
// same updates as in memory, and leave no file behind.
TEST(AdamW, FileBackedStatesMatchInMemoryStates) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("scaletrain_offload_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  torch::manual_seed(3);
  auto w0 = torch::randn({64, 33});
  auto a = w0.clone().requires_grad_(true), b = w0.clone().requires_grad_(true);
  scaletrain::optim::AdamWOptions in_memory, offloaded;
  offloaded.state_dir = dir.string();
  scaletrain::optim::AdamW oa({a}, std::vector<bool>{true}, in_memory), ob({b}, std::vector<bool>{true}, offloaded);
  for (int s = 0; s < 5; ++s) {
    auto g = torch::randn({64, 33});
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    oa.step(1e-2);
    ob.step(1e-2);
  }
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(oa.exp_avg_sq()[0], ob.exp_avg_sq()[0]));
  EXPECT_TRUE(fs::is_empty(dir)) << "state files are unlinked once mapped";
  scaletrain::optim::AdamWOptions bad;
  bad.state_dir = "/nonexistent/offload";
  EXPECT_THROW(scaletrain::optim::AdamW({torch::zeros({2})}, std::vector<bool>{false}, bad), std::runtime_error);
  fs::remove_all(dir);
}

// Note [FP8 moments] (MS-AMP's O2): the first moment stored as E4M3 codes and
// the second as fp16, each with its own scale, give nearly the fp32 updates at
// 3 bytes of state per parameter; the moments' fp32 values round-trip.
TEST(AdamW, Fp8MomentsTrackFp32Moments) {
  torch::manual_seed(5);
  auto w0 = torch::randn({64, 33});
  auto a = w0.clone().requires_grad_(true), b = w0.clone().requires_grad_(true);
  scaletrain::optim::AdamWOptions fp32, fp8;
  fp8.fp8_moments = true;
  scaletrain::optim::AdamW oa({a}, std::vector<bool>{true}, fp32), ob({b}, std::vector<bool>{true}, fp8);
  EXPECT_EQ(ob.exp_avg()[0].scalar_type(), at::kByte);
  EXPECT_EQ(ob.exp_avg_sq()[0].scalar_type(), at::kHalf);
  EXPECT_EQ(ob.exp_avg()[0].nbytes() + ob.exp_avg_sq()[0].nbytes(), 3 * a.numel());
  for (int s = 0; s < 20; ++s) {
    auto g = torch::randn({64, 33}) * (1 + s % 3);
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    oa.step(1e-2);
    ob.step(1e-2);
  }
  const auto moved = (a - w0).abs().max().item<double>();
  const auto apart = (a - b).abs().max().item<double>();
  EXPECT_GT(apart, 0.0) << "FP8 moments changed nothing";
  EXPECT_LT(apart, 0.1 * moved) << "the updates drifted apart";
  // The stored moments follow the fp32 ones: each step rounds m to 3
  // significand bits (at most 1/16 of a value) and v to fp16's 10, and the
  // averages carry the rounding of earlier steps along (measured: 6.2% and
  // 0.05% relative L2 after 20 steps).
  const auto m32 = oa.exp_avg()[0], m8 = ob.exp_avg_value(0);
  const auto v32 = oa.exp_avg_sq()[0], v16 = ob.exp_avg_sq_value(0);
  const double m_err = ((m8 - m32).norm() / m32.norm()).item<double>();
  const double v_err = ((v16 - v32).norm() / v32.norm()).item<double>();
  std::printf("[fp8 moments] relative L2 error after 20 steps: m %.4f, v %.6f\n", m_err, v_err);
  EXPECT_LT(m_err, 0.1);
  EXPECT_LT(v_err, 2e-3);
  const double m_step = m32.abs().max().item<double>() / 448.0 * std::ldexp(1.0, -9);
  // set_moments stores given fp32 values (a checkpoint's), under either format.
  ob.set_moments(0, m32, v32);
  EXPECT_TRUE(torch::allclose(ob.exp_avg_value(0), m32, 0.07, 2 * m_step));
  oa.set_moments(0, m32 * 2, v32);
  EXPECT_TRUE(torch::equal(oa.exp_avg()[0], m32));  // the same storage: written through
}

// O3's fp16 master shards (Note [FP8 moments]): a step decays and updates an
// fp32 copy of the fp16 weights from fp32 gradients and rounds the result
// once, so it equals the fp32 master's step from the same values, rounded to
// fp16 (and an update made in fp16 arithmetic would not).
TEST(AdamW, Fp16MastersRoundAnFp32UpdateOnce) {
  for (int trial = 0; trial < 3; ++trial) {
    torch::manual_seed(9 + trial);
    auto w16 = (torch::randn({40, 24}) * 0.05).to(at::kHalf).requires_grad_(true);
    auto w32 = w16.detach().to(at::kFloat).requires_grad_(true);
    const auto w0 = w16.detach().clone();
    scaletrain::optim::AdamWOptions o;
    o.fp8_moments = true;
    o.weight_decay = 0.1;
    scaletrain::optim::AdamW opt16({w16}, std::vector<bool>{true}, o), opt32({w32}, std::vector<bool>{true}, o);
    auto g = torch::randn({40, 24}) * std::pow(10.0, -2 - trial);
    w16.mutable_grad() = g.clone();
    w32.mutable_grad() = g.clone();
    opt16.step(3e-3);
    opt32.step(3e-3);
    EXPECT_EQ(w16.scalar_type(), at::kHalf);
    EXPECT_TRUE(torch::equal(w16.detach(), w32.detach().to(at::kHalf))) << "trial " << trial;
    EXPECT_FALSE(torch::equal(w16.detach(), w0)) << "trial " << trial << ": the step moved nothing";
  }
}

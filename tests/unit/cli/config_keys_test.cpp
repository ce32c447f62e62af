// Every key of the config table does what it says, or is refused: for each
// key the real trainer runs twice through the CLI, once with the key at its
// default and once set to another value, and the test observes the change
// (the loss curve, the learning rates, a log line, the checkpoint files, the
// memory record...) or the one-line refusal. A key without an entry in the
// table below fails KeyTable.EveryKeyHasACheck, so a new key cannot be
// accepted and ignored unnoticed. One CTest entry per key (they run in parallel).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>

#include <map>
#include <set>

#include "cli_util.h"
#include "scaletrain/data/text_pipeline.h"
#include "scaletrain/config/config.h"

namespace scaletrain::test {
namespace config_keys_test {

enum class What {
  Refused,  // the keyed run exits 2 with `detail` in its one-line error (launched: each rank's line)
  Fails,    // the keyed run fails with `detail` in its errors (a deadline that acted)
  Losses,   // the per-step losses differ
  Lr,       // the per-step learning rates differ
  Steps,    // the number of steps run differs
  Line,     // the ';'-separated part of rank 0's log that contains `detail` differs
  Files,    // the files under the checkpoint directory differ (names and sizes)
  Memory,   // the end-of-run memory record's measured_mib[`detail`] differs
  Metric,   // the per-step metric `detail` differs
  Tty,      // on a terminal, the output differs (a progress bar)
};

struct Check {
  std::string value;                 // the non-default value
  What what = What::Losses;          // how the change shows
  std::string detail;                // see What
  std::vector<std::string> context;  // further overrides for both runs
  int nproc = 1;                     // ranks
  std::vector<std::string> with;     // further overrides for the keyed run only (what the value needs)
};

const std::string kDir = "@CKPT@";  // replaced by the run's checkpoint directory

// clang-format off
const std::map<std::string, Check>& table() {
  static const std::map<std::string, Check> t = {
    {"model.preset", {"gpt2", What::Line, "parameters", {"model.n_embd=16"}}},
    {"model.config", {"@CONFIGJSON@", What::Line, "parameters"}},
    {"model.n_layer", {"2", What::Line, "parameters"}},
    {"model.n_head", {"4", What::Losses}},
    {"model.n_kv_head", {"1", What::Line, "parameters", {"model.preset=llama-tiny"}}},
    {"model.intermediate_size", {"64", What::Line, "parameters", {"model.preset=llama-tiny"}}},
    {"model.n_embd", {"32", What::Line, "parameters"}},
    {"model.block_size", {"8", What::Line, "samples of"}},
    {"model.vocab_size", {"300", What::Line, "parameters"}},
    {"model.dropout", {"0.2", What::Losses, "", {"model.attention=naive"}}},
    {"model.attention", {"naive", What::Memory, "activations"}},
    {"model.fused", {"false", What::Memory, "activations"}},
    {"model.init_from", {"@HF@", What::Losses}},
    {"model.library", {"/nonexistent/libtask.so", What::Refused, "model.library: no file /nonexistent/libtask.so"}},
    {"model.library_args", {"x", What::Refused, "model.library_args=x is read only with model.library"}},
    {"model.activation_checkpointing", {"full", What::Memory, "activations"}},
    {"model.num_local_experts", {"2", What::Line, "parameters", {"model.preset=mixtral-tiny"}}},
    {"model.num_experts_per_tok", {"1", What::Losses, "", {"model.preset=mixtral-tiny"}}},
    {"model.router_aux_loss_coef", {"1", What::Losses, "", {"model.preset=mixtral-tiny"}}},
    {"model.router_z_loss_coef", {"0.5", What::Losses, "", {"model.preset=mixtral-tiny"}}},
    {"model.capacity_factor", {"0.5", What::Losses, "", {"model.preset=mixtral-tiny"}}},
    {"model.moe_drop_policy", {"position", What::Losses, "", {"model.preset=mixtral-tiny", "model.capacity_factor=0.5"}}},
    {"data.path", {"@TOKENS2@", What::Losses}},
    {"data.tokenizer", {"@TOKJSON@", What::Line, "sample:", {"train.sample_tokens=8"}}},
    {"data.loss_on", {"completion", What::Losses, "", {"data.path=@RECORDS@"}}},
    {"train.sample_chat", {"true", What::Line, "sample:", {"train.sample_tokens=8", "data.tokenizer=@CHATTOK@"}}},
    {"data.packing", {"false", What::Losses, "", {"data.path=@RECORDS@"}}},
    {"data.pack", {"documents", What::Losses, "", {"data.path=@RECORDS@"}}},
    {"data.position_reset", {"false", What::Losses, "", {"data.pack=documents", "data.path=@RECORDS@"}}},
    {"data.document_separator", {"32", What::Losses, "", {}, 1, {"data.pack=documents"}}},
    {"data.mixture", {"@TOKENS2@=1", What::Losses, "", {}, 1, {"data.path="}}},
    {"train.steps", {"4", What::Steps}},
    {"train.global_batch", {"8", What::Line, "global batch"}},
    {"train.micro_batch", {"1", What::Line, "global batch"}},
    {"train.lr", {"0.01", What::Lr}},
    {"train.warmup_steps", {"1", What::Lr}},
    {"train.min_lr_ratio", {"0.5", What::Lr, "", {"train.warmup_steps=1"}}},
    {"train.weight_decay", {"0.9", What::Losses}},
    {"train.beta1", {"0.5", What::Losses}},
    {"train.beta2", {"0.5", What::Losses}},
    {"train.eps", {"0.01", What::Losses}},
    {"train.grad_clip", {"0.01", What::Losses}},
    {"train.seed", {"7", What::Losses}},
    {"train.sample_tokens", {"8", What::Line, "sample:"}},
    {"train.sample_prompt", {"Hello", What::Line, "sample:", {"train.sample_tokens=8"}}},
    {"train.lr_schedule", {"linear", What::Lr, "", {"train.warmup_steps=1", "train.steps=4"}}},
    {"train.warmup_type", {"log", What::Lr}},
    {"train.warmup_start_ratio", {"0.5", What::Lr}},
    {"train.stop_at", {"2", What::Steps}},
    {"train.device", {"cuda", What::Refused, "train.device=cuda needs a CUDA build"}},
    {"parallel.strategy", {"zero2", What::Line, "strategy"}},
    {"parallel.dp_replicate", {"2", What::Line, "mesh", {}, 2}},
    {"parallel.dp_shard", {"1", What::Refused, "(replicate=1 x shard=1) x tp=1 = 1 ranks does not match world size 2", {}, 2}},
    {"parallel.tp", {"2", What::Line, "mesh", {}, 2}},
    {"parallel.ep", {"2", What::Line, "strategy", {"model.preset=mixtral-tiny", "train.sample_tokens=0"}, 2}},
    {"parallel.pp", {"2", What::Line, "mesh", {"model.n_layer=2"}, 2}},
    {"parallel.cp", {"2", What::Line, "mesh", {}, 2}},
    {"parallel.cp_mode", {"all_to_all", What::Line, "mesh", {"parallel.cp=2"}, 2}},
    {"parallel.schedule", {"gpipe", What::Line, "strategy", {"parallel.pp=2", "model.n_layer=2"}, 2}},
    {"parallel.microbatches", {"4", What::Line, "global batch", {"parallel.pp=2", "model.n_layer=2"}, 2}},
    {"parallel.virtual_stages", {"2", What::Line, "strategy", {"parallel.pp=2", "model.n_layer=4", "parallel.schedule=interleaved"}, 2}},
    {"parallel.pp_balance", {"time", What::Line, "strategy", {"parallel.pp=2", "model.n_layer=3"}, 2}},
    {"parallel.bucket_cap_mb", {"0.002", What::Line, "strategy", {"parallel.first_bucket_mb=0.001"}, 2}},
    {"parallel.first_bucket_mb", {"0.001", What::Line, "strategy", {"parallel.last_bucket_mb=0"}, 2}},
    {"parallel.last_bucket_mb", {"0.001", What::Line, "strategy", {"parallel.bucket_cap_mb=0.004", "parallel.first_bucket_mb=0.001"}, 2}},
    {"parallel.find_unused_parameters", {"true", What::Line, "strategy", {}, 2}},
    {"parallel.sequence_parallel", {"true", What::Line, "strategy", {"parallel.tp=2"}, 2}},
    {"parallel.comm_dtype", {"bf16", What::Line, "precision:", {}, 2}},
    {"parallel.backend", {"nccl", What::Refused, "parallel.backend=nccl needs CUDA"}},
    {"parallel.debug_collectives", {"true", What::Line, "fingerprint", {}, 2}},
    {"parallel.timeout_s", {"1e-9", What::Fails, "Timed out waiting 0ms|could not connect within 0s", {}, 2}},
    {"parallel.fsdp.sharding_strategy", {"SHARD_GRAD_OP", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.auto_wrap_policy", {"none", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.transformer_layer_cls", {"NoSuchLayer", What::Refused, "NoSuchLayer", {"parallel.strategy=fsdp"}}},
    {"parallel.fsdp.min_num_params", {"1000", What::Line, "strategy", {"parallel.strategy=fsdp", "parallel.fsdp.auto_wrap_policy=size"}, 2}},
    {"parallel.fsdp.backward_prefetch", {"NONE", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.forward_prefetch", {"true", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.limit_all_gathers", {"false", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.offload_params", {"true", What::Line, "strategy", {"parallel.strategy=fsdp"}}},
    {"parallel.fsdp.sync_module_states", {"false", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.cpu_ram_efficient_loading", {"true", What::Line, "strategy", {"parallel.strategy=fsdp"}, 2}},
    {"parallel.fsdp.state_dict_type", {"FULL_STATE_DICT", What::Files, "", {"parallel.strategy=fsdp", "checkpoint.dir=" + kDir}, 2}},
    {"parallel.zero.reduce_bucket_mb", {"0.001", What::Line, "strategy", {"parallel.strategy=zero2", "model.n_layer=3", "parallel.first_bucket_mb=0.001", "parallel.last_bucket_mb=0"}, 2}},
    {"parallel.zero.allgather_bucket_mb", {"0.01", What::Line, "strategy", {"parallel.strategy=zero1"}, 2}},
    {"parallel.zero.overlap_comm", {"false", What::Refused, "must stay true", {"parallel.strategy=zero2"}}},
    {"parallel.zero.contiguous_gradients", {"false", What::Refused, "must stay true", {"parallel.strategy=zero2"}}},
    {"parallel.zero.reduce_scatter", {"false", What::Refused, "must stay true", {"parallel.strategy=zero2"}}},
    {"parallel.zero.allgather_partitions", {"false", What::Refused, "must stay true", {"parallel.strategy=zero2"}}},
    {"parallel.zero.offload_optimizer", {"nvme", What::Memory, "rss_file_growth", {"parallel.strategy=zero2"}, 1, {"parallel.zero.offload_dir=@SCRATCH@"}}},
    {"parallel.zero.offload_param", {"nvme", What::Memory, "rss_file_growth", {"parallel.strategy=zero3"}, 1, {"parallel.zero.offload_dir=@SCRATCH@"}}},
    {"parallel.zero.offload_dir", {"/nonexistent/dir", What::Refused, "not a writable directory", {"parallel.strategy=zero2"}, 1, {"parallel.zero.offload_optimizer=nvme"}}},
    {"parallel.zero.offload_pin_memory", {"true", What::Refused, "offload_pin_memory=true needs a CUDA device", {"parallel.strategy=zero2"}}},
    {"parallel.zero.prefetch_bucket_mb", {"0.001", What::Line, "strategy", {"parallel.strategy=zero3"}, 2}},
    {"parallel.zero.max_live_parameters", {"1", What::Line, "strategy", {"parallel.strategy=zero3"}, 2}},
    {"precision.mode", {"bf16", What::Line, "precision:"}},
    {"precision.param_dtype", {"bf16", What::Line, "precision:", {"parallel.strategy=zero2", "precision.mode=bf16"}}},
    {"precision.reduce_dtype", {"bf16", What::Line, "precision:"}},
    {"precision.buffer_dtype", {"bf16", What::Refused, "the model has no buffers"}},
    {"precision.loss_scale", {"128", What::Metric, "loss_scale", {"precision.mode=bf16", "precision.scale_bf16=true"}}},
    {"precision.initial_scale_power", {"4", What::Metric, "loss_scale", {"precision.mode=bf16", "precision.scale_bf16=true"}}},
    {"precision.loss_scale_window", {"1", What::Metric, "loss_scale", {"precision.mode=bf16", "precision.scale_bf16=true"}}},
    // Only an overflow shows these two, which bf16 on CPU never has: refused where
    // they cannot act, and read by the scaler where they can (tests/unit/torch/precision_test.cpp).
    {"precision.hysteresis", {"1", What::Refused, "precision.hysteresis=1 would have no effect"}},
    {"precision.min_loss_scale", {"1e9", What::Refused, "min_scale <= initial_scale", {"precision.mode=bf16", "precision.scale_bf16=true"}}},
    {"precision.scale_bf16", {"true", What::Line, "precision:", {"precision.mode=bf16"}}},
    {"precision.fp8", {"true", What::Losses}},
    {"precision.fp8_format", {"e4m3", What::Losses, "", {"precision.fp8=true"}}},
    {"precision.fp8_recipe", {"current", What::Losses, "", {"precision.fp8=true"}}},
    {"precision.fp8_amax_history", {"1", What::Losses, "", {"precision.fp8=true"}}},
    {"precision.fp8_margin", {"3", What::Losses, "", {"precision.fp8=true"}}},
    {"precision.fp8_opt_level", {"O1", What::Losses, "", {"precision.fp8=true"}, 2}},
    {"metrics.path", {"", What::Steps}},
    {"metrics.peak_flops", {"2e11", What::Line, "GFLOP/s"}},
    {"metrics.log_every", {"2", What::Line, "step     1 |"}},
    {"metrics.progress", {"false", What::Tty}},
    {"metrics.trace_steps", {"2", What::Line, "trace of steps"}},
    {"metrics.trace_dir", {kDir, What::Line, "trace of steps", {"metrics.trace_steps=2"}}},
    {"checkpoint.dir", {kDir, What::Files}},
    {"checkpoint.every", {"1", What::Files, "", {"checkpoint.dir=" + kDir}}},
    {"checkpoint.keep", {"1", What::Files, "", {"checkpoint.dir=" + kDir, "checkpoint.every=1"}}},
    {"checkpoint.resume", {"never", What::Steps, "", {"checkpoint.dir=@DONE@"}}},
    {"checkpoint.async", {"true", What::Line, "checkpoint started", {"checkpoint.dir=" + kDir}}},
    {"finetune.method", {"lora", What::Line, "finetune"}},
    {"finetune.r", {"2", What::Line, "finetune", {"finetune.method=lora"}}},
    {"finetune.alpha", {"32", What::Losses, "", {"finetune.method=lora"}}},
    {"finetune.rslora", {"true", What::Losses, "", {"finetune.method=lora", "finetune.r=4"}}},
    {"finetune.dropout", {"0.5", What::Losses, "", {"finetune.method=lora"}}},
    {"finetune.target_modules", {"c_fc", What::Line, "finetune", {"finetune.method=lora"}}},
    {"finetune.init", {"gaussian", What::Losses, "", {"finetune.method=lora"}}},
    {"finetune.bias", {"all", What::Refused, "finetune.bias must be one of none"}},
    {"finetune.double_quant", {"false", What::Losses, "", {"finetune.method=qlora"}}},
    {"finetune.adapter_from", {"@ADAPTER@", What::Losses, "", {"finetune.method=lora"}}},
  };
  return t;
}
// clang-format on

// What one run left behind.
struct Outputs {
  int code = 0;
  std::string err, log;
  std::vector<nlohmann::json> steps, memory;
  std::vector<std::string> files;
};

fs::path base_config() {
  return write("keys.yaml", "model:\n  n_layer: 1\n  n_embd: 16\n  n_head: 2\n  block_size: 16\ndata:\n  path: " +
                                tokens().string() +
                                "\ntrain:\n  steps: 3\n  global_batch: 4\n  micro_batch: 2\n  sample_tokens: 0\n"
                                "metrics:\n  peak_flops: 1.0e11\n  progress: false\n");
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string substitute(std::string s, const fs::path& ckpt) {
  auto put = [&](const std::string& from, const std::string& to) {
    for (size_t at; (at = s.find(from)) != std::string::npos;) s.replace(at, from.size(), to);
  };
  put(kDir, ckpt.string());
  put("@SCRATCH@", scratch().string());
  if (s.find("@TOKENS2@") != std::string::npos) {
    std::string text;
    for (int i = 0; i < 300; ++i) text += "Quick brown foxes jump over lazy dogs, " + std::to_string(i) + ". ";
    const auto out = scratch() / "other.tok";
    EXPECT_EQ(run("prepare " + write("other.txt", text).string() + " -o " + out.string()).code, 0);
    put("@TOKENS2@", out.string());
  }
  if (s.find("@RECORDS@") != std::string::npos) {  // prompt/completion records (data.loss_on, data.packing)
    std::string jsonl;
    for (int i = 0; i < 60; ++i)
      jsonl += "{\"prompt\": \"What is " + std::to_string(i) + " plus two? \", \"completion\": \"It is " +
               std::to_string(i + 2) + ".\"}\n";
    const auto out = scratch() / "records.tok";
    EXPECT_EQ(run("prepare " + write("records.jsonl", jsonl).string() + " -o " + out.string()).code, 0);
    put("@RECORDS@", out.string());
  }
  if (s.find("@CHATTOK@") != std::string::npos) {  // @TOKJSON@'s tokenizer with a chat template beside it
    const auto dir = scratch() / "chat_tokenizer";
    fs::create_directories(dir);
    fs::copy_file(substitute("@TOKJSON@", ckpt), dir / "tokenizer.json", fs::copy_options::overwrite_existing);
    const nlohmann::json config = {{"chat_template",
                                    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}[assistant] {% endif %}"}};
    std::ofstream(dir / "tokenizer_config.json") << config.dump();
    put("@CHATTOK@", dir.string());
  }
  if (s.find("@TOKJSON@") != std::string::npos) {
    // A byte-level tokenizer.json of 256 ids numbered backwards (byte b is id
    // 255 - b): the token file fits it, training is unchanged, and only the
    // text sample (prompt in, text out) can show that the key was read.
    nlohmann::json vocab = nlohmann::json::object();
    for (unsigned b = 0; b < 256; ++b) vocab[data::byte_level_char(static_cast<unsigned char>(b))] = 255 - b;
    const nlohmann::json j = {{"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
                              {"decoder", {{"type", "ByteLevel"}}},
                              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
    put("@TOKJSON@", write("reversed_tokenizer.json", j.dump()).string());
  }
  if (s.find("@DONE@") != std::string::npos) {  // a finished run's checkpoints (resume has something to take)
    const auto done = scratch() / "done_ckpt";
    fs::remove_all(done);
    EXPECT_EQ(run("train " + base_config().string() + " --checkpoint.dir=" + done.string()).code, 0);
    put("@DONE@", done.string());
  }
  if (s.find("@ADAPTER@") != std::string::npos) {  // a trained LoRA adapter of the base config's model, PEFT layout
    const auto ck = scratch() / "adapter_ckpt", out = scratch() / "adapter_dir";
    fs::remove_all(ck);
    fs::remove_all(out);
    EXPECT_EQ(run("train " + base_config().string() + " --finetune.method=lora --checkpoint.dir=" + ck.string()).code,
              0);
    EXPECT_EQ(run("checkpoint export " + (ck / "step-000003").string() + " --adapter -o " + out.string()).code, 0);
    put("@ADAPTER@", out.string());
  }
  if (s.find("@CONFIGJSON@") != std::string::npos) {  // a small llama with the base config's dimensions
    const nlohmann::json j = {{"model_type", "llama"},    {"vocab_size", 256},       {"max_position_embeddings", 128},
                              {"hidden_size", 16},        {"intermediate_size", 40}, {"num_hidden_layers", 1},
                              {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
    put("@CONFIGJSON@", write("small_llama_config.json", j.dump()).string());
  }
  if (s.find("@HF@") != std::string::npos) {  // a Hugging Face GPT-2 file of a trained model
    const auto done = scratch() / "hf_ckpt";
    fs::remove_all(done);
    EXPECT_EQ(run("train " + base_config().string() + " --checkpoint.dir=" + done.string()).code, 0);
    const auto hf = scratch() / "hf.safetensors";
    EXPECT_EQ(run("checkpoint consolidate " + (done / "step-000003").string() + " -o " + hf.string()).code, 0);
    put("@HF@", hf.string());
  }
  return s;
}

// What a run left in `dir`: its exit code, stderr, rank 0's log, metrics and checkpoint files.
Outputs read_outputs(const fs::path& dir, int nproc) {
  const fs::path metrics = dir / "metrics.jsonl", ckpt = dir / "ckpt";
  Outputs out;
  std::ifstream(dir / "code.txt") >> out.code;
  out.err = slurp(dir / "err.txt");
  out.log = nproc == 1 ? slurp(dir / "out.txt") : slurp(dir / "logs" / "rank0.log");
  if (fs::exists(metrics)) {
    std::ifstream in(metrics);
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      (j.contains("record") ? out.memory : out.steps).push_back(j);
    }
  }
  if (fs::exists(ckpt))
    for (const auto& e : fs::recursive_directory_iterator(ckpt))
      if (e.is_regular_file())
        out.files.push_back(fs::relative(e.path(), ckpt).string() + " " + std::to_string(e.file_size()));
  std::sort(out.files.begin(), out.files.end());
  return out;
}

// Runs the trainer in `dir` (emptied first) and reads what it left there.
Outputs train_in(const fs::path& dir, const std::vector<std::string>& overrides, int nproc, bool tty) {
  const fs::path metrics = dir / "metrics.jsonl", ckpt = dir / "ckpt";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string args = "train " + base_config().string();
  for (const auto& o : overrides) args += " '--" + substitute(o, ckpt) + "'";
  if (std::none_of(overrides.begin(), overrides.end(), [](auto& o) { return o.rfind("metrics.path=", 0) == 0; }))
    args += " --metrics.path=" + metrics.string();
  const std::string bin = SCALETRAIN_BIN;
  std::string cmd = nproc == 1
                        ? bin + " " + args
                        : bin + " launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 " +
                              "--log-dir " + (dir / "logs").string() + " -- " + bin + " " + args;
  if (tty) cmd = "script -qec \"" + cmd + "\" /dev/null";
  const std::string full = "cd " + dir.string() + " && env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK " +
                           "-u SLURM_PROCID " + cmd + " >" + (dir / "out.txt").string() + " 2>" +
                           (dir / "err.txt").string();
  const int status = std::system(full.c_str());
  std::ofstream(dir / "code.txt") << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return read_outputs(dir, nproc);
}

Outputs train_once(const std::string& tag, const std::vector<std::string>& overrides, int nproc, bool tty) {
  return train_in(scratch() / ("keys_" + tag), overrides, nproc, tty);
}

// The seconds since boot at which process `pid` started (/proc/PID/stat, field 22).
std::string start_time(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  std::stringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
  }
  return field;
}

// The run with every key at its default is the same for each key that gives
// the same context, rank count and terminal: of the CTest entries that need
// one, the first runs it and the others read its files, under a lock. The
// directory is named by the runner (CTest's pid and start time: one per
// `ctest` call), the binaries' modification times and the run's inputs, so
// a rebuilt binary or a changed base config never reads an old run. The
// keyed run and this one differ in their directories' names, as before.
Outputs default_run(const Check& c, bool tty) {
  // The base config names this process's scratch directory, whose files are the same in every process.
  std::string id = slurp(base_config());
  for (size_t at; (at = id.find(scratch().string())) != std::string::npos;)
    id.replace(at, scratch().string().size(), "@SCRATCH@");
  id += " " + std::to_string(::getppid()) + " " + start_time(::getppid());
  const fs::path bin(SCALETRAIN_BIN);
  for (const auto& e : fs::directory_iterator(bin.parent_path()))
    if (e.path() == bin || e.path().filename().string().rfind("libscaletrain", 0) == 0)
      id += " " + e.path().filename().string() + "@" +
            std::to_string(fs::last_write_time(e.path()).time_since_epoch().count());
  for (const auto& o : c.context) id += " " + o;
  id += " " + std::to_string(c.nproc) + (tty ? " tty" : "");
  const fs::path dir =
      fs::temp_directory_path() / ("scaletrain_keys_default_" + std::to_string(std::hash<std::string>{}(id)));
  const int lock = ::open((dir.string() + ".lock").c_str(), O_CREAT | O_RDWR, 0644);
  EXPECT_GE(lock, 0) << dir;
  if (lock >= 0) ::flock(lock, LOCK_EX);
  const Outputs out =
      fs::exists(dir / "code.txt") ? read_outputs(dir, c.nproc) : train_in(dir, c.context, c.nproc, tty);
  if (lock >= 0) ::close(lock);  // releases the lock
  return out;
}

// The part of the first log line that contains `needle`, between ';' or '|'
// separators (log lines also carry timings, which differ between any two
// runs: a step line's "| 8.4 ms |" once made every step line differ).
std::string part_with(const std::string& log, const std::string& needle) {
  std::stringstream ss(log);
  for (std::string line; std::getline(ss, line);) {
    const size_t at = line.find(needle);
    if (at == std::string::npos) continue;
    const size_t begin = line.find_last_of(";|", at), end = line.find_first_of(";|", at + needle.size());
    return line.substr(begin == std::string::npos ? 0 : begin + 1, end == std::string::npos ? end : end - begin - 1);
  }
  return "";
}

std::vector<double> field(const Outputs& o, const char* name) {
  std::vector<double> v;
  for (const auto& s : o.steps) v.push_back(s.at(name).get<double>());
  return v;
}

class ConfigKey : public ::testing::TestWithParam<std::string> {};

TEST_P(ConfigKey, ChangesWhatItSaysOrIsRefused) {
  const std::string key = GetParam();
  ASSERT_TRUE(table().count(key)) << key << " has no check in the table";
  const Check& c = table().at(key);
  std::vector<std::string> with = c.context;
  with.push_back(key + "=" + c.value);
  with.insert(with.end(), c.with.begin(), c.with.end());
  const Outputs got = train_once(key + "_set", with, c.nproc, c.what == What::Tty);
  if (c.what == What::Refused || c.what == What::Fails) {
    EXPECT_NE(got.code, 0) << got.err;
    if (c.what == What::Refused) EXPECT_EQ(got.code, 2) << got.err;  // launched ranks too
    if (c.what == What::Refused && c.nproc == 1)
      EXPECT_EQ(std::count(got.err.begin(), got.err.end(), '\n'), 1) << got.err;
    // `detail` may list alternatives, "a|b" (a deadline can act in more than one place).
    bool found = false;
    std::stringstream alternatives(c.detail);
    for (std::string a; std::getline(alternatives, a, '|');) found = found || got.err.find(a) != std::string::npos;
    EXPECT_TRUE(found) << "'" << c.detail << "' not in: " << got.err;
    const Outputs ref = default_run(c, false);
    EXPECT_EQ(ref.code, 0) << "the same run without " << key << " must work: " << ref.err;
    return;
  }
  ASSERT_EQ(got.code, 0) << key << "=" << c.value << ": " << got.err;
  const Outputs ref = default_run(c, c.what == What::Tty);
  ASSERT_EQ(ref.code, 0) << ref.err;
  switch (c.what) {
    case What::Losses: {
      const auto a = field(ref, "loss"), b = field(got, "loss");
      ASSERT_FALSE(a.empty());
      EXPECT_NE(a, b) << key << " left the loss curve unchanged";
      break;
    }
    case What::Lr:
      EXPECT_NE(field(ref, "lr"), field(got, "lr")) << key << " left the learning rates unchanged";
      break;
    case What::Steps:
      EXPECT_NE(ref.steps.size(), got.steps.size()) << key << " left the steps unchanged";
      break;
    case What::Line: {
      const std::string a = part_with(ref.log, c.detail), b = part_with(got.log, c.detail);
      EXPECT_TRUE(!a.empty() || !b.empty()) << "no log line with '" << c.detail << "':\n" << ref.log;
      EXPECT_NE(a, b) << key << ": '" << a << "'";
      break;
    }
    case What::Files:
      EXPECT_NE(ref.files, got.files) << key << " left the checkpoint files unchanged";
      break;
    case What::Memory:
      ASSERT_FALSE(ref.memory.empty());
      ASSERT_FALSE(got.memory.empty());
      EXPECT_NE(ref.memory.back()["measured_mib"][c.detail], got.memory.back()["measured_mib"][c.detail]);
      break;
    case What::Metric:
      EXPECT_NE(field(ref, c.detail.c_str()), field(got, c.detail.c_str()))
          << key << " left " << c.detail << " unchanged";
      break;
    case What::Tty:
      EXPECT_NE(ref.log, got.log) << key << " left the terminal output unchanged";
      break;
    case What::Refused:
    case What::Fails:
      break;
  }
}

INSTANTIATE_TEST_SUITE_P(All, ConfigKey, ::testing::ValuesIn(config::config_keys()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

TEST(KeyTable, EveryKeyHasACheck) {
  std::set<std::string> keys;
  for (const auto& k : config::config_keys()) {
    keys.insert(k);
    EXPECT_TRUE(table().count(k)) << k << ": a key without a check in tests/unit/cli/config_keys_test.cpp";
  }
  for (const auto& [k, c] : table()) EXPECT_TRUE(keys.count(k)) << k << " is in the table but not a key";
}

}  // namespace config_keys_test
}  // namespace scaletrain::test

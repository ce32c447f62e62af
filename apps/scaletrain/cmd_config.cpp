// `scaletrain config`: write a starting config file, as `accelerate config`
// does. Interactive when stdin is a terminal (each question shows its
// default; Enter keeps it; flags given on the command line are not asked),
// from flags otherwise:
//
//   scaletrain config -o run.yaml --strategy zero2 --num-processes 2 \
//       --precision bf16 --preset tiny --data tokens.bin
//
// The file holds num_processes (read by `scaletrain launch --config_file`,
// accepted by `scaletrain train`) and the model, data, train, parallel and
// precision sections; it is read back through load_config before it is
// written, so what is written is a config `scaletrain train` accepts.
// `scaletrain config keys` lists every key with its type and default.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "scaletrain/train/plan/config.h"
#include "scaletrain/util/error.h"

namespace scaletrain::cli {
namespace {

// One question: the config key it fills (validated by apply_override), its
// prompt, and the answer (the flag's value or the default).
struct Question {
  const char* flag;    // command-line flag, without "--"
  const char* key;     // "section.key", or "" for num_processes (not a Config key)
  const char* prompt;  // asked on a terminal
  std::string value;   // default, replaced by the flag or the answer
  CLI::Option* option = nullptr;
};

// Checks one answer the way `scaletrain train` will read it.
void check(const Question& q) {
  if (std::string(q.key).empty()) {
    int64_t n = 0;
    try {
      n = std::stoll(q.value);
    } catch (const std::exception&) {
    }
    if (n < 1 || std::to_string(n) != q.value)
      throw UsageError(std::string("--") + q.flag + ": '" + q.value + "' is not a positive integer");
    return;
  }
  config::Config c;
  config::apply_override(c, std::string(q.key) + "=" + q.value);
}

// YAML double-quoted scalar: paths and prompts may hold ':' or '#'.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

// `scaletrain config keys`: every key the config reader accepts, from the key
// table itself (config::config_key_table), with its type and default. --tsv is
// for scripts/gen-config-doc.py, which writes docs/config.md from it.
CLI::App* add_config_keys(CLI::App& config_cmd, Runner& run) {
  auto* cmd = config_cmd.add_subcommand(
      "keys", "print every config key the reader accepts, with its type and default (docs/config.md explains each)");
  auto tsv = std::make_shared<bool>(false);
  cmd->add_flag("--tsv", *tsv, "tab-separated: key, type, default, choices (joined by ' | ')");
  cmd->callback([&run, tsv] {
    run = [tsv] {
      const auto rows = config::config_key_table();
      auto shown = [](const std::string& v) { return v.empty() ? std::string("\"\"") : v; };
      size_t width = 0;
      for (const auto& r : rows) width = std::max(width, r.key.size());
      for (const auto& r : rows) {
        std::string choices;
        for (const auto& c : r.choices) choices += (choices.empty() ? "" : " | ") + shown(c);
        if (*tsv)
          std::printf("%s\t%s\t%s\t%s\n", r.key.c_str(), r.type.c_str(), r.default_value.c_str(), choices.c_str());
        else
          std::printf("%-*s  %-6s  %s%s\n", static_cast<int>(width), r.key.c_str(), r.type.c_str(),
                      shown(r.default_value).c_str(), choices.empty() ? "" : ("  (" + choices + ")").c_str());
      }
      return 0;
    };
  });
  return cmd;
}

}  // namespace

void add_config(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("config",
                                 "write a starting config file (asks on a terminal, else takes flags), as "
                                 "`accelerate config` does");
  auto output = std::make_shared<std::string>("scaletrain.yaml");
  auto force = std::make_shared<bool>(false);
  auto qs = std::make_shared<std::vector<Question>>(std::vector<Question>{
      {"strategy", "parallel.strategy", "Parallelism: ddp | zero1 | zero2 | zero3 | fsdp", "ddp"},
      {"num-processes", "", "Processes in total (over all machines)", "1"},
      {"precision", "precision.mode", "Precision: fp32 | bf16 (fp16 needs CUDA)", "fp32"},
      {"preset", "model.preset", "Model preset: tiny | gpt2 | gpt2-medium | gpt2-large | gpt2-xl", "tiny"},
      {"data", "data.path", "Token file (from `scaletrain prepare`)", "tokens.bin"},
      {"steps", "train.steps", "Optimizer steps", "100"},
      {"global-batch", "train.global_batch", "Sequences per optimizer step (all ranks)", "32"},
      {"micro-batch", "train.micro_batch", "Sequences per forward/backward", "8"},
      {"lr", "train.lr", "Peak learning rate", "0.001"},
  });
  cmd->add_option("-o,--output", *output, "file to write")->capture_default_str();
  cmd->add_flag("-f,--force", *force, "overwrite an existing file");
  for (auto& q : *qs) q.option = cmd->add_option(std::string("--") + q.flag, q.value, q.prompt)->capture_default_str();
  CLI::App* keys = add_config_keys(*cmd, run);
  cmd->callback([&run, output, force, qs, keys] {
    if (keys->parsed()) return;  // `config keys` ran its own callback first
    run = [output, force, qs] {
      const bool ask = ::isatty(0) != 0;
      for (auto& q : *qs) {
        if (ask && q.option->count() == 0) {
          for (;;) {
            std::printf("%s [%s]: ", q.prompt, q.value.c_str());
            std::fflush(stdout);
            std::string line;
            if (!std::getline(std::cin, line)) throw UsageError("scaletrain config: input ended");
            const std::string old = q.value;
            if (!line.empty()) q.value = line;
            try {
              check(q);
              break;
            } catch (const UsageError& e) {
              std::printf("  %s\n", e.what());
              q.value = old;
            }
          }
        } else {
          check(q);
        }
      }
      namespace fs = std::filesystem;
      if (fs::exists(*output) && !*force)
        throw UsageError("scaletrain config: " + *output + " exists (use --force to overwrite)");
      auto value = [&](const char* flag) -> const std::string& {
        for (const auto& q : *qs)
          if (std::string(q.flag) == flag) return q.value;
        throw std::logic_error(flag);
      };
      std::string text =
          "# Written by `scaletrain config`. Run on one machine with\n"
          "#   scaletrain launch --config_file " +
          *output + " -- scaletrain train " + *output +
          "\n# Every key: docs/config.md or `scaletrain config keys`; override any with --section.key=value.\n"
          "num_processes: " +
          value("num-processes") + "  # read by scaletrain launch --config_file\n" +
          "model:\n  preset: " + value("preset") + "\n" + "data:\n  path: " + quoted(value("data")) + "\n" +
          "train:\n  steps: " + value("steps") + "\n  global_batch: " + value("global-batch") +
          "\n  micro_batch: " + value("micro-batch") + "\n  lr: " + value("lr") + "\n" +
          "parallel:\n  strategy: " + value("strategy") + "\n" + "precision:\n  mode: " + value("precision") + "\n";
      // Read it back before writing it: the file must be one `scaletrain train` accepts.
      const fs::path tmp = fs::path(*output).string() + ".tmp";
      std::ofstream(tmp) << text;
      try {
        train::load_config(tmp.string());
      } catch (...) {
        fs::remove(tmp);
        throw;
      }
      fs::rename(tmp, *output);
      std::printf("wrote %s\n", output->c_str());
      return 0;
    };
  });
}

}  // namespace scaletrain::cli

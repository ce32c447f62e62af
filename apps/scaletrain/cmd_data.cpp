// `scaletrain prepare` and `scaletrain plot`: the torch-free data subcommands.
//
//   scaletrain prepare TEXT... -o TOKENS [--tokenizer PATH [--add-special-tokens]]
//       Encodes the text files in the order given and writes their tokens,
//       concatenated, to one token file (Note [Token file layout] in
//       data/token_file.h). The byte tokenizer (one token per byte, vocab 256)
//       unless --tokenizer names a Hugging Face tokenizer.json, or a directory
//       with one (or with GPT-2's encoder.json + vocab.bpe); the file then holds
//       16-bit ids up to 65,536 ids, 32-bit ids above. Each file is encoded
//       as one text (--add-special-tokens: with the post-processor's BOS/EOS).
//   scaletrain prepare RECORDS.jsonl[.gz|.zst]... | DIR -o TOKENS [--tokenizer PATH]
//       [--chat-template FILE] [--field KIND=NAME]... [--add-special-tokens] [--threads N]
//       [--shard-tokens N]
//       JSON lines of text, prompt/completion or messages records (data/
//       records.h): one document per record with a target mask, written as a
//       version 2 token file (Note [Token file records]), or with
//       --shard-tokens a directory of them and an index (Note [Token
//       shards]); messages are
//       rendered with the chat template of the tokenizer's
//       tokenizer_config.json or of --chat-template.
//   scaletrain plot METRICS.jsonl [-o curves.svg] [--title TEXT]
//       Draws loss and tokens/s against step from a trainer metrics log;
//       several logs (--labels a,b) are compared on one picture.
//   scaletrain plot --timeline TRACE.json [-o timeline.svg]
//       Draws a Chrome trace (metrics.trace_steps) as per-rank lanes.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <sys/stat.h>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include "commands.h"
#include "plot.h"

#include "scaletrain/data/prepare.h"
#include "scaletrain/data/records.h"
#include "scaletrain/data/token_file.h"
#include "scaletrain/data/token_shards.h"
#include "scaletrain/data/tokenizer.h"
#include "scaletrain/util/error.h"

namespace scaletrain::cli {
namespace {

struct PrepareArgs {
  std::vector<std::string> inputs;  // text files, concatenated in this order
  std::string output;               // token file to write
  std::string tokenizer;            // tokenizer.json or a directory with one ("" = bytes)
  bool add_special_tokens = false;  // the post-processor's BOS/EOS around each file
  std::string chat_template;        // JSONL messages: a Jinja template file ("" = the tokenizer's)
  std::vector<std::string> fields;  // JSONL: KIND=NAME renames (text, prompt, completion, messages)
  int threads = 0;                  // JSONL: encoding threads (0 = one per core)
  int64_t shard_tokens = 0;         // JSONL: > 0 writes a shard directory (Note [Token shards])
};

struct PlotArgs {
  std::vector<std::string> metrics;   // JSON-lines metrics logs (several: compared)
  std::vector<std::string> labels;    // one per log, for the legend
  std::string output = "curves.svg";  // SVG to write
  std::string title;                  // heading; defaults to the metrics path
  bool timeline = false;              // the file is a Chrome trace
};

// Reads a whole file as bytes. Checked here rather than with CLI11's
// ExistingFile validator so a missing input is a UsageError with our wording,
// like every other bad input.
std::string read_bytes(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw UsageError("prepare: input " + path + ": " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) throw UsageError("prepare: input " + path + ": not a regular file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("prepare: input " + path + ": cannot open");
  std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (in.gcount() != static_cast<std::streamsize>(bytes.size())) {
    throw UsageError("prepare: input " + path + ": short read (file changed while reading?)");
  }
  return bytes;
}

// prepare with a tokenizer.json tokenizer: 32-bit ids in memory, written as
// u16 or u32 by vocabulary size.
int prepare_with(const PrepareArgs& args, data::Tokenizer tokenizer) {
  std::vector<uint32_t> tokens;
  uint64_t total_bytes = 0;
  for (const auto& path : args.inputs) {
    const std::string bytes = read_bytes(path);
    total_bytes += bytes.size();
    try {
      tokenizer.encode_append(bytes, tokens, args.add_special_tokens);
    } catch (const UsageError& e) {  // e.g. not UTF-8: name the input too
      throw UsageError("prepare: input " + path + ": " + e.what());
    }
  }
  const uint32_t vocab = tokenizer.vocab_size();
  data::write_token_file(args.output, tokens, vocab);
  std::printf("prepare: %zu file(s), %llu bytes -> %zu tokens (vocab %u, %s ids, tokenizer %s) in %s\n",
              args.inputs.size(), static_cast<unsigned long long>(total_bytes), tokens.size(), vocab,
              data::dtype_for_vocab(vocab) == data::kDtypeUint16 ? "16-bit" : "32-bit",
              tokenizer.describe().c_str(), args.output.c_str());
  return 0;
}

// --field KIND=NAME into the record options.
void set_fields(const std::vector<std::string>& fields, data::RecordOptions& o) {
  for (const auto& f : fields) {
    const auto eq = f.find('=');
    const std::string kind = f.substr(0, eq), name = eq == std::string::npos ? "" : f.substr(eq + 1);
    std::string* slot = kind == "text"         ? &o.text_field
                        : kind == "prompt"     ? &o.prompt_field
                        : kind == "completion" ? &o.completion_field
                        : kind == "messages"   ? &o.messages_field
                                               : nullptr;
    if (slot == nullptr || name.empty())
      throw UsageError("prepare: --field " + f + ": expected KIND=NAME, KIND one of text, prompt, completion, messages");
    *slot = name;
  }
}

// prepare from JSON-lines records (data/records.h, data/prepare.h): one
// document each, encoded on --threads threads (the result does not depend on
// how many).
int prepare_records(const PrepareArgs& args) {
  data::RecordOptions o;
  o.add_special_tokens = args.add_special_tokens;
  o.chat_template = args.chat_template;
  o.tokenizer = args.tokenizer;
  set_fields(args.fields, o);
  const int threads = args.threads > 0 ? args.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  data::PrepareStats stats;
  // On a terminal, a line that counts up while the threads encode.
  const auto start = std::chrono::steady_clock::now();
  data::PrepareProgress bar;
  if (::isatty(STDERR_FILENO))
    bar = [start](std::size_t done, std::size_t total) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::fprintf(stderr, "\rprepare: encoded %.1f of %.1f MB (%3.0f%%, %.2f MB/s)%s", done / 1e6, total / 1e6,
                   100.0 * static_cast<double>(done) / static_cast<double>(std::max<std::size_t>(total, 1)),
                   done / 1e6 / std::max(s, 1e-9), done == total ? "\n" : "");
    };
  const data::TokenRecords records = data::encode_jsonl(args.inputs, o, threads, &stats, bar);
  const data::Tokenizer tokenizer(args.tokenizer);
  const uint32_t vocab = tokenizer.vocab_size();
  std::string shards;
  if (args.shard_tokens > 0)
    shards = ", " + std::to_string(data::write_token_shards(args.output, records, vocab,
                                                            static_cast<uint64_t>(args.shard_tokens))) +
             " shards and index.json";
  else
    data::write_token_file(args.output, records, vocab);
  std::size_t targets = 0;
  for (uint8_t t : records.target) targets += t;
  std::printf("prepare: %zu file(s), %zu %s records -> %zu tokens, %zu of them targets (vocab %u, tokenizer %s) in %s\n",
              stats.files, records.documents(), data::record_kind_name(records.kind), records.tokens.size(), targets,
              vocab, tokenizer.describe().c_str(), (args.output + shards).c_str());
  std::printf("prepare: %.1f MB of JSONL encoded in %.2f s on %d thread(s): %.2f MB/s (reading %.2f s)\n",
              static_cast<double>(stats.bytes) / 1e6, stats.encode_s, stats.threads,
              static_cast<double>(stats.bytes) / 1e6 / std::max(stats.encode_s, 1e-9), stats.read_s);
  return 0;
}

int run_prepare(const PrepareArgs& args) {
  std::size_t jsonl = 0;
  for (const auto& path : args.inputs) jsonl += data::is_jsonl_path(path) ? 1 : 0;
  if (jsonl > 0 && jsonl != args.inputs.size())
    throw UsageError("prepare: give either text files or JSONL records (*.jsonl, *.jsonl.gz, *.jsonl.zst, "
                     "directories), not both");
  if (jsonl > 0) return prepare_records(args);
  if (!args.chat_template.empty() || !args.fields.empty() || args.threads != 0 || args.shard_tokens != 0)
    throw UsageError("prepare: --chat-template, --field, --threads and --shard-tokens apply to JSONL records; the "
                     "inputs are text files");
  // Check every input before reading any, so a typo in the last of many large
  // files fails in milliseconds instead of after reading the rest.
  for (const auto& path : args.inputs) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      throw UsageError("prepare: input " + path + ": " + std::strerror(errno));
    }
  }
  if (!args.tokenizer.empty()) return prepare_with(args, data::Tokenizer(args.tokenizer));
  if (args.add_special_tokens) throw UsageError("prepare: --add-special-tokens needs --tokenizer");
  const data::ByteTokenizer tokenizer;
  std::vector<uint16_t> tokens;
  uint64_t total_bytes = 0;
  for (const auto& path : args.inputs) {
    const std::string bytes = read_bytes(path);
    total_bytes += bytes.size();
    tokenizer.encode_append(bytes, tokens);
  }
  data::write_token_file(args.output, tokens, tokenizer.vocab_size());
  std::printf("prepare: %zu file(s), %llu bytes -> %zu tokens (vocab %u) in %s\n",
              args.inputs.size(), static_cast<unsigned long long>(total_bytes), tokens.size(),
              tokenizer.vocab_size(), args.output.c_str());
  return 0;
}

int run_plot(const PlotArgs& args) {
  PlotOptions options;
  if (args.timeline) {
    if (args.metrics.size() != 1 || !args.labels.empty())
      throw UsageError("plot --timeline draws one trace file (no --labels)");
    options.title = args.title.empty() ? args.metrics.front() : args.title;
    options.width = 1400;
    plot_timeline(args.metrics.front(), args.output, options);
    std::printf("plot: wrote %s\n", args.output.c_str());
    return 0;
  }
  if (args.metrics.size() == 1 && args.labels.empty()) {
    options.title = args.title.empty() ? args.metrics.front() : args.title;
    plot_metrics(args.metrics.front(), args.output, options);
  } else {
    options.title = args.title;
    plot_runs(args.metrics, args.labels, args.output, options);
  }
  std::printf("plot: wrote %s\n", args.output.c_str());
  return 0;
}

}  // namespace

void add_prepare(CLI::App& app, Runner& run) {
  // Argument storage must outlive this function (CLI11 writes into it during
  // parse), so it is shared with the callbacks.
  auto args = std::make_shared<PrepareArgs>();
  CLI::App* sub = app.add_subcommand(
      "prepare", "Encode text files or JSONL records (bytes, or a tokenizer.json) into one token file");
  sub->add_option("inputs", args->inputs,
                  "Text files, concatenated in order; or JSONL record files / directories of them")
      ->required();
  sub->add_option("-o,--output", args->output, "Token file to write")->required();
  sub->add_option("--tokenizer", args->tokenizer,
                  "Hugging Face tokenizer.json, or a directory with one (or with encoder.json + vocab.bpe); "
                  "default: bytes");
  sub->add_flag("--add-special-tokens", args->add_special_tokens,
                "Text files: add the tokenizer's BOS/EOS (its post-processor) around each file; JSONL text and "
                "prompt/completion records: the BOS of tokenizer_config.json before each record");
  sub->add_option("--chat-template", args->chat_template,
                  "JSONL messages: a Jinja chat template file (default: the tokenizer directory's "
                  "tokenizer_config.json chat_template)");
  sub->add_option("--threads", args->threads,
                  "JSONL: threads that encode records (default: one per core; the output is the same for any)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--shard-tokens", args->shard_tokens,
                  "JSONL: write -o as a directory of token files of about N tokens each (whole records) and an "
                  "index.json, which train's data.path takes")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50));
  sub->add_option("--field", args->fields,
                  "JSONL: KIND=NAME reads field NAME for KIND (text, prompt, completion, messages); repeatable");
  sub->callback([&run, args] { run = [args] { return run_prepare(*args); }; });
}

void add_plot(CLI::App& app, Runner& run) {
  auto args = std::make_shared<PlotArgs>();
  CLI::App* sub =
      app.add_subcommand("plot", "Plot a metrics log's curves against step, or compare several runs' logs");
  sub->add_option("metrics", args->metrics, "Metrics file(s) (JSON lines); several are drawn on one picture")
      ->required();
  sub->add_option("--labels", args->labels, "Legend names, one per metrics file (default: the file names)")
      ->delimiter(',');
  sub->add_option("-o,--output", args->output, "SVG to write")->capture_default_str();
  sub->add_option("--title", args->title, "Heading (default: the metrics path)");
  sub->add_flag("--timeline", args->timeline,
                "The file is a Chrome trace (metrics.trace_steps): draw each rank's compute and comm lanes");
  sub->callback([&run, args] { run = [args] { return run_plot(*args); }; });
}

}  // namespace scaletrain::cli

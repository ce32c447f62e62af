// JSONL records to documents on several threads (prepare.h).
#include "scaletrain/data/prepare.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <exception>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "scaletrain/util/error.h"
#include "scaletrain/util/json.h"

namespace scaletrain::data {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Line {
  std::size_t file = 0;  // index into the file list
  int64_t number = 0;    // 1-based
  std::string_view text;
};

// The non-blank lines of every file, in order (views into `texts`).
std::vector<Line> split_lines(const std::vector<std::string>& texts) {
  std::vector<Line> lines;
  for (std::size_t f = 0; f < texts.size(); ++f) {
    const std::string_view text = texts[f];
    std::size_t at = 0;
    for (int64_t number = 1; at < text.size(); ++number) {
      std::size_t end = text.find('\n', at);
      if (end == std::string_view::npos) end = text.size();
      std::string_view row = text.substr(at, end - at);
      at = end + 1;
      if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
      if (row.find_first_not_of(" \t") != std::string_view::npos) lines.push_back({f, number, row});
    }
  }
  return lines;
}

// One thread's run of lines, encoded; or the first error in it.
struct Part {
  TokenRecords records;
  std::string first_where;              // where its first record came from
  std::optional<std::string> error;     // a UsageError's message
  std::exception_ptr failure;           // anything else
};

void encode_run(const std::vector<std::string>& files, const std::vector<Line>& lines, std::size_t begin,
                std::size_t end, const RecordOptions& options, Part& part, std::atomic<std::size_t>& done) {
  try {
    Tokenizer tokenizer(options.tokenizer);
    RecordEncoder encoder(tokenizer, options);
    for (std::size_t i = begin; i < end; ++i) {
      const std::string where = files[lines[i].file] + ":" + std::to_string(lines[i].number);
      const auto record = util::parse_json_as<nlohmann::ordered_json>(std::string(lines[i].text), where);
      if (!record.is_object()) throw UsageError(where + ": a record must be a JSON object");
      if (i == begin) part.first_where = where;
      encoder.add(record, where, part.records);
      done.fetch_add(lines[i].text.size() + 1, std::memory_order_relaxed);
    }
  } catch (const UsageError& e) {
    part.error = e.what();
  } catch (...) {
    part.failure = std::current_exception();
  }
}

// [begin, end) of each of `n` runs of about equal bytes.
std::vector<std::pair<std::size_t, std::size_t>> runs(const std::vector<Line>& lines, int n) {
  std::size_t total = 0;
  for (const auto& l : lines) total += l.text.size() + 1;
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t begin = 0, bytes = 0;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    bytes += lines[i].text.size() + 1;
    const std::size_t goal = total * (out.size() + 1) / static_cast<std::size_t>(n);
    if (bytes >= goal && static_cast<int>(out.size()) < n - 1) {
      out.emplace_back(begin, i + 1);
      begin = i + 1;
    }
  }
  out.emplace_back(begin, lines.size());
  return out;
}

// Joins the parts in order, as one encoder would have built them; the first
// problem in input order is thrown, as one thread would have met it (a part's
// first record, if it is of another kind, comes before any error inside it).
TokenRecords join(std::vector<Part>& parts) {
  TokenRecords out;
  bool first = true;
  for (Part& p : parts) {
    if (p.records.documents() == 0) {
      if (p.failure) std::rethrow_exception(p.failure);
      if (p.error) throw UsageError(*p.error);
      continue;
    }
    if (!first && p.records.kind != out.kind)  // the part's first record is the first of another kind
      throw UsageError(p.first_where + ": a " + record_kind_name(p.records.kind) + " record among " +
                       record_kind_name(out.kind) + " records (one kind per dataset)");
    if (p.failure) std::rethrow_exception(p.failure);
    if (p.error) throw UsageError(*p.error);
    if (first) {
      out = std::move(p.records);
      first = false;
      continue;
    }
    const uint64_t base = out.tokens.size();
    out.tokens.insert(out.tokens.end(), p.records.tokens.begin(), p.records.tokens.end());
    out.target.insert(out.target.end(), p.records.target.begin(), p.records.target.end());
    for (std::size_t d = 1; d < p.records.doc_offsets.size(); ++d) out.doc_offsets.push_back(base + p.records.doc_offsets[d]);
    p.records = TokenRecords{};
  }
  return out;
}

}  // namespace

namespace {

// Calls progress every 0.2 s from its own thread until stopped (RAII).
class ProgressReporter {
 public:
  ProgressReporter(const PrepareProgress& progress, const std::atomic<std::size_t>& done, std::size_t total)
      : progress_(progress), done_(done), total_(total) {
    if (progress_) thread_ = std::thread([this] { loop(); });
  }
  ~ProgressReporter() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(200), [this] { return stop_; }))
      progress_(done_.load(std::memory_order_relaxed), total_);
  }
  const PrepareProgress& progress_;
  const std::atomic<std::size_t>& done_;
  const std::size_t total_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

TokenRecords encode_jsonl(const std::vector<std::string>& inputs, const RecordOptions& options, int threads,
                          PrepareStats* stats, const PrepareProgress& progress) {
  if (threads < 1) throw UsageError("prepare: --threads must be at least 1, got " + std::to_string(threads));
  const auto t_read = Clock::now();
  const std::vector<std::string> files = jsonl_inputs(inputs);
  std::vector<std::string> texts;
  std::size_t bytes = 0;
  for (const auto& f : files) {
    texts.push_back(read_input(f));
    bytes += texts.back().size();
  }
  const std::vector<Line> lines = split_lines(texts);
  const double read_s = seconds_since(t_read);
  if (lines.empty()) throw UsageError("prepare: the inputs hold no records");
  const auto t_encode = Clock::now();
  const int n = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads), lines.size()));
  const auto cuts = runs(lines, n);
  std::vector<Part> parts(cuts.size());
  std::atomic<std::size_t> done{0};
  std::size_t total = 0;
  for (const auto& l : lines) total += l.text.size() + 1;
  {
    ProgressReporter reporter(progress, done, total);
    std::vector<std::thread> workers;
    for (std::size_t j = 1; j < cuts.size(); ++j)
      workers.emplace_back(encode_run, std::cref(files), std::cref(lines), cuts[j].first, cuts[j].second,
                           std::cref(options), std::ref(parts[j]), std::ref(done));
    encode_run(files, lines, cuts[0].first, cuts[0].second, options, parts[0], done);
    for (auto& w : workers) w.join();
  }
  TokenRecords out = join(parts);
  if (progress) progress(total, total);
  if (stats) *stats = PrepareStats{files.size(), bytes, read_s, seconds_since(t_encode), n};
  return out;
}

}  // namespace scaletrain::data

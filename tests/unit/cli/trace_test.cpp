// Traces of chosen steps (metrics.trace_steps) and the communication summary,
// through the real CLI on launched ranks: the files are Chrome traces (the
// fields, per-thread order and nesting viewers need), every rank's spans are
// there, and the collectives they hold are exactly what the engines must
// send for the model's shapes (computed here from the architecture, not read
// from the engine): one all-reduce per DDP bucket, ZeRO-3's gathers and
// reduce-scatters per unit, a pipeline's activation sends per micro-batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "cli_util.h"
#include "scaletrain/config/config.h"

namespace scaletrain::test {
namespace trace_test {

using nlohmann::json;

// The 2-layer, 32-wide GPT-2 of small_train_config (vocabulary 256, context
// 32, MLP 4x, biases, head tied to the token embedding): its parameters'
// element counts, by tensor and by sharded unit.
const std::vector<int64_t>& parameter_numels() {
  static const std::vector<int64_t> v = [] {
    const int64_t C = 32, V = 256, T = 32;
    std::vector<int64_t> n{V * C, T * C};  // wte, wpe
    for (int b = 0; b < 2; ++b)
      for (int64_t x : {C, C, C * 3 * C, 3 * C, C * C, C, C, C, C * 4 * C, 4 * C, 4 * C * C, C}) n.push_back(x);
    n.push_back(C);  // ln_f
    n.push_back(C);
    return n;
  }();
  return v;
}
int64_t total_numel() {
  int64_t t = 0;
  for (int64_t x : parameter_numels()) t += x;
  return t;
}
constexpr int64_t kBlockNumel = 12704;                   // one block's parameters
constexpr int64_t kRootNumel = 256 * 32 + 32 * 32 + 64;  // embeddings and the final norm

json read_json(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  return json::parse(in);
}

// Runs the small config on `nproc` ranks with `flags`, tracing steps 2-3 into
// `name`_trace; returns the metrics path.
fs::path traced_run(const std::string& name, int nproc, const std::string& flags) {
  const fs::path metrics = scratch() / (name + ".jsonl"), dir = scratch() / (name + "_trace"),
                 logs = scratch() / (name + "_logs");
  fs::remove(metrics);
  fs::remove_all(dir);
  fs::remove_all(logs);
  const Run r =
      run("launch --nproc-per-node " + std::to_string(nproc) + " --threads 1 --timeout 120 --log-dir " + logs.string() +
          " -- " + SCALETRAIN_BIN + " train " + small_train_config("trace.yaml", 0).string() + " " + flags +
          " --metrics.path=" + metrics.string() + " --metrics.trace_steps=2,3 --metrics.trace_dir=" + dir.string());
  EXPECT_EQ(r.code, 0) << name << ": " << r.err;
  return metrics;
}

// Checks what every Chrome trace viewer relies on, and returns the complete events.
std::vector<json> check_chrome_trace(const json& t, const std::vector<int>& ranks) {
  std::vector<json> spans;
  EXPECT_TRUE(t.is_object() && t.contains("traceEvents") && t["traceEvents"].is_array());
  std::set<int> named_processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> by_thread;
  for (const auto& e : t["traceEvents"]) {
    for (const char* key : {"name", "ph", "pid", "tid"}) EXPECT_TRUE(e.contains(key)) << key << " missing: " << e;
    const std::string ph = e["ph"];
    if (ph == "M") {
      if (e["name"] == "process_name") named_processes.insert(e["pid"].get<int>());
      if (e["name"] == "thread_name")
        threads[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"].get<std::string>();
      continue;
    }
    EXPECT_EQ(ph, "X") << e;
    EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e.contains("cat")) << e;
    EXPECT_GE(e["dur"].get<double>(), 0) << e;
    by_thread[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back({e["ts"].get<double>(), e["dur"].get<double>()});
    spans.push_back(e);
  }
  for (int r : ranks) EXPECT_TRUE(named_processes.count(r)) << "rank " << r << " has no process_name";
  for (const auto& [key, list] : by_thread) {
    EXPECT_TRUE(threads.count(key)) << "thread " << key.second << " of rank " << key.first << " is not named";
    // Monotonic timestamps, and every span either inside the open one or after it.
    std::vector<double> open;
    double last = -1e300;
    for (const auto& [ts, dur] : list) {
      EXPECT_GE(ts, last) << "timestamps go back on rank " << key.first << " thread " << key.second;
      last = ts;
      while (!open.empty() && ts >= open.back() - 1e-6) open.pop_back();
      if (!open.empty())
        EXPECT_LE(ts + dur, open.back() + 1e-3)
            << "a span on rank " << key.first << " thread " << key.second << " overlaps its parent's end";
      open.push_back(ts + dur);
    }
  }
  return spans;
}

std::vector<json> of_rank(const std::vector<json>& spans, int rank, const std::string& cat) {
  std::vector<json> out;
  for (const auto& e : spans)
    if (e["pid"] == rank && (cat.empty() || e["cat"] == cat)) out.push_back(e);
  return out;
}

std::multiset<int64_t> comm_bytes(const std::vector<json>& spans, int rank, const std::string& op,
                                  int64_t min_bytes = 0) {
  std::multiset<int64_t> out;
  for (const auto& e : of_rank(spans, rank, "comm"))
    if (e["args"]["op"] == op && e["args"]["bytes"].get<int64_t>() >= min_bytes)
      out.insert(e["args"]["bytes"].get<int64_t>());
  return out;
}

bool has_span(const std::vector<json>& spans, int rank, const std::string& name) {
  for (const auto& e : of_rank(spans, rank, ""))
    if (e["name"] == name) return true;
  return false;
}

// The {"record": "comm"} line: per rank, the (group, op) rows.
json comm_record(const fs::path& metrics) {
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = json::parse(line);
    if (j.value("record", "") == "comm") return j;
  }
  ADD_FAILURE() << "no comm record in " << metrics;
  return json::object();
}

json summary_row(const json& record, int rank, const std::string& op, const std::string& group_prefix = "") {
  for (const auto& r : record["ranks"])
    if (r["rank"] == rank)
      for (const auto& row : r["rows"])
        if (row["op"] == op && row["group"].get<std::string>().rfind(group_prefix, 0) == 0) return row;
  ADD_FAILURE() << "no " << op << " row for rank " << rank;
  return json::object();
}

// DDP with a bucket per parameter (caps far below any parameter): each traced
// step all-reduces every parameter's gradient once, in the last micro-batch's
// backward, bytes = 4 x its elements.
TEST(Tracing, DdpTraceHoldsEveryRankAndOneAllReducePerBucket) {
  const fs::path metrics =
      traced_run("ddp", 2,
                 "--parallel.strategy=ddp --parallel.bucket_cap_mb=0.0001 --parallel.first_bucket_mb=0.0001 "
                 "--parallel.last_bucket_mb=0.0001");
  const fs::path dir = scratch() / "ddp_trace";
  const json merged = read_json(dir / "trace.json");
  const std::vector<json> spans = check_chrome_trace(merged, {0, 1});
  EXPECT_EQ(merged["otherData"]["steps"], json({2, 3}));
  ASSERT_EQ(merged["otherData"]["clocks"].size(), 2u);
  for (const auto& c : merged["otherData"]["clocks"]) {
    EXPECT_GE(c["error_us"].get<double>(), 0);
    EXPECT_LT(std::abs(c["offset_us"].get<double>()), 1e6) << "one host, one monotonic clock";
  }
  std::multiset<int64_t> expected;  // two steps of one bucket per parameter
  for (int step = 0; step < 2; ++step)
    for (int64_t n : parameter_numels()) expected.insert(4 * n);
  for (int rank = 0; rank < 2; ++rank) {
    // Each rank's own file holds that rank's events only.
    const std::vector<json> own =
        check_chrome_trace(read_json(dir / ("rank" + std::to_string(rank) + ".json")), {rank});
    EXPECT_EQ(own.size(), of_rank(spans, rank, "").size()) << rank;
    for (const char* name : {"step 2", "step 3", "forward micro-batch 0", "forward micro-batch 1",
                             "backward micro-batch 1", "forward block 0", "forward block 1", "backward block 0",
                             "backward block 1", "clip and optimizer step", "load micro-batch 0"})
      EXPECT_TRUE(has_span(spans, rank, name)) << name << " missing on rank " << rank;
    EXPECT_FALSE(has_span(spans, rank, "step 1")) << "step 1 was not asked for";
    EXPECT_FALSE(has_span(spans, rank, "step 4")) << "step 4 was not asked for";
    // Scalars (the loss, the gradient norm) are all-reduced too; buckets are the larger ones.
    EXPECT_EQ(comm_bytes(spans, rank, "all_reduce", 64), expected) << "rank " << rank;
    // Every collective has its wait on the compute thread.
    EXPECT_EQ(of_rank(spans, rank, "wait").size(), of_rank(spans, rank, "comm").size());
  }
  // The summary counts every step's collectives, the same ones.
  const json rec = comm_record(metrics);
  EXPECT_EQ(rec["steps"], 6);
  ASSERT_EQ(rec["ranks"].size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const json row = summary_row(rec, rank, "all_reduce");
    const int64_t per_step_small =
        static_cast<int64_t>(of_rank(spans, rank, "comm").size() - comm_bytes(spans, rank, "all_reduce", 64).size()) /
        2;
    EXPECT_EQ(row["count"].get<int64_t>(), 6 * (static_cast<int64_t>(parameter_numels().size()) + per_step_small));
    EXPECT_GE(row["bytes"].get<int64_t>(), 6 * 4 * total_numel());
    EXPECT_LE(row["bytes"].get<int64_t>(), 6 * 4 * total_numel() + 6 * per_step_small * 8);
    EXPECT_DOUBLE_EQ(row["bus_bytes"].get<double>(), row["bytes"].get<double>());  // 2(n-1)/n = 1 on 2 ranks
    EXPECT_GT(row["seconds"].get<double>(), 0);
    EXPECT_EQ(row["timed"], row["count"]) << "Gloo reports every all-reduce's completion";
  }

  // The timeline: one lane per rank and thread, one box per span; it renders.
  const fs::path svg = scratch() / "ddp_timeline.svg", png = scratch() / "ddp_timeline.png";
  const test::Run plot = run("plot --timeline " + (dir / "trace.json").string() + " -o " + svg.string());
  ASSERT_EQ(plot.code, 0) << plot.err;
  std::ifstream in(svg);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  auto count = [&](const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  std::set<std::pair<int, int>> lanes;
  for (const auto& e : spans) lanes.insert({e["pid"].get<int>(), e["tid"].get<int>()});
  EXPECT_EQ(count("<g class=\"lane\""), lanes.size());
  EXPECT_EQ(count("<rect class=\"span\""), spans.size());
  for (const char* label : {">rank 0 compute<", ">rank 1 compute<", ">rank 0 comm 0<", ">rank 1 comm 0<"})
    EXPECT_EQ(count(label), 1u) << label;
  EXPECT_EQ(std::system(("rsvg-convert " + svg.string() + " -o " + png.string()).c_str()), 0);
  EXPECT_GT(fs::file_size(png), 1000u);
}

// ZeRO-3 on 2 ranks, 2 micro-batches a step: every micro-batch gathers the
// root and both block units in forward and the two blocks again before their
// backward, and reduce-scatters all three units (no no_sync under ZeRO-3).
TEST(Tracing, ZeroThreeGathersAndReduceScattersEveryUnit) {
  const fs::path metrics = traced_run("zero3", 2, "--parallel.strategy=zero3");
  const std::vector<json> spans = check_chrome_trace(read_json(scratch() / "zero3_trace" / "trace.json"), {0, 1});
  std::multiset<int64_t> gathers, reduces;
  for (int micro = 0; micro < 2 * 2; ++micro) {  // 2 steps x 2 micro-batches
    for (int64_t n : {kRootNumel, kBlockNumel, kBlockNumel, kBlockNumel, kBlockNumel}) gathers.insert(4 * n);
    for (int64_t n : {kRootNumel, kBlockNumel, kBlockNumel}) reduces.insert(4 * n);
  }
  ASSERT_EQ(kRootNumel + 2 * kBlockNumel, total_numel());
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(comm_bytes(spans, rank, "all_gather"), gathers) << "rank " << rank;
    EXPECT_EQ(comm_bytes(spans, rank, "reduce_scatter"), reduces) << "rank " << rank;
  }
  const json rec = comm_record(metrics);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(summary_row(rec, rank, "all_gather")["count"], 6 * 2 * 5);
    EXPECT_EQ(summary_row(rec, rank, "all_gather")["bytes"], 6 * 2 * 4 * (kRootNumel + 4 * kBlockNumel));
    EXPECT_EQ(summary_row(rec, rank, "reduce_scatter")["count"], 6 * 2 * 3);
    EXPECT_EQ(summary_row(rec, rank, "reduce_scatter")["bytes"], 6 * 2 * 4 * total_numel());
    EXPECT_DOUBLE_EQ(summary_row(rec, rank, "reduce_scatter")["bus_bytes"].get<double>(),
                     0.5 * summary_row(rec, rank, "reduce_scatter")["bytes"].get<double>());
  }
}

// A 2-stage 1F1B pipeline over 4 micro-batches: stage 0 sends each
// micro-batch's activations [2, 32, 32] and receives their gradients, stage 1
// the reverse; the summary has the measured bubble beside (p-1)/(m+p-1) = 0.2.
TEST(Tracing, PipelineSendsPerMicroBatchAndReportsItsBubble) {
  const fs::path metrics = traced_run("pp", 2, "--parallel.pp=2 --parallel.microbatches=4 --parallel.schedule=1f1b");
  const std::vector<json> spans = check_chrome_trace(read_json(scratch() / "pp_trace" / "trace.json"), {0, 1});
  const int64_t act = 2 * 32 * 32 * 4;
  const std::multiset<int64_t> eight({act, act, act, act, act, act, act, act});  // 2 steps x 4 micro-batches
  for (int rank = 0; rank < 2; ++rank) {
    std::multiset<int64_t> sends, recvs;
    for (int64_t b : comm_bytes(spans, rank, "send"))
      if (b == act) sends.insert(b);
    for (int64_t b : comm_bytes(spans, rank, "recv"))
      if (b == act) recvs.insert(b);
    EXPECT_EQ(sends, eight) << "rank " << rank;
    EXPECT_EQ(recvs, eight) << "rank " << rank;
    for (const char* name : {"forward micro-batch 3", "backward micro-batch 3"})
      EXPECT_TRUE(has_span(spans, rank, name)) << name << " missing on rank " << rank;
    // Gloo's send and recv report no completion: no bandwidth is claimed for them.
    for (const auto& e : of_rank(spans, rank, "comm"))
      if (e["args"]["op"] == "send" || e["args"]["op"] == "recv") {
        EXPECT_FALSE(e["args"].contains("busbw_GBps")) << e;
        EXPECT_TRUE(e["args"].contains("completion")) << e;
      }
  }
  const json rec = comm_record(metrics);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(summary_row(rec, rank, "send")["timed"], 0);
    EXPECT_EQ(summary_row(rec, rank, "send")["seconds"], 0.0);
  }
  for (const auto& r : rec["ranks"]) {
    ASSERT_TRUE(r.contains("pipeline_bubble")) << r;
    EXPECT_DOUBLE_EQ(r["pipeline_bubble"]["expected"].get<double>(), 0.2);
    const double measured = r["pipeline_bubble"]["measured"].get<double>();
    EXPECT_GT(measured, 0);
    EXPECT_LT(measured, 1);
  }
}

TEST(Tracing, StepsComeAsAYamlListOrOneStep) {
  const std::string data = "data:\n  path: " + tokens().string() + "\n";
  const auto list = config::load_config(write("trace_list.yaml", data + "metrics:\n  trace_steps: [2, 5]\n").string());
  EXPECT_EQ(list.metrics.trace_steps, (std::vector<int64_t>{2, 5}));
  const auto one = config::load_config(write("trace_one.yaml", data + "metrics:\n  trace_steps: 4\n").string());
  EXPECT_EQ(one.metrics.trace_steps, (std::vector<int64_t>{4, 4}));
  EXPECT_TRUE(config::load_config(write("trace_none.yaml", data).string()).metrics.trace_steps.empty());
}

TEST(Tracing, BadSettingsAndFilesAreOneLineErrors) {
  const std::string cfg = small_train_config("trace_bad.yaml", 0).string();
  for (const char* bad : {"--metrics.trace_steps=3,2", "--metrics.trace_steps=0", "--metrics.trace_steps=7",
                          "--metrics.trace_steps=a", "--metrics.trace_steps=1,2,3"}) {
    const test::Run r = run("train " + cfg + " " + bad);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("metrics.trace_steps"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  const fs::path not_json = write("not_a_trace.json", "{ this is not json");
  const fs::path no_events = write("no_events.json", "{\"traceEvents\": []}");
  const fs::path other = write("other.json", "{\"steps\": 3}");
  for (const fs::path& p : {not_json, no_events, other, scratch() / "missing.json"}) {
    const test::Run r = run("plot --timeline " + p.string() + " -o " + (scratch() / "bad.svg").string());
    EXPECT_EQ(r.code, 2) << p << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace trace_test
}  // namespace scaletrain::test

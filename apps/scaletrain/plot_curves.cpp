// `scaletrain plot METRICS.jsonl`: reading the trainer's JSON-lines metrics
// log (read_metrics, plot.h) and drawing its curves (render_svg: loss and
// tokens/s against step, and each expert's share of the slots for an MoE
// model), with restarts marked where the resumed run went on.
#include "plot.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scaletrain/util/error.h"
#include "svg.h"

namespace scaletrain::cli {
namespace {

using svg::draw_panel;
using svg::kNaN;
using svg::open_svg;
using svg::Series;
using svg::write_svg;

[[noreturn]] void fail_line(const std::string& path, int64_t line, const std::string& problem) {
  throw UsageError("metrics file " + path + " line " + std::to_string(line) + ": " + problem);
}

// Reads key `key` of `obj` as a double: NaN if absent (when optional) or null.
double number_field(const nlohmann::json& obj, const char* key, bool required, const std::string& path, int64_t line) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) fail_line(path, line, std::string("missing key \"") + key + "\"");
    return kNaN;
  }
  if (it->is_null()) return kNaN;
  if (!it->is_number()) {
    fail_line(path, line, std::string("key \"") + key + "\" is not a number: " + it->dump());
  }
  return it->get<double>();
}

MetricsRecord parse_record(const std::string& text, const std::string& path, int64_t line) {
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail_line(path, line, "invalid JSON near byte " + std::to_string(e.byte));
  }
  if (!obj.is_object()) fail_line(path, line, "expected a JSON object, got " + obj.dump());

  const auto step_it = obj.find("step");
  if (step_it == obj.end()) fail_line(path, line, "missing key \"step\"");
  // Accept 12 and 12.0 (some writers emit every number as a float), but not
  // 12.5: a fractional step means the line is not what we think it is.
  if (!step_it->is_number() || step_it->get<double>() != std::floor(step_it->get<double>()) ||
      std::fabs(step_it->get<double>()) > 9e18) {
    fail_line(path, line, "key \"step\" is not an integer: " + step_it->dump());
  }
  MetricsRecord r;
  r.step = step_it->is_number_integer() ? step_it->get<int64_t>() : static_cast<int64_t>(step_it->get<double>());
  r.loss = number_field(obj, "loss", true, path, line);
  r.samples_per_s = number_field(obj, "samples_per_s", false, path, line);
  r.tokens_per_s = number_field(obj, "tokens_per_s", !obj.contains("samples_per_s"), path, line);
  r.lr = number_field(obj, "lr", false, path, line);
  r.step_ms = number_field(obj, "step_ms", false, path, line);
  r.mfu = number_field(obj, "mfu", false, path, line);
  r.peak_rss_mb = number_field(obj, "peak_rss_mb", false, path, line);
  r.comm_wait_ms = number_field(obj, "comm_wait_ms", false, path, line);
  r.grad_norm = number_field(obj, "grad_norm", false, path, line);
  r.loss_scale = number_field(obj, "loss_scale", false, path, line);
  if (const auto it = obj.find("moe_tokens_per_expert"); it != obj.end()) {
    if (!it->is_array()) fail_line(path, line, "key \"moe_tokens_per_expert\" is not an array: " + it->dump());
    for (const auto& v : *it) {
      if (!v.is_number()) fail_line(path, line, "key \"moe_tokens_per_expert\" holds a non-number: " + v.dump());
      r.moe_tokens_per_expert.push_back(v.get<double>());
    }
  }
  return r;
}

// Lines that are not steps name their kind: {"record": "memory", ...}. A
// restart record is kept (as `restart`); others are skipped.
bool other_record(const std::string& text, MetricsRecord& restart) {
  if (text.find("\"record\"") == std::string::npos) return false;
  const auto obj = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!obj.is_object() || !obj.contains("record")) return false;
  if (obj["record"] == "restart" && obj.value("resumed_from_step", nlohmann::json()).is_number_integer()) {
    restart = MetricsRecord{};
    restart.step = obj["resumed_from_step"].get<int64_t>();
    restart.restart = std::max(1, obj.value("attempt", 1));
  }
  return true;
}

}  // namespace

std::vector<MetricsRecord> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("metrics file " + path + ": cannot open (missing or unreadable)");
  std::vector<MetricsRecord> out;
  std::string text;
  int64_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (!text.empty() && text.back() == '\r') text.pop_back();  // CRLF logs
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    MetricsRecord restart;
    if (other_record(text, restart)) {
      if (restart.restart > 0) out.push_back(restart);
      continue;
    }
    out.push_back(parse_record(text, path, line));
  }
  if (in.bad()) throw UsageError("metrics file " + path + ": read error");
  return out;
}

std::string render_svg(const std::vector<MetricsRecord>& records, const PlotOptions& options) {
  // Last record per step wins (steps re-run after a restart), and std::map
  // orders by step. Restarts are vertical marks at the step resumed from.
  std::map<int64_t, const MetricsRecord*> by_step;
  std::vector<double> restarts;
  for (const auto& r : records) {
    if (r.restart > 0)
      restarts.push_back(static_cast<double>(r.step));
    else
      by_step[r.step] = &r;
  }
  Series loss, tput;
  size_t experts = 0;
  // A run that counts no tokens (a user's module) is drawn in samples/s.
  bool tokens = false;
  for (const auto& [step, r] : by_step) tokens = tokens || !std::isnan(r->tokens_per_s);
  for (const auto& [step, r] : by_step) {
    loss.x.push_back(static_cast<double>(step));
    loss.y.push_back(r->loss);
    tput.x.push_back(static_cast<double>(step));
    tput.y.push_back(tokens ? r->tokens_per_s : r->samples_per_s);
    experts = std::max(experts, r->moe_tokens_per_expert.size());
  }
  // MoE: each expert's share of the step's slots.
  std::vector<Series> shares(experts);
  for (const auto& [step, r] : by_step) {
    double total = 0;
    for (double v : r->moe_tokens_per_expert) total += v;
    for (size_t e = 0; e < experts; ++e) {
      shares[e].x.push_back(static_cast<double>(step));
      shares[e].y.push_back(e < r->moe_tokens_per_expert.size() && total > 0 ? r->moe_tokens_per_expert[e] / total
                                                                             : kNaN);
    }
  }

  const double width = std::max(options.width, 200);
  const double panel = std::max(options.panel_height, 120);
  const double header = options.title.empty() ? 0 : 32;
  const double height = header + (experts > 0 ? 3 : 2) * panel;

  std::ostringstream svg;
  open_svg(svg, width, height, options.title);
  draw_panel(svg, {loss}, {"#1f77b4"}, "Loss", /*include_zero=*/false, 0, header, width, panel, kNaN, restarts);
  // Throughput starts at zero so a drop from 100k to 90k tokens/s looks like
  // the 10% it is, not like a collapse.
  draw_panel(svg, {tput}, {"#d62728"}, tokens ? "Throughput (tokens/s)" : "Throughput (samples/s)", /*include_zero=*/true, 0, header + panel, width, panel,
             kNaN, restarts);
  if (experts > 0)
    draw_panel(
        svg, shares,
        {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"},
        "Share of slots per expert (" + std::to_string(experts) + " experts; dashed: uniform)",
        /*include_zero=*/true, 0, header + 2 * panel, width, panel, 1.0 / static_cast<double>(experts));
  svg << "</svg>\n";
  return svg.str();
}

void plot_metrics(const std::string& metrics_path, const std::string& svg_path, const PlotOptions& options) {
  const std::vector<MetricsRecord> records = read_metrics(metrics_path);
  if (records.empty()) throw UsageError("metrics file " + metrics_path + ": no records to plot");
  write_svg(render_svg(records, options), svg_path);
}

}  // namespace scaletrain::cli

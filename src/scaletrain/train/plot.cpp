// Longer than 600 lines (issue 35): three SVG pictures (curves, comparison,
// timeline). It moves to the CLI, one file per picture, with issue 35.
#include "scaletrain/train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "scaletrain/util/error.h"

namespace scaletrain::train {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

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
  r.tokens_per_s = number_field(obj, "tokens_per_s", true, path, line);
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

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Coordinates: two decimals is sub-pixel and keeps long curves compact.
std::string coord(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

// The start of a white SVG canvas, with `title` (if any) centered on top.
void open_svg(std::ostringstream& svg, double width, double height, const std::string& title) {
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << coord(width) << "\" height=\"" << coord(height)
      << "\" viewBox=\"0 0 " << coord(width) << ' ' << coord(height) << "\" font-family=\"sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  if (!title.empty())
    svg << "<text x=\"" << coord(width / 2) << "\" y=\"22\" text-anchor=\"middle\" "
        << "font-size=\"17\" font-weight=\"bold\">" << xml_escape(title) << "</text>\n";
}

// Tick label: short, with k/M/G suffixes so "1250000 tokens/s" reads "1.25M".
std::string tick_label(double v) {
  if (std::fabs(v) < 1e-12) return "0";
  const double a = std::fabs(v);
  const char* suffix = "";
  double scaled = v;
  if (a >= 1e9) {
    scaled = v / 1e9;
    suffix = "G";
  } else if (a >= 1e6) {
    scaled = v / 1e6;
    suffix = "M";
  } else if (a >= 1e4) {
    scaled = v / 1e3;
    suffix = "k";
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g%s", scaled, suffix);
  return buf;
}

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about
// `target` intervals over `range`: the spacing people choose by hand.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double nice = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return nice * mag;
}

struct Axis {
  double lo = 0, hi = 1, step = 0.2;
};

// Expands [lo, hi] outward to tick multiples; a zero-width range (one point,
// or a flat curve) is widened first so the scale is never degenerate.
Axis make_axis(double lo, double hi, int target_ticks) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  Axis a;
  a.step = nice_step(hi - lo, target_ticks);
  a.lo = std::floor(lo / a.step) * a.step;
  a.hi = std::ceil(hi / a.step) * a.step;
  return a;
}

struct Series {
  std::vector<double> x, y;  // y may hold NaN: drawn as a gap
};

template <typename SX, typename SY>
void draw_curve(std::ostringstream& svg, const Series& s, const std::string& color, const SX& sx, const SY& sy);

// One panel: frame, grid, ticks, labels, then the curves (and a dashed guide
// line at `guide`, and a dashed vertical "restart" mark at each step of
// `marks`). (left, top) is the corner of the whole panel; the plot area sits
// inside fixed margins that leave room for the tick labels.
void draw_panel(std::ostringstream& svg, const std::vector<Series>& all, const std::vector<std::string>& colors,
                const std::string& title, bool include_zero, double left, double top, double width, double height,
                double guide = kNaN, const std::vector<double>& marks = {}) {
  constexpr double kMarginLeft = 72, kMarginRight = 24, kMarginTop = 30, kMarginBottom = 44;
  const double px0 = left + kMarginLeft, px1 = left + width - kMarginRight;
  const double py0 = top + kMarginTop, py1 = top + height - kMarginBottom;

  svg << "<text x=\"" << coord((px0 + px1) / 2) << "\" y=\"" << coord(top + 20)
      << "\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">" << xml_escape(title) << "</text>\n";

  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  double ymin = xmin, ymax = -xmin;
  for (const Series& s : all)
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      xmin = std::min(xmin, s.x[i]);
      xmax = std::max(xmax, s.x[i]);
      ymin = std::min(ymin, s.y[i]);
      ymax = std::max(ymax, s.y[i]);
    }
  const bool has_data = std::isfinite(xmin);
  if (!has_data) xmin = 0, xmax = 1, ymin = 0, ymax = 1;
  // The x range covers every record, so panels share a step scale even when
  // one series has gaps at the ends.
  for (const Series& s : all)
    if (!s.x.empty()) {
      xmin = std::min(xmin, s.x.front());
      xmax = std::max(xmax, s.x.back());
    }
  if (include_zero) ymin = std::min(ymin, 0.0);
  if (std::isfinite(guide)) ymin = std::min(ymin, guide), ymax = std::max(ymax, guide);
  const Axis ax = make_axis(xmin, xmax, 8);
  const Axis ay = make_axis(ymin, ymax, 5);
  auto sx = [&](double v) { return px0 + (v - ax.lo) / (ax.hi - ax.lo) * (px1 - px0); };
  auto sy = [&](double v) { return py1 - (v - ay.lo) / (ay.hi - ay.lo) * (py1 - py0); };

  // Grid and tick labels. Ticks are counted, not accumulated, so float drift
  // cannot add or drop the last one.
  const int nx = static_cast<int>(std::lround((ax.hi - ax.lo) / ax.step));
  for (int i = 0; i <= nx; ++i) {
    const double v = ax.lo + i * ax.step;
    const std::string x = coord(sx(v));
    svg << "<line x1=\"" << x << "\" y1=\"" << coord(py0) << "\" x2=\"" << x << "\" y2=\"" << coord(py1)
        << "\" stroke=\"#e0e0e0\"/>\n";
    svg << "<text x=\"" << x << "\" y=\"" << coord(py1 + 16) << "\" text-anchor=\"middle\" font-size=\"11\">"
        << tick_label(v) << "</text>\n";
  }
  const int ny = static_cast<int>(std::lround((ay.hi - ay.lo) / ay.step));
  for (int i = 0; i <= ny; ++i) {
    const double v = ay.lo + i * ay.step;
    const std::string y = coord(sy(v));
    svg << "<line x1=\"" << coord(px0) << "\" y1=\"" << y << "\" x2=\"" << coord(px1) << "\" y2=\"" << y
        << "\" stroke=\"#e0e0e0\"/>\n";
    svg << "<text x=\"" << coord(px0 - 6) << "\" y=\"" << coord(sy(v) + 4) << "\" text-anchor=\"end\" font-size=\"11\">"
        << tick_label(v) << "</text>\n";
  }
  svg << "<rect x=\"" << coord(px0) << "\" y=\"" << coord(py0) << "\" width=\"" << coord(px1 - px0) << "\" height=\""
      << coord(py1 - py0) << "\" fill=\"none\" stroke=\"#333\"/>\n";
  svg << "<text x=\"" << coord((px0 + px1) / 2) << "\" y=\"" << coord(py1 + 34)
      << "\" text-anchor=\"middle\" font-size=\"12\">step</text>\n";

  if (!has_data) {
    svg << "<text x=\"" << coord((px0 + px1) / 2) << "\" y=\"" << coord((py0 + py1) / 2)
        << "\" text-anchor=\"middle\" font-size=\"13\" fill=\"#888\">no data</text>\n";
    return;
  }
  if (std::isfinite(guide))
    svg << "<line x1=\"" << coord(px0) << "\" y1=\"" << coord(sy(guide)) << "\" x2=\"" << coord(px1) << "\" y2=\""
        << coord(sy(guide)) << "\" stroke=\"#555\" stroke-dasharray=\"4 3\"/>\n";
  for (double m : marks) {
    if (m < ax.lo || m > ax.hi) continue;
    svg << "<line x1=\"" << coord(sx(m)) << "\" y1=\"" << coord(py0) << "\" x2=\"" << coord(sx(m)) << "\" y2=\""
        << coord(py1) << "\" stroke=\"#ff7f0e\" stroke-dasharray=\"6 3\"/>\n"
        << "<text x=\"" << coord(sx(m) + 3) << "\" y=\"" << coord(py0 + 12) << "\" font-size=\"10\" fill=\"#ff7f0e\">"
        << "restart</text>\n";
  }
  for (std::size_t c = 0; c < all.size(); ++c) draw_curve(svg, all[c], colors[c % colors.size()], sx, sy);
}

// One polyline per run of finite points; a lone point gets a dot, since a
// one-vertex polyline draws nothing.
template <typename SX, typename SY>
void draw_curve(std::ostringstream& svg, const Series& s, const std::string& color, const SX& sx, const SY& sy) {
  std::size_t i = 0;
  while (i < s.x.size()) {
    if (!std::isfinite(s.y[i])) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < s.x.size() && std::isfinite(s.y[j])) ++j;
    if (j - i == 1) {
      svg << "<circle cx=\"" << coord(sx(s.x[i])) << "\" cy=\"" << coord(sy(s.y[i])) << "\" r=\"2\" fill=\"" << color
          << "\"/>\n";
    } else {
      svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
      for (std::size_t k = i; k < j; ++k) {
        svg << (k == i ? "" : " ") << coord(sx(s.x[k])) << ',' << coord(sy(s.y[k]));
      }
      svg << "\"/>\n";
    }
    i = j;
  }
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
  for (const auto& [step, r] : by_step) {
    loss.x.push_back(static_cast<double>(step));
    loss.y.push_back(r->loss);
    tput.x.push_back(static_cast<double>(step));
    tput.y.push_back(r->tokens_per_s);
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
  draw_panel(svg, {tput}, {"#d62728"}, "Throughput (tokens/s)", /*include_zero=*/true, 0, header + panel, width, panel,
             kNaN, restarts);
  if (experts > 0)
    draw_panel(svg, shares,
               {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
                "#17becf"},
               "Share of slots per expert (" + std::to_string(experts) + " experts; dashed: uniform)",
               /*include_zero=*/true, 0, header + 2 * panel, width, panel, 1.0 / static_cast<double>(experts));
  svg << "</svg>\n";
  return svg.str();
}

namespace {

const std::vector<std::string>& palette() {
  static const std::vector<std::string> p{"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                          "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
  return p;
}

void write_svg(const std::string& svg, const std::string& svg_path) {
  std::ofstream out(svg_path, std::ios::binary | std::ios::trunc);
  if (!out) throw UsageError("plot: cannot write " + svg_path);
  out << svg;
  out.close();
  if (!out) throw UsageError("plot: error writing " + svg_path);
}

}  // namespace

std::string render_comparison_svg(const std::vector<Run>& runs, const PlotOptions& options) {
  struct Quantity {
    const char* title;
    double MetricsRecord::*field;
    bool include_zero;
  };
  const std::vector<Quantity> quantities{
      {"Loss", &MetricsRecord::loss, false},
      {"Learning rate", &MetricsRecord::lr, true},
      {"Throughput (tokens/s)", &MetricsRecord::tokens_per_s, true},
      {"MFU", &MetricsRecord::mfu, true},
      {"Peak RSS (MiB)", &MetricsRecord::peak_rss_mb, true},
      {"Gradient norm", &MetricsRecord::grad_norm, true},
      {"Loss scale", &MetricsRecord::loss_scale, false},
  };
  const double width = std::max(options.width, 200);
  const double panel = std::max(options.panel_height, 120);
  const double title_h = options.title.empty() ? 0 : 32;
  const double legend_h = 24.0 * static_cast<double>((runs.size() + 2) / 3) + 8;
  const double header = title_h + legend_h;
  const double height = header + static_cast<double>(quantities.size()) * panel;
  std::ostringstream svg;
  open_svg(svg, width, height, options.title);
  // The legend: three runs to a row.
  std::vector<std::string> colors;
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string& color = palette()[i % palette().size()];
    colors.push_back(color);
    const double x = 72 + static_cast<double>(i % 3) * (width - 96) / 3;
    const double y = title_h + 18 + 24.0 * static_cast<double>(i / 3);
    svg << "<g class=\"legend\"><line x1=\"" << coord(x) << "\" y1=\"" << coord(y - 4) << "\" x2=\"" << coord(x + 28)
        << "\" y2=\"" << coord(y - 4) << "\" stroke=\"" << color << "\" stroke-width=\"3\"/><text x=\""
        << coord(x + 36) << "\" y=\"" << coord(y) << "\" font-size=\"13\">" << xml_escape(runs[i].label)
        << "</text></g>\n";
  }
  for (size_t q = 0; q < quantities.size(); ++q) {
    std::vector<Series> all;
    for (const auto& run : runs) {
      std::map<int64_t, const MetricsRecord*> by_step;  // last record per step wins (resumed runs)
      for (const auto& r : run.records)
        if (r.restart == 0) by_step[r.step] = &r;
      Series s;
      for (const auto& [step, r] : by_step) {
        s.x.push_back(static_cast<double>(step));
        s.y.push_back(r->*(quantities[q].field));
      }
      all.push_back(std::move(s));
    }
    draw_panel(svg, all, colors, quantities[q].title, quantities[q].include_zero, 0,
               header + static_cast<double>(q) * panel, width, panel);
  }
  svg << "</svg>\n";
  return svg.str();
}

void plot_metrics(const std::string& metrics_path, const std::string& svg_path, const PlotOptions& options) {
  const std::vector<MetricsRecord> records = read_metrics(metrics_path);
  if (records.empty()) throw UsageError("metrics file " + metrics_path + ": no records to plot");
  write_svg(render_svg(records, options), svg_path);
}

void plot_runs(const std::vector<std::string>& metrics_paths, const std::vector<std::string>& labels,
               const std::string& svg_path, const PlotOptions& options) {
  if (!labels.empty() && labels.size() != metrics_paths.size())
    throw UsageError("plot: " + std::to_string(labels.size()) + " labels for " + std::to_string(metrics_paths.size()) +
                     " metrics files (give one per file, or none)");
  std::vector<Run> runs;
  for (size_t i = 0; i < metrics_paths.size(); ++i) {
    Run r;
    r.records = read_metrics(metrics_paths[i]);
    if (r.records.empty()) throw UsageError("metrics file " + metrics_paths[i] + ": no records to plot");
    if (!labels.empty()) {
      r.label = labels[i];
    } else {
      const size_t slash = metrics_paths[i].find_last_of('/');
      r.label = slash == std::string::npos ? metrics_paths[i] : metrics_paths[i].substr(slash + 1);
    }
    runs.push_back(std::move(r));
  }
  write_svg(render_comparison_svg(runs, options), svg_path);
}

namespace {

struct Box {
  int pid = 0, tid = 0;
  std::string name, cat, op;
  double ts = 0, dur = 0;  // microseconds
  int depth = 0;           // nesting level in its lane
};

// Fill of a box: collectives by op, everything else by kind (a pipeline
// action by its direction).
std::string box_color(const Box& b) {
  static const std::map<std::string, std::string> by_cat{
      {"step", "#c8c8c8"},      {"forward", "#4e79a7"}, {"backward", "#f28e2b"},  {"optimizer", "#59a14f"},
      {"data", "#b07aa1"},      {"checkpoint", "#9c755f"}, {"wait", "#7a0019"}};
  static const std::map<std::string, std::string> by_op{
      {"all_reduce", "#e15759"}, {"all_gather", "#76b7b2"}, {"reduce_scatter", "#edc948"}, {"broadcast", "#bab0ac"},
      {"all_to_all", "#ff9da7"}, {"all_to_all_v", "#ff9da7"}, {"send", "#d4a6c8"}, {"recv", "#d4a6c8"}};
  if (b.cat == "comm") {
    auto it = by_op.find(b.op);
    return it == by_op.end() ? "#bab0ac" : it->second;
  }
  if (b.cat == "pipeline") return b.name.rfind("backward", 0) == 0 ? "#f28e2b" : "#4e79a7";
  auto it = by_cat.find(b.cat);
  return it == by_cat.end() ? "#cccccc" : it->second;
}

std::string duration_text(double us) {
  char buf[48];
  if (us >= 1000)
    std::snprintf(buf, sizeof buf, "%.3f ms", us / 1000);
  else
    std::snprintf(buf, sizeof buf, "%.1f us", us);
  return buf;
}

}  // namespace

std::string render_timeline_svg(const std::string& trace_json, const std::string& source, const PlotOptions& options) {
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(trace_json);
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("trace " + source + ": not JSON (" + std::string(e.what()) + ")");
  }
  const nlohmann::json* events = nullptr;
  if (trace.is_object() && trace.contains("traceEvents") && trace["traceEvents"].is_array())
    events = &trace["traceEvents"];
  else if (trace.is_array())
    events = &trace;  // the bare array form is a Chrome trace too
  if (!events) throw UsageError("trace " + source + ": not a Chrome trace (no traceEvents array)");
  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<std::pair<int, int>, std::vector<Box>> lanes;
  for (const auto& e : *events) {
    if (!e.is_object() || !e.contains("ph") || !e.contains("pid")) continue;
    try {
      const std::string ph = e["ph"].get<std::string>();
      const int pid = e["pid"].get<int>(), tid = e.value("tid", 0);
      if (ph == "M") {
        const std::string what = e.value("name", "");
        const std::string name = e.contains("args") ? e["args"].value("name", "") : "";
        if (what == "process_name") processes[pid] = name;
        if (what == "thread_name") threads[{pid, tid}] = name;
        continue;
      }
      if (ph != "X") continue;
      Box b;
      b.pid = pid;
      b.tid = tid;
      b.name = e.value("name", "");
      b.cat = e.value("cat", "");
      b.ts = e.at("ts").get<double>();
      b.dur = e.value("dur", 0.0);
      if (e.contains("args") && e["args"].is_object()) b.op = e["args"].value("op", "");
      lanes[{pid, tid}].push_back(std::move(b));
    } catch (const nlohmann::json::exception& ex) {
      throw UsageError("trace " + source + ": an event has a field of the wrong type (" + std::string(ex.what()) +
                       ")");
    }
  }
  if (lanes.empty()) throw UsageError("trace " + source + ": no complete (\"X\") events to draw");

  // Nesting: a box inside the one before it in its lane goes a row lower.
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  std::map<std::pair<int, int>, int> rows;
  for (auto& [key, boxes] : lanes) {
    std::stable_sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) {
      return a.ts != b.ts ? a.ts < b.ts : a.dur > b.dur;
    });
    std::vector<double> open_ends;  // ends of the boxes enclosing the current one
    int most = 1;
    for (auto& b : boxes) {
      // A box that is not inside the enclosing one is not its child.
      while (!open_ends.empty() && (b.ts >= open_ends.back() - 1e-9 || b.ts + b.dur > open_ends.back() + 1e-9))
        open_ends.pop_back();
      b.depth = static_cast<int>(open_ends.size());
      open_ends.push_back(b.ts + b.dur);
      most = std::max(most, b.depth + 1);
      t0 = std::min(t0, b.ts);
      t1 = std::max(t1, b.ts + b.dur);
    }
    rows[key] = most;
  }
  if (!(t1 > t0)) t1 = t0 + 1;

  const double width = std::max(options.width, 400);
  const double label_w = 150, right = 20, row_h = 14, lane_gap = 6;
  const double title_h = options.title.empty() ? 0 : 30;
  const double legend_h = 44, axis_h = 30;
  double lanes_h = 0;
  for (const auto& [key, n] : rows) lanes_h += n * row_h + lane_gap;
  const double top = title_h + legend_h;
  const double height = top + lanes_h + axis_h;
  const double plot_w = width - label_w - right;
  auto sx = [&](double us) { return label_w + (us - t0) / (t1 - t0) * plot_w; };

  std::ostringstream svg;
  open_svg(svg, width, height, options.title);
  // Legend: the kinds of box.
  const std::vector<std::pair<std::string, std::string>> legend{
      {"forward", "#4e79a7"},       {"backward", "#f28e2b"}, {"optimizer", "#59a14f"},   {"data", "#b07aa1"},
      {"checkpoint", "#9c755f"},    {"wait (exposed)", "#7a0019"}, {"all_reduce", "#e15759"}, {"all_gather", "#76b7b2"},
      {"reduce_scatter", "#edc948"}, {"all_to_all", "#ff9da7"}, {"send/recv", "#d4a6c8"}, {"other", "#bab0ac"}};
  for (size_t i = 0; i < legend.size(); ++i) {
    const double x = label_w + static_cast<double>(i % 6) * (plot_w / 6);
    const double y = title_h + 8 + 18.0 * static_cast<double>(i / 6);
    svg << "<g class=\"legend\"><rect x=\"" << coord(x) << "\" y=\"" << coord(y) << "\" width=\"12\" height=\"12\" "
        << "fill=\"" << legend[i].second << "\"/><text x=\"" << coord(x + 16) << "\" y=\"" << coord(y + 10)
        << "\" font-size=\"11\">" << legend[i].first << "</text></g>\n";
  }
  // Grid and time axis (milliseconds from the first event).
  const Axis axis = make_axis(0, (t1 - t0) / 1000, 8);
  for (double v = axis.lo; v <= axis.hi + axis.step / 2; v += axis.step) {
    const double us = t0 + v * 1000;
    if (us > t1 + 1e-6) break;
    const double x = sx(us);
    svg << "<line x1=\"" << coord(x) << "\" y1=\"" << coord(top) << "\" x2=\"" << coord(x) << "\" y2=\""
        << coord(top + lanes_h) << "\" stroke=\"#dddddd\"/>"
        << "<text x=\"" << coord(x) << "\" y=\"" << coord(top + lanes_h + 16) << "\" text-anchor=\"middle\" "
        << "font-size=\"11\">" << tick_label(v) << "</text>\n";
  }
  svg << "<text x=\"" << coord(label_w + plot_w / 2) << "\" y=\"" << coord(height - 2)
      << "\" text-anchor=\"middle\" font-size=\"11\">time (ms)</text>\n";
  double y = top;
  for (const auto& [key, boxes] : lanes) {
    const auto& [pid, tid] = key;
    const int n = rows[key];
    const std::string process = processes.count(pid) ? processes[pid] : "pid " + std::to_string(pid);
    const std::string thread = threads.count(key) ? threads[key] : "tid " + std::to_string(tid);
    svg << "<g class=\"lane\" data-pid=\"" << pid << "\" data-tid=\"" << tid << "\">\n"
        << "<rect x=\"" << coord(label_w) << "\" y=\"" << coord(y) << "\" width=\"" << coord(plot_w) << "\" height=\""
        << coord(n * row_h) << "\" fill=\"#f7f7f7\"/>"
        << "<text x=\"" << coord(label_w - 6) << "\" y=\"" << coord(y + row_h - 3) << "\" text-anchor=\"end\" "
        << "font-size=\"11\">" << xml_escape(process + " " + thread) << "</text>\n";
    for (const auto& b : boxes) {
      const double x = sx(b.ts), w = std::max(0.5, sx(b.ts + b.dur) - x);
      svg << "<rect class=\"span\" data-cat=\"" << xml_escape(b.cat) << "\" x=\"" << coord(x) << "\" y=\""
          << coord(y + b.depth * row_h + 1) << "\" width=\"" << coord(w) << "\" height=\"" << coord(row_h - 2)
          << "\" fill=\"" << box_color(b) << "\" stroke=\"white\" stroke-width=\"0.6\"><title>" << xml_escape(b.name) << " (" << duration_text(b.dur)
          << ")</title></rect>\n";
    }
    svg << "</g>\n";
    y += n * row_h + lane_gap;
  }
  svg << "</svg>\n";
  return svg.str();
}

void plot_timeline(const std::string& trace_path, const std::string& svg_path, const PlotOptions& options) {
  std::ifstream in(trace_path, std::ios::binary);
  if (!in) throw UsageError("trace " + trace_path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  write_svg(render_timeline_svg(text.str(), trace_path, options), svg_path);
}

}  // namespace scaletrain::train

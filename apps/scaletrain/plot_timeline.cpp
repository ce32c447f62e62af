// `scaletrain plot --timeline TRACE.json`: a Chrome trace drawn as per-rank
// lanes (render_timeline_svg, plot.h). It goes in three steps: parse the
// trace into boxes, one list per lane (parse_trace); nest each lane's boxes
// into rows and find the time span (lay_out_rows); draw the legend, the time
// axis and the lanes (draw_legend, draw_time_axis, draw_lanes), on a canvas
// whose sizes and time scale are Geometry's.
#include "plot.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "scaletrain/util/error.h"
#include "svg.h"

namespace scaletrain::cli {
namespace {

using svg::Axis;
using svg::coord;
using svg::make_axis;
using svg::open_svg;
using svg::tick_label;
using svg::write_svg;
using svg::xml_escape;

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
      {"step", "#c8c8c8"}, {"forward", "#4e79a7"},    {"backward", "#f28e2b"}, {"optimizer", "#59a14f"},
      {"data", "#b07aa1"}, {"checkpoint", "#9c755f"}, {"wait", "#7a0019"}};
  static const std::map<std::string, std::string> by_op{
      {"all_reduce", "#e15759"}, {"all_gather", "#76b7b2"},   {"reduce_scatter", "#edc948"}, {"broadcast", "#bab0ac"},
      {"all_to_all", "#ff9da7"}, {"all_to_all_v", "#ff9da7"}, {"send", "#d4a6c8"},           {"recv", "#d4a6c8"}};
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

using LaneKey = std::pair<int, int>;  // (pid, tid)

// A trace's complete events, one list of boxes per lane (pid, tid), and the
// names its metadata events give the processes and threads.
struct Trace {
  std::map<int, std::string> processes;
  std::map<LaneKey, std::string> threads;
  std::map<LaneKey, std::vector<Box>> lanes;
};

// Parses the trace's text; UsageError naming the problem for a file that is
// not a Chrome trace or holds no complete ("X") events.
Trace parse_trace(const std::string& trace_json, const std::string& source) {
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
  Trace out;
  for (const auto& e : *events) {
    if (!e.is_object() || !e.contains("ph") || !e.contains("pid")) continue;
    try {
      const std::string ph = e["ph"].get<std::string>();
      const int pid = e["pid"].get<int>(), tid = e.value("tid", 0);
      if (ph == "M") {
        const std::string what = e.value("name", "");
        const std::string name = e.contains("args") ? e["args"].value("name", "") : "";
        if (what == "process_name") out.processes[pid] = name;
        if (what == "thread_name") out.threads[{pid, tid}] = name;
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
      out.lanes[{pid, tid}].push_back(std::move(b));
    } catch (const nlohmann::json::exception& ex) {
      throw UsageError("trace " + source + ": an event has a field of the wrong type (" + std::string(ex.what()) + ")");
    }
  }
  if (out.lanes.empty()) throw UsageError("trace " + source + ": no complete (\"X\") events to draw");
  return out;
}

// How the lanes are laid out: each lane's number of rows (its deepest
// nesting), and the time span of all boxes in microseconds.
struct Layout {
  std::map<LaneKey, int> rows;
  double t0 = 0, t1 = 1;
};

// Orders each lane's boxes by start (the longer first) and sets their depth.
Layout lay_out_rows(Trace& trace) {
  // Nesting: a box inside the one before it in its lane goes a row lower.
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  std::map<std::pair<int, int>, int> rows;
  for (auto& [key, boxes] : trace.lanes) {
    std::stable_sort(boxes.begin(), boxes.end(),
                     [](const Box& a, const Box& b) { return a.ts != b.ts ? a.ts < b.ts : a.dur > b.dur; });
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
  Layout layout;
  layout.rows = std::move(rows);
  layout.t0 = t0;
  layout.t1 = t1;
  return layout;
}

// Where things go on the canvas: the label column, margins and row heights,
// the picture's size, and the time scale (sx: microseconds to x).
struct Geometry {
  double width = 0;
  double label_w = 150, right = 20, row_h = 14, lane_gap = 6;
  double title_h = 0, legend_h = 44, axis_h = 30;
  double lanes_h = 0, top = 0, height = 0, plot_w = 0;
  double t0 = 0, t1 = 1;
  double sx(double us) const { return label_w + (us - t0) / (t1 - t0) * plot_w; }
};

Geometry geometry(const Layout& layout, const PlotOptions& options) {
  Geometry g;
  g.width = std::max(options.width, 400);
  g.title_h = options.title.empty() ? 0 : 30;
  for (const auto& [key, n] : layout.rows) g.lanes_h += n * g.row_h + g.lane_gap;
  g.top = g.title_h + g.legend_h;
  g.height = g.top + g.lanes_h + g.axis_h;
  g.plot_w = g.width - g.label_w - g.right;
  g.t0 = layout.t0;
  g.t1 = layout.t1;
  return g;
}

// Legend: the kinds of box.
void draw_legend(std::ostringstream& svg, const Geometry& g) {
  const std::vector<std::pair<std::string, std::string>> legend{
      {"forward", "#4e79a7"},    {"backward", "#f28e2b"},   {"optimizer", "#59a14f"},
      {"data", "#b07aa1"},       {"checkpoint", "#9c755f"}, {"wait (exposed)", "#7a0019"},
      {"all_reduce", "#e15759"}, {"all_gather", "#76b7b2"}, {"reduce_scatter", "#edc948"},
      {"all_to_all", "#ff9da7"}, {"send/recv", "#d4a6c8"},  {"other", "#bab0ac"}};
  for (size_t i = 0; i < legend.size(); ++i) {
    const double x = g.label_w + static_cast<double>(i % 6) * (g.plot_w / 6);
    const double y = g.title_h + 8 + 18.0 * static_cast<double>(i / 6);
    svg << "<g class=\"legend\"><rect x=\"" << coord(x) << "\" y=\"" << coord(y) << "\" width=\"12\" height=\"12\" "
        << "fill=\"" << legend[i].second << "\"/><text x=\"" << coord(x + 16) << "\" y=\"" << coord(y + 10)
        << "\" font-size=\"11\">" << legend[i].first << "</text></g>\n";
  }
}

// Grid and time axis (milliseconds from the first event).
void draw_time_axis(std::ostringstream& svg, const Geometry& g) {
  const Axis axis = make_axis(0, (g.t1 - g.t0) / 1000, 8);
  for (double v = axis.lo; v <= axis.hi + axis.step / 2; v += axis.step) {
    const double us = g.t0 + v * 1000;
    if (us > g.t1 + 1e-6) break;
    const double x = g.sx(us);
    svg << "<line x1=\"" << coord(x) << "\" y1=\"" << coord(g.top) << "\" x2=\"" << coord(x) << "\" y2=\""
        << coord(g.top + g.lanes_h) << "\" stroke=\"#dddddd\"/>"
        << "<text x=\"" << coord(x) << "\" y=\"" << coord(g.top + g.lanes_h + 16) << "\" text-anchor=\"middle\" "
        << "font-size=\"11\">" << tick_label(v) << "</text>\n";
  }
  svg << "<text x=\"" << coord(g.label_w + g.plot_w / 2) << "\" y=\"" << coord(g.height - 2)
      << "\" text-anchor=\"middle\" font-size=\"11\">time (ms)</text>\n";
}

// One lane per (pid, tid): its label, background, and a box per span.
void draw_lanes(std::ostringstream& svg, const Trace& trace, const Layout& layout, const Geometry& g) {
  double y = g.top;
  for (const auto& [key, boxes] : trace.lanes) {
    const auto& [pid, tid] = key;
    const int n = layout.rows.at(key);
    const std::string process = trace.processes.count(pid) ? trace.processes.at(pid) : "pid " + std::to_string(pid);
    const std::string thread = trace.threads.count(key) ? trace.threads.at(key) : "tid " + std::to_string(tid);
    svg << "<g class=\"lane\" data-pid=\"" << pid << "\" data-tid=\"" << tid << "\">\n"
        << "<rect x=\"" << coord(g.label_w) << "\" y=\"" << coord(y) << "\" width=\"" << coord(g.plot_w)
        << "\" height=\"" << coord(n * g.row_h) << "\" fill=\"#f7f7f7\"/>"
        << "<text x=\"" << coord(g.label_w - 6) << "\" y=\"" << coord(y + g.row_h - 3) << "\" text-anchor=\"end\" "
        << "font-size=\"11\">" << xml_escape(process + " " + thread) << "</text>\n";
    for (const auto& b : boxes) {
      const double x = g.sx(b.ts), w = std::max(0.5, g.sx(b.ts + b.dur) - x);
      svg << "<rect class=\"span\" data-cat=\"" << xml_escape(b.cat) << "\" x=\"" << coord(x) << "\" y=\""
          << coord(y + b.depth * g.row_h + 1) << "\" width=\"" << coord(w) << "\" height=\"" << coord(g.row_h - 2)
          << "\" fill=\"" << box_color(b) << "\" stroke=\"white\" stroke-width=\"0.6\"><title>" << xml_escape(b.name)
          << " (" << duration_text(b.dur) << ")</title></rect>\n";
    }
    svg << "</g>\n";
    y += n * g.row_h + g.lane_gap;
  }
}

}  // namespace

std::string render_timeline_svg(const std::string& trace_json, const std::string& source, const PlotOptions& options) {
  Trace trace = parse_trace(trace_json, source);
  const Layout layout = lay_out_rows(trace);
  const Geometry g = geometry(layout, options);
  std::ostringstream svg;
  open_svg(svg, g.width, g.height, options.title);
  draw_legend(svg, g);
  draw_time_axis(svg, g);
  draw_lanes(svg, trace, layout, g);
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

}  // namespace scaletrain::cli

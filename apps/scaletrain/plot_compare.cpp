// `scaletrain plot RUN_A.jsonl RUN_B.jsonl [--labels a,b]`: several runs on
// one picture (render_comparison_svg, plot.h), one panel per quantity, each
// run's curve in its own color under a legend naming the runs.
#include "plot.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include "scaletrain/util/error.h"
#include "svg.h"

namespace scaletrain::cli {
namespace {

using svg::coord;
using svg::draw_panel;
using svg::open_svg;
using svg::palette;
using svg::Series;
using svg::write_svg;
using svg::xml_escape;

}  // namespace

std::string render_comparison_svg(const std::vector<Run>& runs, const PlotOptions& options) {
  struct Quantity {
    const char* title;
    double MetricsRecord::*field;
    bool include_zero;
  };
  // Runs that count no tokens (users' modules) are compared in samples/s.
  bool tokens = false;
  for (const auto& run : runs)
    for (const auto& r : run.records) tokens = tokens || (r.restart == 0 && !std::isnan(r.tokens_per_s));
  const std::vector<Quantity> quantities{
      {"Loss", &MetricsRecord::loss, false},
      {"Learning rate", &MetricsRecord::lr, true},
      tokens ? Quantity{"Throughput (tokens/s)", &MetricsRecord::tokens_per_s, true}
             : Quantity{"Throughput (samples/s)", &MetricsRecord::samples_per_s, true},
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
        << "\" y2=\"" << coord(y - 4) << "\" stroke=\"" << color << "\" stroke-width=\"3\"/><text x=\"" << coord(x + 36)
        << "\" y=\"" << coord(y) << "\" font-size=\"13\">" << xml_escape(runs[i].label) << "</text></g>\n";
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

}  // namespace scaletrain::cli

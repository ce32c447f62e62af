// The shared SVG drawing helpers of svg.h: escaping, coordinates, the canvas,
// ticks and axes, a panel of curves, the palette and writing the file. Every
// picture of `scaletrain plot` draws through these, so the pictures agree on
// fonts, margins, grid and number formats.
#include "svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "scaletrain/util/error.h"

namespace scaletrain::cli::svg {
namespace {

// A "nice" tick spacing (1, 2 or 5 times a power of ten) giving about
// `target` intervals over `range`: the spacing people choose by hand.
double nice_step(double range, int target) {
  const double raw = range / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double nice = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
  return nice * mag;
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

void draw_panel(std::ostringstream& svg, const std::vector<Series>& all, const std::vector<std::string>& colors,
                const std::string& title, bool include_zero, double left, double top, double width, double height,
                double guide, const std::vector<double>& marks) {
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

}  // namespace scaletrain::cli::svg

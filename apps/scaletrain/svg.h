#pragma once
// The SVG drawing helpers the `scaletrain plot` pictures share (plot_curves.cpp,
// plot_compare.cpp, plot_timeline.cpp): XML escaping, coordinates, the white
// canvas with its title, tick labels and "nice" axes, a panel of curves with
// its frame, grid and labels, the palette of run colors, and writing the file.
// The SVG is written by hand (a few dozen elements per picture), so none of
// this needs libtorch or a plotting library.
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace scaletrain::cli::svg {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// `s` with & < > " replaced by their XML entities.
std::string xml_escape(const std::string& s);

// Coordinates: two decimals is sub-pixel and keeps long curves compact.
std::string coord(double v);

// The start of a white SVG canvas, with `title` (if any) centered on top.
void open_svg(std::ostringstream& svg, double width, double height, const std::string& title);

// Tick label: short, with k/M/G suffixes so "1250000 tokens/s" reads "1.25M".
std::string tick_label(double v);

struct Axis {
  double lo = 0, hi = 1, step = 0.2;
};

// Expands [lo, hi] outward to tick multiples; a zero-width range (one point,
// or a flat curve) is widened first so the scale is never degenerate.
Axis make_axis(double lo, double hi, int target_ticks);

struct Series {
  std::vector<double> x, y;  // y may hold NaN: drawn as a gap
};

// One panel: frame, grid, ticks, labels, then the curves (and a dashed guide
// line at `guide`, and a dashed vertical "restart" mark at each step of
// `marks`). (left, top) is the corner of the whole panel; the plot area sits
// inside fixed margins that leave room for the tick labels.
void draw_panel(std::ostringstream& svg, const std::vector<Series>& all, const std::vector<std::string>& colors,
                const std::string& title, bool include_zero, double left, double top, double width, double height,
                double guide = kNaN, const std::vector<double>& marks = {});

// The colors of runs on one picture, in order (the comparison's legend).
const std::vector<std::string>& palette();

// Writes `svg` to `svg_path`; UsageError "plot: ..." if it cannot.
void write_svg(const std::string& svg, const std::string& svg_path);

}  // namespace scaletrain::cli::svg

#pragma once
// The pictures of `scaletrain plot`, each a self-contained SVG: training
// curves from a metrics log (plot_curves.cpp), several runs compared on one
// picture (plot_compare.cpp), and a Chrome trace as a timeline
// (plot_timeline.cpp); their shared drawing helpers are svg.h. The library
// only writes the logs and traces; drawing them is the CLI's job.
//
// Training curves from a metrics log, as a self-contained SVG.
//
// The input is the trainer's JSON-lines metrics file: one object per line with
// keys step, loss, lr, step_ms, tokens_per_s, mfu, peak_rss_mb, comm_wait_ms.
// The output has two stacked panels, loss vs step and tokens/s vs step, each
// with axes, grid, tick labels and a title; a log of an MoE model (key
// moe_tokens_per_expert) gets a third: each expert's share of the step's
// slots, one curve per expert, with the uniform share 1/E marked. The SVG is written by hand (it is
// a few dozen elements), so this file needs neither libtorch nor a plotting
// library and `scaletrain plot` works on a laptop with just the log.
#include <cstdint>
#include <string>
#include <vector>

namespace scaletrain::cli {

// One line of the metrics log. Fields that were absent or JSON null are NaN;
// null is how a JSON writer emits a non-finite float (e.g. a diverged loss),
// and such points are drawn as gaps in the curve rather than rejected.
struct MetricsRecord {
  int64_t step = 0;         // optimizer step (required, integer)
  double loss = 0;          // training loss (required key; may be null)
  double lr = 0;            // learning rate (optional)
  double step_ms = 0;       // wall time of the step in ms (optional)
  // Throughput over all ranks: tokens/s (our families), or samples/s alone
  // (a user's module through ModuleTrainer); one of the two keys is required
  // (either may be null).
  double tokens_per_s = 0;
  double samples_per_s = 0;
  double mfu = 0;           // model FLOPs utilization, 0..1 (optional)
  double peak_rss_mb = 0;   // peak resident memory in MiB (optional)
  double comm_wait_ms = 0;  // time blocked on collectives in ms (optional)
  double grad_norm = 0;     // global gradient norm before clipping (optional)
  double loss_scale = 0;    // dynamic loss scale (optional)
  // MoE models (optional): slots each expert took this step (models/moe.h).
  std::vector<double> moe_tokens_per_expert;
  // A {"record": "restart", ...} line: a restarted attempt (`restart`, its
  // number) went on from `step`; every other field is unset.
  int restart = 0;
};

struct PlotOptions {
  // Total SVG width in pixels.
  int width = 900;
  // Height of each of the two panels in pixels (the SVG is about twice this).
  int panel_height = 320;
  // Heading above both panels; empty for none. XML-escaped on output.
  std::string title;
};

// Parses the metrics file. Blank lines and records that are not steps (an
// object with a "record" key, such as the trainer's memory report) are
// skipped, except restart records, which come back with `restart` set;
// unknown keys are ignored
// (the logger may grow fields). A line that is not a JSON object, lacks step,
// loss or tokens_per_s, or has a non-numeric value for a known key throws
// UsageError "metrics file PATH line N: PROBLEM". A missing file is a
// UsageError too. An empty file gives an empty vector.
std::vector<MetricsRecord> read_metrics(const std::string& path);

// Renders the two panels. Records need not be sorted: they are ordered by
// step, and when a step appears more than once (a run resumed from an earlier
// checkpoint appends the re-done steps) the later line wins, which is the
// curve the resumed run actually followed. A panel with no finite values says
// "no data" instead of drawing a curve.
std::string render_svg(const std::vector<MetricsRecord>& records, const PlotOptions& options);

// read_metrics + render_svg + write to svg_path. Throws UsageError if the log
// has no records or the SVG cannot be written.
void plot_metrics(const std::string& metrics_path, const std::string& svg_path, const PlotOptions& options = {});

// Several runs on one picture (fp32 against bf16, DDP against ZeRO-3): one
// panel per quantity (loss, learning rate, tokens/s, MFU, peak RSS, gradient
// norm, loss scale), each run's curve in its own color, a legend naming the
// runs. A quantity no run logged says "no data".
struct Run {
  std::string label;
  std::vector<MetricsRecord> records;
};
std::string render_comparison_svg(const std::vector<Run>& runs, const PlotOptions& options);
// Reads each log (labels: one per path, or empty for the file names) and
// writes the comparison. UsageError on a log with no records, or labels
// that do not match the paths.
void plot_runs(const std::vector<std::string>& metrics_paths, const std::vector<std::string>& labels,
               const std::string& svg_path, const PlotOptions& options = {});

// A Chrome trace (what metrics.trace_steps writes, observe/tracing.h) as a
// timeline: one lane per rank and thread (compute, then the comm lanes), time
// running left to right in milliseconds, each span a box colored by its kind
// (forward, backward, optimizer, data, checkpoint, a collective, a wait on
// one), nested spans stacked below their parent. Overlap shows as a comm box
// under a compute box; an exposed wait as a dark box on the compute lane.
// Every box carries its name and duration as a tooltip. `trace_json` is the
// file's text. Throws UsageError naming the problem for a file that is not a
// Chrome trace or holds no complete ("X") events.
std::string render_timeline_svg(const std::string& trace_json, const std::string& source, const PlotOptions& options);
void plot_timeline(const std::string& trace_path, const std::string& svg_path, const PlotOptions& options = {});

}  // namespace scaletrain::cli

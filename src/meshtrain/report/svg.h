// Inline SVG plots for the run report: line charts over steps and grouped bar
// charts, as plain strings (no script, no external resource). Every chart is
// an <svg class="plot" id="plot-<id>">; each series is a <path class="series"
// data-series="<name>" data-points="<n>"> and each bar a <rect class="bar"
// data-series data-group data-value>, so a test can check what was drawn.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace meshtrain::report {

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), x increasing
  std::string color;
  bool dashed = false;
};

// A vertical line at x (a skipped step, a rollback, a resume).
struct Marker {
  double x = 0;
  std::string label;
  std::string color;
};

struct BarGroup {
  std::string label;
  std::vector<double> values;  // one per series name, in order
};

// About `count` round tick values covering [lo, hi] (1, 2, 5 × 10^k steps).
std::vector<double> nice_ticks(double lo, double hi, int count);

// Short tick text: 1.2k, 3.5M, 0.25, 1e-04.
std::string tick_label(double value);

// & < > " escaped for text and attribute values.
std::string escape_html(const std::string& text);

std::string line_chart(const std::string& id, const std::string& title,
                       const std::string& y_label, const std::vector<Series>& series,
                       const std::vector<Marker>& markers = {});

std::string bar_chart(const std::string& id, const std::string& title,
                      const std::string& y_label, const std::vector<std::string>& series_names,
                      const std::vector<std::string>& colors, const std::vector<BarGroup>& groups);

}  // namespace meshtrain::report

#include "meshtrain/report/svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>

namespace meshtrain::report {
namespace {

constexpr double kWidth = 560, kHeight = 260;
constexpr double kLeft = 64, kRight = 16, kTop = 40, kBottom = 40;

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  void settle() {
    if (!std::isfinite(lo)) lo = 0, hi = 1;
    if (hi - lo < 1e-12 * std::max(1.0, std::abs(hi))) {
      const double pad = std::abs(hi) > 0 ? std::abs(hi) * 0.1 : 1;
      lo -= pad, hi += pad;
    }
  }
};

std::string svg_open(const std::string& id, const std::string& kind, const std::string& title) {
  return fmt::format(
      "<svg class=\"plot\" id=\"plot-{0}\" data-kind=\"{1}\" xmlns=\"http://www.w3.org/2000/svg\" "
      "width=\"{2}\" height=\"{3}\" viewBox=\"0 0 {2} {3}\" role=\"img\" aria-label=\"{4}\">"
      "<text class=\"title\" x=\"{5}\" y=\"16\" font-size=\"13\" font-weight=\"bold\">{4}</text>",
      escape_html(id), kind, kWidth, kHeight, escape_html(title), kLeft);
}

// Axes, ticks and grid for [x0, x1] × [y0, y1] (x ticks only when x_ticks).
std::string axes(const Range& x, const Range& y, const std::string& y_label, bool x_ticks) {
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  std::string out = fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>", kLeft,
      kTop, plot_w, plot_h);
  for (double t : nice_ticks(y.lo, y.hi, 5)) {
    const double py = kTop + plot_h * (1 - (t - y.lo) / (y.hi - y.lo));
    out += fmt::format(
        "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#e4e4e4\"/>"
        "<text x=\"{3}\" y=\"{4:.1f}\" font-size=\"10\" text-anchor=\"end\">{5}</text>",
        kLeft, kLeft + plot_w, py, kLeft - 4, py + 3, tick_label(t));
  }
  if (x_ticks) {
    for (double t : nice_ticks(x.lo, x.hi, 6)) {
      const double px = kLeft + plot_w * (t - x.lo) / (x.hi - x.lo);
      out += fmt::format(
          "<text x=\"{:.1f}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{}</text>", px,
          kTop + plot_h + 14, tick_label(t));
    }
    out += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">step</text>",
                       kLeft + plot_w / 2, kHeight - 6);
  }
  out += fmt::format(
      "<text x=\"12\" y=\"{0}\" font-size=\"10\" text-anchor=\"middle\" "
      "transform=\"rotate(-90 12 {0})\">{1}</text>",
      kTop + plot_h / 2, escape_html(y_label));
  return out;
}

std::string legend(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out;
  double x = kWidth - kRight;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    x -= 14 + 6.5 * static_cast<double>(it->first.size());
    out += fmt::format(
        "<rect x=\"{0:.1f}\" y=\"23\" width=\"10\" height=\"10\" fill=\"{1}\"/>"
        "<text x=\"{2:.1f}\" y=\"32\" font-size=\"10\">{3}</text>",
        x, it->second, x + 12, escape_html(it->first));
  }
  return out;
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int count) {
  std::vector<double> ticks;
  if (!(hi > lo) || count < 1) return ticks;
  const double raw = (hi - lo) / count;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  // k × step, rounded to the step's decimals (0.3, not 0.30000000000000004).
  const double scale = std::pow(10.0, std::max(0.0, -std::floor(std::log10(step))));
  for (auto k = static_cast<int64_t>(std::ceil(lo / step)); k * step <= hi + step * 1e-9; ++k) {
    ticks.push_back(std::round(static_cast<double>(k) * step * scale) / scale + 0.0);
  }
  return ticks;
}

std::string tick_label(double v) {
  const double a = std::abs(v);
  if (a == 0) return "0";
  if (a >= 1e9) return fmt::format("{:g}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:g}k", v / 1e3);
  if (a < 1e-3) return fmt::format("{:.0e}", v);
  return fmt::format("{:g}", v);
}

std::string escape_html(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string line_chart(const std::string& id, const std::string& title,
                       const std::string& y_label, const std::vector<Series>& series,
                       const std::vector<Marker>& markers) {
  Range x, y;
  for (const Series& s : series) {
    for (auto [px, py] : s.points) {
      if (std::isfinite(py)) x.add(px), y.add(py);
    }
  }
  for (const Marker& m : markers) x.add(m.x);
  x.settle();
  y.settle();
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto sx = [&](double v) { return kLeft + plot_w * (v - x.lo) / (x.hi - x.lo); };
  auto sy = [&](double v) { return kTop + plot_h * (1 - (v - y.lo) / (y.hi - y.lo)); };
  std::string out = svg_open(id, "line", title) + axes(x, y, y_label, true);
  for (const Marker& m : markers) {
    out += fmt::format(
        "<line class=\"marker\" data-marker=\"{0}\" x1=\"{1:.1f}\" x2=\"{1:.1f}\" y1=\"{2}\" "
        "y2=\"{3}\" stroke=\"{4}\" stroke-dasharray=\"3 2\"><title>{0} at step {5:g}</title></line>",
        escape_html(m.label), sx(m.x), kTop, kTop + plot_h, m.color, m.x);
  }
  std::vector<std::pair<std::string, std::string>> entries;
  for (const Series& s : series) {
    std::string d;
    int n = 0;
    for (auto [px, py] : s.points) {
      if (!std::isfinite(py)) continue;
      d += fmt::format("{}{:.1f} {:.1f}", n == 0 ? "M" : " L", sx(px), sy(py));
      ++n;
    }
    if (n == 0) continue;
    out += fmt::format(
        "<path class=\"series\" data-series=\"{}\" data-points=\"{}\" d=\"{}\" fill=\"none\" "
        "stroke=\"{}\" stroke-width=\"1.6\"{}/>",
        escape_html(s.name), n, d, s.color, s.dashed ? " stroke-dasharray=\"5 3\"" : "");
    if (n <= 20) {  // few points (validation): dots as well
      for (auto [px, py] : s.points) {
        if (!std::isfinite(py)) continue;
        out += fmt::format(
            "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"><title>{} step {:g}: {:.5g}"
            "</title></circle>",
            sx(px), sy(py), s.color, escape_html(s.name), px, py);
      }
    }
    entries.emplace_back(s.name, s.color);
  }
  return out + legend(entries) + "</svg>";
}

std::string bar_chart(const std::string& id, const std::string& title,
                      const std::string& y_label, const std::vector<std::string>& series_names,
                      const std::vector<std::string>& colors, const std::vector<BarGroup>& groups) {
  Range y;
  y.add(0);
  for (const BarGroup& g : groups) {
    for (double v : g.values) y.add(v);
  }
  y.settle();
  y.lo = std::min(y.lo, 0.0);
  y.hi += 0.08 * (y.hi - y.lo);  // room above the tallest bar
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto sy = [&](double v) { return kTop + plot_h * (1 - (v - y.lo) / (y.hi - y.lo)); };
  std::string out = svg_open(id, "bar", title) + axes(Range{0, 1}, y, y_label, false);
  const double group_w = plot_w / std::max<double>(1, static_cast<double>(groups.size()));
  const double bar_w = group_w * 0.8 / std::max<double>(1, static_cast<double>(series_names.size()));
  for (size_t g = 0; g < groups.size(); ++g) {
    const double gx = kLeft + group_w * static_cast<double>(g) + group_w * 0.1;
    for (size_t s = 0; s < series_names.size() && s < groups[g].values.size(); ++s) {
      const double v = groups[g].values[s];
      if (!std::isfinite(v)) continue;
      const double top = sy(std::max(v, 0.0)), bottom = sy(std::min(v, 0.0));
      out += fmt::format(
          "<rect class=\"bar\" data-series=\"{0}\" data-group=\"{1}\" data-value=\"{2:.6g}\" "
          "x=\"{3:.1f}\" y=\"{4:.1f}\" width=\"{5:.1f}\" height=\"{6:.1f}\" fill=\"{7}\">"
          "<title>{1} {0}: {2:.6g}</title></rect>",
          escape_html(series_names[s]), escape_html(groups[g].label), v,
          gx + bar_w * static_cast<double>(s), top, bar_w * 0.92, std::max(bottom - top, 0.5),
          s < colors.size() ? colors[s] : "#888");
    }
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
        gx + group_w * 0.4, kTop + plot_h + 14, escape_html(groups[g].label));
  }
  std::vector<std::pair<std::string, std::string>> entries;
  for (size_t s = 0; s < series_names.size(); ++s) {
    entries.emplace_back(series_names[s], s < colors.size() ? colors[s] : "#888");
  }
  return out + legend(entries) + "</svg>";
}

}  // namespace meshtrain::report

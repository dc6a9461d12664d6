// `meshtrain report RUN_DIR`: every rank's metrics (metrics.jsonl,
// metrics.rank<R>.jsonl), the checkpoints and the resolved config of a run,
// summarised as JSON (report.json) and drawn as one self-contained HTML page
// (report.html: inline SVG, no script, no network). docs/report.md.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace meshtrain::report {

// The run's numbers. Records written twice (a resumed run redoes steps) keep
// the later one. Throws Error (config) when RUN_DIR has no metrics.jsonl.
nlohmann::json summarize_run(const std::string& run_dir);

// The page for a summary (every plot from the summary's own numbers).
std::string render_html(const nlohmann::json& summary);

struct ReportFiles {
  std::string html, json;
};
// Writes report.html (or html_out) and report.json beside it.
ReportFiles write_report(const std::string& run_dir, const std::string& html_out = "");

}  // namespace meshtrain::report

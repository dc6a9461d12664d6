// render_html and write_report: the summary drawn as one page.
#include "meshtrain/report/run_report.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "meshtrain/report/svg.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/util/error.h"

namespace fs = std::filesystem;

namespace meshtrain::report {
namespace {

using nlohmann::json;

constexpr const char* kBlue = "#1f77b4";
constexpr const char* kOrange = "#ff7f0e";
constexpr const char* kGreen = "#2ca02c";
constexpr const char* kRed = "#d62728";
constexpr const char* kGray = "#7f7f7f";

double as_double(const json& v) { return v.is_number() ? v.get<double>() : std::nan(""); }

Series series_of(const json& xs, const json& ys, std::string name, std::string color,
                 double scale = 1) {
  Series s{std::move(name), {}, std::move(color)};
  for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
    s.points.emplace_back(as_double(xs[i]), as_double(ys[i]) * scale);
  }
  return s;
}

// Skipped steps, rollbacks and resumes as markers.
std::vector<Marker> run_markers(const json& s) {
  std::vector<Marker> out;
  for (const json& k : s["skipped_steps"]) out.push_back({as_double(k["step"]), "skipped", kRed});
  for (const json& e : s["events"]["rollback"]) {
    out.push_back({as_double(e.value("from_step", json(0))), "rollback", kOrange});
  }
  for (const json& e : s["events"]["resume"]) out.push_back({as_double(e["step"]), "resume", kGray});
  return out;
}

std::string fmt_num(const json& v, const char* spec = "{:.3g}") {
  return v.is_number() ? fmt::format(fmt::runtime(spec), v.get<double>()) : "–";
}

std::string percent(const json& v) {
  return v.is_number() ? fmt::format("{:.1f}%", v.get<double>() * 100) : "–";
}

std::string section(const std::string& id, const std::string& title, const std::string& body) {
  return fmt::format("<section id=\"sec-{}\"><h2>{}</h2>{}</section>\n", id, escape_html(title), body);
}

std::string note(const std::string& text) {
  return fmt::format("<p class=\"note\">{}</p>", escape_html(text));
}

std::string memory_section(const json& s) {
  if (s["memory"].empty()) return note("no memory records (the run ended before its first step)");
  std::string body;
  for (const json& m : s["memory"]) {
    std::vector<BarGroup> groups;
    for (size_t c = 0; c < kMemCategories; ++c) {
      const std::string name(mem_category_name(static_cast<MemCategory>(c)));
      const double got = as_double(m["measured_peak"][name]), want = as_double(m["predicted"][name]);
      if (got <= 0 && want <= 0) continue;
      groups.push_back({name, {got / (1 << 20), want / (1 << 20)}});
    }
    const int rank = m["rank"].get<int>();
    body += bar_chart(fmt::format("memory-rank{}", rank),
                      fmt::format("rank {} ({}): peak {} measured, {} predicted", rank,
                                  m["when"].get<std::string>(),
                                  format_bytes(m["measured_peak"]["total"].get<size_t>()),
                                  format_bytes(m["predicted"]["total"].get<size_t>())),
                      "MiB", {"measured peak", "predicted"}, {kBlue, kOrange}, groups);
  }
  return body;
}

std::string comm_section(const json& s) {
  if (s["comm"].is_null()) return note("single rank: no communication");
  std::vector<BarGroup> groups;
  std::string rows;
  for (const json& c : s["comm"]) {
    groups.push_back({fmt::format("rank {}", c["rank"].get<int>()),
                      {as_double(c["comm_share"]) * 100, as_double(c["exposed_share"]) * 100,
                       as_double(c["all_to_all_share"]) * 100}});
    rows += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        c["rank"].get<int>(), fmt_num(c["step_ms"], "{:.1f}"), fmt_num(c["comm_ms"], "{:.1f}"),
        fmt_num(c["exposed_comm_ms"], "{:.1f}"), percent(c["comm_share"]),
        percent(c["exposed_share"]), fmt_num(c["all_to_all_ms"], "{:.1f}"));
  }
  return bar_chart("comm", "communication share of the step per rank", "% of step",
                   {"gradient communication", "exposed", "expert all-to-all (exposed)"},
                   {kBlue, kRed, kOrange}, groups) +
         "<table id=\"table-comm\"><tr><th>rank</th><th>step ms</th><th>comm ms</th><th>exposed ms</th>"
         "<th>comm share</th><th>exposed share</th><th>all-to-all ms</th></tr>" + rows + "</table>";
}

std::string pipeline_section(const json& s) {
  if (s["pipeline"].is_null()) return note("not a pipeline run");
  std::vector<BarGroup> groups;
  for (const json& st : s["pipeline"]["stages"]) {
    groups.push_back({st["stage"].is_number() ? fmt::format("stage {}", st["stage"].get<int>()) : "stage ?",
                      {as_double(st["bubble"]), as_double(st["bubble_theory"])}});
  }
  std::string rows;
  for (const json& p : s["pipeline"]["ranks"]) {
    rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        p["rank"].get<int>(), fmt_num(p["stage"], "{:g}"), fmt_num(p["bubble"]),
                        fmt_num(p["bubble_theory"]), fmt_num(p["busy_ms"], "{:.1f}"),
                        fmt_num(p["wait_ms"], "{:.1f}"));
  }
  return bar_chart("bubble", "pipeline bubble per stage: measured (wait / busy) vs theory", "bubble",
                   {"measured", "theory"}, {kBlue, kGray}, groups) +
         "<table id=\"table-bubble\"><tr><th>rank</th><th>stage</th><th>bubble</th><th>theory</th>"
         "<th>busy ms</th><th>wait ms</th></tr>" + rows + "</table>";
}

std::string step_time_section(const json& s) {
  const json& t = s["step_time"];
  std::string rows;
  for (const json& r : t["ranks"]) {
    const bool slow = r["straggler"].get<bool>();
    rows += fmt::format(
        "<tr class=\"{}\" data-rank=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        slow ? "straggler" : "", r["rank"].get<int>(), r["rank"].get<int>(), r["steps"].get<int>(),
        fmt_num(r["median_ms"], "{:.1f}"), fmt_num(r["mean_ms"], "{:.1f}"),
        fmt_num(r["max_ms"], "{:.1f}"), fmt_num(r["data_ms"], "{:.2f}"),
        fmt_num(r["comm_ms"], "{:.1f}"), fmt_num(r["relative"], "{:.2f}×"),
        slow ? "straggler" + (r.contains("guard_phase") ? " (" + r["guard_phase"].get<std::string>() + ")" : "")
             : "");
  }
  return fmt::format("<p>Median of the ranks' median step: {} ms; a rank above {:.2f}× it (or named by "
                     "the stability guard's straggler report) is marked.</p>",
                     fmt_num(t["median_of_ranks_ms"], "{:.1f}"), t["threshold"].get<double>()) +
         "<table id=\"table-step-time\"><tr><th>rank</th><th>steps</th><th>median ms</th><th>mean ms</th>"
         "<th>max ms</th><th>data ms</th><th>comm ms</th><th>vs median</th><th></th></tr>" + rows +
         "</table>";
}

std::string checkpoint_section(const json& s) {
  if (s["checkpoints"].empty()) return note("no checkpoints written");
  std::string rows;
  for (const json& c : s["checkpoints"]) {
    rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", c["step"].get<int64_t>(),
                        escape_html(c["dir"].get<std::string>()),
                        c["exists"].get<bool>() ? format_bytes(c["bytes"].get<size_t>()) : "removed",
                        escape_html(c["written_at"].get<std::string>()));
  }
  return "<table id=\"table-checkpoints\"><tr><th>step</th><th>directory</th><th>size</th>"
         "<th>written (UTC)</th></tr>" + rows + "</table>";
}

// Per MoE layer over the steps: the expert-load imbalance (max / mean tokens)
// and the load-balancing statistic (1 = uniform).
std::string moe_section(const json& s) {
  if (s["moe"].empty()) return note("a dense model: no mixture-of-experts layers");
  constexpr const char* kColors[] = {kBlue, kOrange, kGreen, kRed, kGray};
  std::vector<Series> load, balance;
  size_t i = 0;
  for (const json& l : s["moe"]) {
    const std::string name = fmt::format("layer {}", l["layer"].get<int64_t>());
    const char* color = kColors[i++ % std::size(kColors)];
    load.push_back(series_of(l["step"], l["imbalance"], name, color));
    balance.push_back(series_of(l["step"], l["aux"], name, color));
  }
  return "<div class=\"grid\">" +
         line_chart("moe-load", "expert load: max / mean tokens per expert", "max / mean", load) +
         line_chart("moe-balance", "load-balancing statistic E·ΣPf (1 = uniform)", "E·ΣPf",
                    balance) +
         "</div>";
}

// Preference optimisation over the steps: the chosen and rejected rewards,
// their margin, and the pairs whose chosen reward is the higher.
std::string preference_section(const json& s) {
  const json& p = s["preference"];
  if (p.is_null()) return note("not a preference optimisation run ([dpo])");
  const json& steps = s["steps"]["step"];
  return "<div class=\"grid\">" +
         line_chart("rewards", "rewards: β (log πθ − log πref) of each response", "reward",
                    {series_of(steps, p["rewards_chosen"], "chosen", kBlue),
                     series_of(steps, p["rewards_rejected"], "rejected", kOrange),
                     series_of(steps, p["rewards_margin"], "margin", kGreen)}) +
         line_chart("reward-accuracy", "pairs whose chosen reward is the higher", "accuracy",
                    {series_of(steps, p["rewards_accuracy"], "accuracy", kBlue)}) +
         "</div>";
}

constexpr const char* kStyle = R"(
body{font-family:"DejaVu Sans",sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px} h2{font-size:16px;border-bottom:1px solid #ccc;padding-bottom:2px;margin-top:22px}
.grid{display:flex;flex-wrap:wrap;gap:8px}
table{border-collapse:collapse;font-size:12px;margin:6px 0} td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
tr.straggler{background:#fdd;font-weight:bold}
pre{background:#f6f6f6;padding:8px;font-size:11px;max-height:420px;overflow:auto}
.note{color:#666;font-style:italic} svg.plot{background:#fff;border:1px solid #eee}
)";

}  // namespace

std::string render_html(const json& s) {
  const json& st = s["steps"];
  const std::vector<Marker> markers = run_markers(s);
  std::string curves =
      line_chart("loss", "loss", "loss",
                 {series_of(st["step"], st["loss"], "train loss", kBlue),
                  series_of(s["validation"]["step"], s["validation"]["val_loss"], "validation loss", kOrange)},
                 markers) +
      line_chart("lr", "learning rate", "lr", {series_of(st["step"], st["lr"], "lr", kGreen)}) +
      line_chart("grad-norm", "gradient norm", "norm",
                 {series_of(st["step"], st["grad_norm"], "grad norm", kBlue)}, markers);
  std::string speed =
      line_chart("tokens-per-s", "throughput", "tokens/s",
                 {series_of(st["step"], st["tokens_per_s"], "tokens/s", kBlue)}) +
      line_chart("mfu", "model FLOPs utilisation", "MFU %",
                 {series_of(st["step"], st["mfu"], "MFU", kGreen, 100)});
  std::string events_text = fmt::format(
      "{} skipped step(s), {} rollback(s), {} resume(s), {} preemption(s), {} straggler report(s)",
      s["skipped_steps"].size(), s["events"]["rollback"].size(), s["events"]["resume"].size(),
      s["events"]["preempted"].size(), s["events"]["stragglers"].size());
  const std::string layout =
      s["layout"].is_null() ? fmt::format("{} rank(s)", s["ranks"].get<int>())
                            : s["layout"]["describe"].get<std::string>();
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<title>meshtrain report: {0}</title><style>{1}</style></head><body>\n"
      "<h1>meshtrain run report</h1><p id=\"run-summary\">{0} — {2}; {3} steps recorded; {4}.</p>\n",
      escape_html(s["run_dir"].get<std::string>()), kStyle, escape_html(layout), st["step"].size(),
      events_text);
  html += section("curves", "loss, learning rate, gradient norm (rank 0)", "<div class=\"grid\">" + curves + "</div>");
  html += section("throughput", "tokens/s and MFU (rank 0)", "<div class=\"grid\">" + speed + "</div>");
  html += section("memory", "memory by category: measured peak vs predicted (planner), per rank",
                  "<div class=\"grid\">" + memory_section(s) + "</div>");
  html += section("comm", "communication and exposed communication", comm_section(s));
  html += section("pipeline", "pipeline bubble: measured vs theory", pipeline_section(s));
  html += section("moe", "mixture of experts: expert load per layer", moe_section(s));
  html += section("preference", "preference optimisation: rewards and accuracy",
                  preference_section(s));
  html += section("step-time", "step time per rank (stragglers)", step_time_section(s));
  html += section("checkpoints", "checkpoints written", checkpoint_section(s));
  html += section("config",
                  s["config"].is_null() ? "resolved config"
                                        : "resolved config (from " + s["config_from"].get<std::string>() + ")",
                  s["config"].is_null() ? note("no checkpoint: the resolved config is saved with checkpoints")
                                        : "<pre id=\"config\">" + escape_html(s["config"].get<std::string>()) + "</pre>");
  html += "</body></html>\n";
  return html;
}

ReportFiles write_report(const std::string& run_dir, const std::string& html_out) {
  const json summary = summarize_run(run_dir);
  ReportFiles files;
  files.html = html_out.empty() ? (fs::path(run_dir) / "report.html").string() : html_out;
  files.json = (fs::path(files.html).parent_path() / "report.json").string();
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::trunc);
    out << text;
    out.flush();
    MESHTRAIN_CHECK_AS(ErrorKind::io, out.good(), "report: cannot write '{}'", path);
  };
  write(files.html, render_html(summary));
  write(files.json, summary.dump(1) + "\n");
  return files;
}

}  // namespace meshtrain::report

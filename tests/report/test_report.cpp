// The report's plot builders and its summary of metrics files (written here by
// hand: a resumed run, a rollback, a straggler report, a skipped step).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "meshtrain/report/run_report.h"
#include "meshtrain/report/svg.h"
#include "meshtrain/util/error.h"

namespace fs = std::filesystem;
using namespace meshtrain::report;
using nlohmann::json;

namespace {

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

fs::path temp_run(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("meshtrain_report_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_lines(const fs::path& path, const std::vector<json>& records, const std::string& tail = "") {
  std::ofstream out(path);
  for (const json& r : records) out << r.dump() << "\n";
  out << tail;
}

json step(int64_t s, double loss, double step_ms = 10, bool skipped = false) {
  json r{{"step", s}, {"loss", loss}, {"lr", 1e-3 * s}, {"grad_norm", skipped ? json(nullptr) : json(1.0 / s)},
         {"tokens_per_s", 1000.0}, {"mfu", 0.1}, {"step_ms", step_ms}, {"data_ms", 0.5},
         {"comm_ms", 2.0}, {"exposed_comm_ms", 1.0}, {"skipped", skipped}};
  if (skipped) r["skip_reason"] = "loss spike";
  return r;
}

}  // namespace

TEST(ReportSvg, NiceTicksCoverTheRangeWithRoundSteps) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(0.13, 0.61, 5), (std::vector<double>{0.2, 0.3, 0.4, 0.5, 0.6}));
  EXPECT_TRUE(nice_ticks(1, 1, 5).empty());
  EXPECT_EQ(tick_label(45000), "45k");
  EXPECT_EQ(tick_label(2.5e6), "2.5M");
  EXPECT_EQ(tick_label(0.25), "0.25");
  EXPECT_EQ(escape_html("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
}

TEST(ReportSvg, LineChartDrawsEverySeriesPointAndMarker) {
  Series a{"train <loss>", {{1, 5}, {2, 4}, {3, std::nan("")}, {4, 3}}, "#00f"};
  Series empty{"nothing", {}, "#f00"};
  const std::string svg = line_chart("loss", "loss", "loss", {a, empty}, {{2, "skipped", "#f00"}});
  EXPECT_NE(svg.find("id=\"plot-loss\""), std::string::npos);
  EXPECT_NE(svg.find("data-series=\"train &lt;loss&gt;\" data-points=\"3\""), std::string::npos) << svg;
  EXPECT_EQ(count(svg, "class=\"series\""), 1);  // the empty series draws nothing
  EXPECT_EQ(count(svg, "data-marker=\"skipped\""), 1);
  // Points in order inside the plot area (x 64..544, y 40..220): M then two L.
  std::smatch m;
  const std::string d = svg.substr(svg.find(" d=\"M"));
  ASSERT_TRUE(std::regex_search(d, m, std::regex(R"re(d="M(\S+) (\S+) L(\S+) (\S+) L(\S+) (\S+)")re")));
  EXPECT_DOUBLE_EQ(std::stod(m[1]), 64);     // x = 1: the left edge
  EXPECT_DOUBLE_EQ(std::stod(m[5]), 544);    // x = 4: the right edge
  EXPECT_LT(std::stod(m[2]), std::stod(m[6]));  // loss 5 drawn above loss 3
}

TEST(ReportSvg, BarChartBarHeightsFollowValues) {
  const std::string svg = bar_chart("mem", "memory", "MiB", {"measured", "predicted"}, {"#00f", "#f80"},
                                    {{"params", {2, 4}}, {"grads", {1, 0}}});
  EXPECT_EQ(count(svg, "class=\"bar\""), 4);
  std::regex bar(R"re(data-series="(\w+)" data-group="(\w+)" data-value="([\d.]+)" x="[\d.]+" y="[\d.]+" width="[\d.]+" height="([\d.]+)")re");
  std::map<std::string, double> height;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), bar); it != std::sregex_iterator(); ++it) {
    height[(*it)[2].str() + "/" + (*it)[1].str()] = std::stod((*it)[4]);
  }
  ASSERT_EQ(height.size(), 4u) << svg;
  EXPECT_NEAR(height["params/predicted"], 2 * height["params/measured"], 0.2);
  EXPECT_NEAR(height["params/measured"], 2 * height["grads/measured"], 0.2);
  EXPECT_LE(height["grads/predicted"], 0.5);  // zero: a hairline
}

TEST(ReportSummary, LaterRecordsWinAndEventsAreKept) {
  const fs::path dir = temp_run("resumed");
  // Rank 0 ran steps 1-3, was resumed from step 2 (redoing step 3), skipped
  // step 4 and rolled back; its last line is partial (killed while writing).
  write_lines(dir / "metrics.jsonl",
              {step(1, 5.0), step(2, 4.0), step(3, 9.0), {{"step", 2}, {"val_loss", 4.5}},
               {{"event", "resume"}, {"from", "x/step_2"}, {"step", 2}}, step(3, 3.5),
               step(4, 3.4, 10, true), {{"event", "rollback"}, {"from_step", 4}, {"to_step", 2}},
               {{"event", "stragglers"}, {"slow", {{{"rank", 1}, {"phase", "data"}}}}}},
              "{\"step\": 5, \"lo");
  write_lines(dir / "metrics.rank1.jsonl", {step(1, 5.0, 30), step(2, 4.0, 30), step(3, 3.5, 30)});
  const json s = summarize_run(dir.string());
  EXPECT_EQ(s["ranks"], 2);
  EXPECT_EQ(s["steps"]["step"], json({1, 2, 3, 4}));
  EXPECT_EQ(s["steps"]["loss"][2], 3.5);  // the redone step 3
  EXPECT_TRUE(s["steps"]["grad_norm"][3].is_null());
  EXPECT_EQ(s["skipped_steps"][0]["step"], 4);
  EXPECT_EQ(s["events"]["rollback"].size(), 1u);
  EXPECT_EQ(s["events"]["resume"].size(), 1u);
  EXPECT_EQ(s["validation"]["val_loss"], json({4.5}));
  EXPECT_TRUE(s["pipeline"].is_null());
  EXPECT_TRUE(s["config"].is_null());  // no checkpoint
  // Rank 1 is 3x the median: a straggler; named by the guard's report too.
  const json& ranks = s["step_time"]["ranks"];
  EXPECT_FALSE(ranks[0]["straggler"].get<bool>());
  EXPECT_TRUE(ranks[1]["straggler"].get<bool>());
  EXPECT_EQ(ranks[1]["guard_phase"], "data");
  EXPECT_NEAR(s["comm"][0]["comm_share"].get<double>(), 2.0 / 10.0 * 1.0, 0.05);

  const std::string html = render_html(s);
  EXPECT_NE(html.find("not a pipeline run"), std::string::npos);
  EXPECT_EQ(count(html, "data-marker=\"rollback\""), 2);  // loss and grad norm
  EXPECT_EQ(count(html, "data-marker=\"skipped\""), 2);
  EXPECT_NE(html.find("<tr class=\"straggler\" data-rank=\"1\">"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("http://www.w3.org/2000/svg\" width"), html.find("http://"));  // only the SVG namespace
}

TEST(ReportSummary, PreferenceRewardsArePlotted) {
  const fs::path dir = temp_run("preference");
  std::vector<json> records;
  for (int64_t i = 1; i <= 3; ++i) {
    json r = step(i, 0.7 - 0.01 * i);
    r["rewards_chosen"] = 0.1 * i, r["rewards_rejected"] = -0.05 * i;
    r["rewards_margin"] = 0.25 * static_cast<double>(i), r["rewards_accuracy"] = 0.5;
    records.push_back(r);
  }
  write_lines(dir / "metrics.jsonl", records);
  const json s = summarize_run(dir.string());
  EXPECT_EQ(s["preference"]["rewards_margin"], json({0.25, 0.5, 0.75}));
  const std::string html = render_html(s);
  EXPECT_NE(html.find("id=\"plot-rewards\""), std::string::npos);
  EXPECT_NE(html.find("id=\"plot-reward-accuracy\""), std::string::npos);
  // A run without [dpo] says so instead.
  write_lines(dir / "metrics.jsonl", {step(1, 5.0)});
  EXPECT_NE(render_html(summarize_run(dir.string())).find("not a preference optimisation run"),
            std::string::npos);
}

TEST(ReportSummary, NotARunIsAConfigError) {
  const fs::path dir = temp_run("empty");
  try {
    summarize_run(dir.string());
    FAIL() << "no error";
  } catch (const meshtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no metrics.jsonl"), std::string::npos) << e.what();
  }
}

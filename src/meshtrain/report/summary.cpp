// summarize_run: the metrics files, checkpoints and config of a run as one JSON.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/report/run_report.h"
#include "meshtrain/tensor/memory_tracker.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/config.h"
#include "meshtrain/util/error.h"

namespace fs = std::filesystem;

namespace meshtrain::report {
namespace {

using nlohmann::json;

// A rank's records, by kind; a step written again (after a resume or a
// rollback) replaces the earlier record.
struct RankRecords {
  std::map<int64_t, json> steps, evals;
  std::map<std::string, json> memory;  // "start" / "end": the last of each
  std::vector<json> events;
  std::vector<json> checkpoints;
};

RankRecords read_metrics(const fs::path& path) {
  RankRecords out;
  std::ifstream in(path);
  MESHTRAIN_CHECK_AS(ErrorKind::io, in.good(), "report: cannot read '{}'", path.string());
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    json r = json::parse(line, nullptr, /*allow_exceptions=*/false);
    // A run killed while writing leaves a partial last line: skip it.
    if (r.is_discarded() || !r.is_object()) continue;
    if (r.contains("event")) {
      out.events.push_back(std::move(r));
    } else if (r.contains("memory")) {
      const std::string when = r["memory"].is_string() ? r["memory"].get<std::string>() : "";
      out.memory[when] = std::move(r);
    } else if (r.contains("checkpoint")) {
      out.checkpoints.push_back(std::move(r));
    } else if (r.contains("val_loss")) {
      const int64_t step = r.value("step", int64_t{0});
      out.evals[step] = std::move(r);
    } else if (r.contains("loss") && r.contains("step")) {
      const int64_t step = r["step"].get<int64_t>();
      out.steps[step] = std::move(r);
    }
  }
  return out;
}

double num(const json& r, const char* key) {
  auto it = r.find(key);
  return it != r.end() && it->is_number() ? it->get<double>() : std::nan("");
}

json column(const std::map<int64_t, json>& records, const char* key) {
  json out = json::array();
  for (const auto& [step, r] : records) {
    const double v = num(r, key);
    out.push_back(std::isfinite(v) ? json(v) : json(nullptr));
  }
  return out;
}

double median(std::vector<double> v) {
  std::erase_if(v, [](double x) { return !std::isfinite(x); });
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Each MoE layer's routing over the steps (metrics "moe"), from the first
// rank that records it (a pipeline stage holds its layers; dp ranks agree).
template <typename Ranks>
json moe_layers(const Ranks& ranks) {
  std::map<int64_t, json> layers;
  for (const auto& [rank, rr] : ranks) {
    std::map<int64_t, json> mine;
    for (const auto& [step, r] : rr.steps) {
      if (!r.contains("moe") || !r["moe"].is_array()) continue;
      for (const json& m : r["moe"]) {
        const int64_t layer = m.value("layer", int64_t{-1});
        if (layer < 0 || layers.count(layer) != 0) continue;
        json& l = mine[layer];
        if (l.is_null()) l = {{"layer", layer}, {"step", json::array()}};
        l["step"].push_back(step);
        for (const char* key : {"imbalance", "tokens_min", "tokens_mean", "tokens_max", "aux", "z"}) {
          l[key].push_back(m.value(key, json(nullptr)));
        }
      }
    }
    layers.merge(mine);
  }
  json out = json::array();
  for (auto& [layer, l] : layers) out.push_back(std::move(l));
  return out;
}

double mean_of(const std::map<int64_t, json>& steps, const char* key) {
  double sum = 0;
  int n = 0;
  for (const auto& [step, r] : steps) {
    const double v = num(r, key);
    if (std::isfinite(v)) sum += v, ++n;
  }
  return n ? sum / n : std::nan("");
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

uintmax_t dir_bytes(const fs::path& dir) {
  uintmax_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  }
  return total;
}

std::string mtime_utc(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  std::tm tm{};
  gmtime_r(&st.st_mtime, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

}  // namespace

nlohmann::json summarize_run(const std::string& run_dir) {
  const fs::path dir(run_dir);
  MESHTRAIN_CHECK(fs::is_regular_file(dir / "metrics.jsonl"),
                  "report: '{}' has no metrics.jsonl (not a training run's out_dir)", run_dir);
  // Every rank's file: metrics.jsonl (rank 0), metrics.rank<R>.jsonl.
  std::map<int, RankRecords> ranks;
  ranks[0] = read_metrics(dir / "metrics.jsonl");
  const std::regex other(R"(metrics\.rank(\d+)\.jsonl)");
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, other)) ranks[std::stoi(m[1].str())] = read_metrics(entry.path());
  }
  const RankRecords& root = ranks.at(0);
  const int world = ranks.rbegin()->first + 1;

  json s{{"format", "meshtrain-report"}, {"version", 1}, {"run_dir", fs::absolute(dir).string()},
         {"ranks", world}};

  // Checkpoints written (rank 0's records; the latest one that still exists
  // gives the resolved config and the layout).
  json checkpoints = json::array();
  std::map<std::string, json> seen;
  for (const json& r : root.checkpoints) seen[r["checkpoint"].get<std::string>()] = r;
  std::vector<std::pair<int64_t, std::string>> by_step;
  for (const auto& [path, r] : seen) by_step.emplace_back(r.value("step", int64_t{0}), path);
  std::sort(by_step.begin(), by_step.end());
  std::string config_from;
  TrainConfig config;
  for (const auto& [step, path] : by_step) {
    const bool exists = fs::is_directory(path);
    checkpoints.push_back({{"step", step},
                           {"dir", path},
                           {"exists", exists},
                           {"bytes", exists ? dir_bytes(path) : 0},
                           {"written_at", exists ? mtime_utc(path) : ""}});
  }
  for (auto it = by_step.rbegin(); it != by_step.rend() && config_from.empty(); ++it) {
    if (!fs::is_directory(it->second)) continue;
    try {
      read_train_state(it->second, &config);
      config_from = it->second;
    } catch (const Error&) {
      // A damaged checkpoint: try the one before.
    }
  }
  s["checkpoints"] = checkpoints;
  s["config"] = config_from.empty() ? json(nullptr) : json(config_to_toml(config));
  s["config_from"] = config_from;
  std::vector<int> stage_of(static_cast<size_t>(world), 0);
  bool stages_known = false;
  if (!config_from.empty()) {
    try {
      const MeshLayout layout(world, config.parallel.tp, config.parallel.pp, config.parallel.cp);
      s["layout"] = {{"dp", layout.dp()}, {"cp", layout.cp()}, {"tp", layout.tp()}, {"pp", layout.pp()},
                     {"describe", layout.describe()}};
      for (int r = 0; r < world; ++r) stage_of[static_cast<size_t>(r)] = layout.coord(r).pp;
      stages_known = true;
    } catch (const Error&) {
      s["layout"] = nullptr;  // the config's layout does not fit the files found
    }
  } else {
    s["layout"] = nullptr;
  }

  // Rank 0's curves.
  s["steps"] = {{"step", json::array()}};
  for (const auto& [step, r] : root.steps) s["steps"]["step"].push_back(step);
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms"}) {
    s["steps"][key] = column(root.steps, key);
  }
  s["moe"] = moe_layers(ranks);
  // Preference optimisation's rewards (the step records of a [dpo] run; null otherwise).
  const bool preference = std::ranges::any_of(
      root.steps, [](const auto& entry) { return entry.second.contains("rewards_chosen"); });
  s["preference"] = nullptr;
  if (preference) {
    s["preference"] = json::object();
    for (const char* key :
         {"rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"}) {
      s["preference"][key] = column(root.steps, key);
    }
  }
  json skipped = json::array();
  for (const auto& [step, r] : root.steps) {
    if (r.value("skipped", false)) skipped.push_back({{"step", step}, {"reason", r.value("skip_reason", "")}});
  }
  s["skipped_steps"] = skipped;
  s["validation"] = {{"step", json::array()}, {"val_loss", column(root.evals, "val_loss")}};
  for (const auto& [step, r] : root.evals) s["validation"]["step"].push_back(step);
  json events = {{"rollback", json::array()}, {"resume", json::array()},
                 {"preempted", json::array()}, {"stragglers", json::array()}};
  for (const json& e : root.events) {
    const std::string kind = e["event"].get<std::string>();
    if (!events.contains(kind)) events[kind] = json::array();
    events[kind].push_back(e);
  }
  s["events"] = events;

  // Memory per rank: the end record when the run got there, else the start.
  json memory = json::array();
  for (const auto& [rank, rr] : ranks) {
    auto it = rr.memory.find("end");
    if (it == rr.memory.end()) it = rr.memory.find("start");
    if (it == rr.memory.end()) continue;
    const json& m = it->second;
    json measured, predicted;
    for (size_t c = 0; c < kMemCategories; ++c) {
      const std::string name(mem_category_name(static_cast<MemCategory>(c)));
      measured[name] = m["bytes"].value(name + "_peak", uint64_t{0});
      predicted[name] = m["predicted"].value(name, uint64_t{0});
    }
    measured["total"] = m["bytes"].value("total_peak", uint64_t{0});
    predicted["total"] = m["predicted"].value("total", uint64_t{0});
    memory.push_back({{"rank", rank}, {"when", it->first}, {"measured_peak", measured},
                      {"predicted", predicted}, {"basis", m.value("basis", json::object())}});
  }
  s["memory"] = memory;

  // Communication, pipeline and step time per rank (means over steps).
  json comm = json::array(), pipe_ranks = json::array(), times = json::array();
  bool any_comm = false, any_pipe = false;
  std::vector<double> rank_medians;
  for (const auto& [rank, rr] : ranks) {
    std::vector<double> step_ms;
    for (const auto& [step, r] : rr.steps) step_ms.push_back(num(r, "step_ms"));
    rank_medians.push_back(median(step_ms));
    const double step_mean = mean_of(rr.steps, "step_ms");
    const double comm_ms = mean_of(rr.steps, "comm_ms");
    const double exposed = mean_of(rr.steps, "exposed_comm_ms");
    // Expert parallelism's all-to-alls (all of them exposed: they block the compute).
    const double a2a_ms = mean_of(rr.steps, "ep_comm_ms");
    if (comm_ms > 0 || a2a_ms > 0) any_comm = true;
    comm.push_back({{"rank", rank},
                    {"step_ms", number_or_null(step_mean)},
                    {"comm_ms", number_or_null(comm_ms)},
                    {"exposed_comm_ms", number_or_null(exposed)},
                    {"comm_share", number_or_null(comm_ms / step_mean)},
                    {"exposed_share", number_or_null(exposed / step_mean)},
                    {"all_to_all_ms", number_or_null(a2a_ms)},
                    {"all_to_all_share", number_or_null(a2a_ms / step_mean)}});
    const bool piped = !rr.steps.empty() && rr.steps.rbegin()->second.contains("pp_bubble");
    if (piped) {
      any_pipe = true;
      pipe_ranks.push_back({{"rank", rank},
                            {"stage", stages_known ? json(stage_of[static_cast<size_t>(rank)]) : json(nullptr)},
                            {"bubble", number_or_null(mean_of(rr.steps, "pp_bubble"))},
                            {"bubble_theory", number_or_null(mean_of(rr.steps, "pp_bubble_theory"))},
                            {"busy_ms", number_or_null(mean_of(rr.steps, "pp_busy_ms"))},
                            {"wait_ms", number_or_null(mean_of(rr.steps, "pp_wait_ms"))}});
    }
    double max_ms = std::nan("");
    for (double v : step_ms) max_ms = std::isfinite(max_ms) ? std::max(max_ms, v) : v;
    times.push_back({{"rank", rank},
                     {"steps", rr.steps.size()},
                     {"median_ms", number_or_null(rank_medians.back())},
                     {"mean_ms", number_or_null(step_mean)},
                     {"max_ms", number_or_null(max_ms)},
                     {"data_ms", number_or_null(mean_of(rr.steps, "data_ms"))},
                     {"comm_ms", number_or_null(comm_ms)}});
  }
  s["comm"] = any_comm ? comm : json(nullptr);

  // A rank is a straggler when its median step is > threshold × the median
  // rank's, or when the stability guard's straggler reports named it.
  constexpr double kThreshold = 1.10;
  const double mid = median(rank_medians);
  std::map<int, std::string> named;
  for (const json& e : events["stragglers"]) {
    for (const json& slow : e.value("slow", json::array())) {
      named[slow.value("rank", -1)] = slow.value("phase", "");
    }
  }
  for (json& t : times) {
    const double rel = t["median_ms"].is_number() ? t["median_ms"].get<double>() / mid : std::nan("");
    t["relative"] = number_or_null(rel);
    const int rank = t["rank"].get<int>();
    t["straggler"] = (std::isfinite(rel) && rel > kThreshold) || named.contains(rank);
    if (named.contains(rank)) t["guard_phase"] = named[rank];
  }
  s["step_time"] = {{"threshold", kThreshold}, {"median_of_ranks_ms", number_or_null(mid)},
                    {"ranks", times}};

  if (!any_pipe) {
    s["pipeline"] = nullptr;
  } else {
    // Per stage: the mean over its ranks (every dp and tp replica of it).
    std::map<int, std::vector<const json*>> by_stage;
    for (const json& p : pipe_ranks) by_stage[p["stage"].is_number() ? p["stage"].get<int>() : -1].push_back(&p);
    json stages = json::array();
    for (const auto& [stage, members] : by_stage) {
      double bubble = 0, theory = 0;
      json member_ranks = json::array();
      for (const json* p : members) {
        bubble += (*p)["bubble"].is_number() ? (*p)["bubble"].get<double>() : 0;
        theory += (*p)["bubble_theory"].is_number() ? (*p)["bubble_theory"].get<double>() : 0;
        member_ranks.push_back((*p)["rank"]);
      }
      const double n = static_cast<double>(members.size());
      stages.push_back({{"stage", stage < 0 ? json(nullptr) : json(stage)},
                        {"ranks", member_ranks},
                        {"bubble", bubble / n},
                        {"bubble_theory", theory / n}});
    }
    s["pipeline"] = {{"stages", stages}, {"ranks", pipe_ranks}};
  }
  return s;
}

}  // namespace meshtrain::report

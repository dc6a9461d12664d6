#include "meshtrain/train/stragglers.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "meshtrain/train/metrics.h"
#include "meshtrain/util/error.h"

namespace meshtrain {
namespace {

constexpr int kFields = 5;  // StepBreakdown's, in its order

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

nlohmann::json breakdown_json(int rank, const StepBreakdown& b, int64_t steps) {
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  return {{"rank", rank},
          {"step_ms", b.step_ms / n},
          {"compute_ms", b.compute_ms / n},
          {"data_ms", b.data_ms / n},
          {"comm_wait_ms", b.comm_wait_ms / n},
          {"optimizer_ms", b.optimizer_ms / n}};
}

}  // namespace

void StepBreakdown::add(const StepRecord& r) {
  const double wait = r.exposed_comm_ms + r.pp_wait_ms;
  step_ms += r.step_ms;
  data_ms += r.data_ms;
  comm_wait_ms += wait;
  optimizer_ms += r.optimizer_ms;
  compute_ms += std::max(0.0, r.step_ms - r.data_ms - wait - r.optimizer_ms);
}

std::vector<Straggler> find_stragglers(const std::vector<StepBreakdown>& ranks, double threshold) {
  std::vector<Straggler> out;
  if (ranks.size() < 2) return out;
  auto column = [&](auto field) {
    std::vector<double> v;
    for (const StepBreakdown& b : ranks) v.push_back(field(b));
    return v;
  };
  const double own = median(column([](const StepBreakdown& b) { return b.own_ms(); }));
  struct Phase {
    const char* name;
    double (*get)(const StepBreakdown&);
  };
  const std::array<Phase, 3> phases{
      Phase{"compute", [](const StepBreakdown& b) { return b.compute_ms; }},
      Phase{"data", [](const StepBreakdown& b) { return b.data_ms; }},
      Phase{"optimizer", [](const StepBreakdown& b) { return b.optimizer_ms; }}};
  std::array<double, 3> medians{};
  for (size_t p = 0; p < phases.size(); ++p) medians[p] = median(column(phases[p].get));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const double excess = own > 0 ? ranks[r].own_ms() / own - 1 : 0;
    if (excess <= threshold) continue;
    Straggler s{static_cast<int>(r), "", excess, 0};
    for (size_t p = 0; p < phases.size(); ++p) {
      const double over = phases[p].get(ranks[r]) - medians[p];
      if (s.phase.empty() || over > s.phase_excess_ms) {
        s.phase = phases[p].name;
        s.phase_excess_ms = over;
      }
    }
    out.push_back(s);
  }
  std::sort(out.begin(), out.end(),
            [](const Straggler& a, const Straggler& b) { return a.excess > b.excess; });
  return out;
}

StragglerHook::StragglerHook(Communicator& world, MetricsLog& metrics, int64_t interval,
                             double threshold, bool console)
    : world_(world), metrics_(metrics), interval_(interval), threshold_(threshold),
      console_(console) {}

void StragglerHook::on_step(const StepRecord& record) {
  if (!warm_) {  // the first step (allocation, first touches, the loader filling) says nothing
    warm_ = true;
    return;
  }
  mine_.add(record);
  if (++steps_ < interval_) return;
  const auto start = std::chrono::steady_clock::now();
  // Each rank fills its row; a sum over the world assembles the table.
  const int n = world_.size();
  std::vector<double> table(static_cast<size_t>(n) * kFields, 0.0);
  double* row = table.data() + static_cast<size_t>(world_.rank()) * kFields;
  row[0] = mine_.step_ms;
  row[1] = mine_.compute_ms;
  row[2] = mine_.data_ms;
  row[3] = mine_.comm_wait_ms;
  row[4] = mine_.optimizer_ms;
  world_.all_reduce(table.data(), static_cast<int64_t>(table.size()), CommDType::f64,
                    ReduceOp::sum);
  std::vector<StepBreakdown> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    const double* v = table.data() + static_cast<size_t>(r) * kFields;
    ranks[static_cast<size_t>(r)] = {v[0], v[1], v[2], v[3], v[4]};
  }
  const std::vector<Straggler> slow = find_stragglers(ranks, threshold_);
  nlohmann::json all = nlohmann::json::array();
  for (int r = 0; r < n; ++r) all.push_back(breakdown_json(r, ranks[static_cast<size_t>(r)], steps_));
  nlohmann::json named = nlohmann::json::array();
  std::vector<std::string> lines;
  for (const Straggler& s : slow) {
    const double per_step = s.phase_excess_ms / static_cast<double>(steps_);
    named.push_back({{"rank", s.rank},
                     {"phase", s.phase},
                     {"excess", s.excess},
                     {"phase_excess_ms", per_step}});
    lines.push_back(fmt::format("rank {} +{:.0f}% ({} +{:.1f} ms/step)", s.rank, s.excess * 100,
                                s.phase, per_step));
  }
  const double report_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  metrics_.write({{"step", record.step},
                  {"event", "stragglers"},
                  {"steps", steps_},
                  {"report_ms", report_ms},
                  {"threshold", threshold_},
                  {"ranks", all},
                  {"slow", named}});
  if (console_ && !slow.empty()) {
    fmt::print("stragglers at step {} (last {} steps, own work vs the median rank): {}\n",
               record.step, steps_, fmt::join(lines, ", "));
    std::fflush(stdout);
  }
  mine_ = {};
  steps_ = 0;
}

SlowRankDelays slow_rank_delays(int world_rank) {
  SlowRankDelays d;
  const char* want = std::getenv("MESHTRAIN_SLOW_RANK");
  if (want == nullptr) return d;
  const std::string spec(want);
  int rank = -1;
  double ms = 0;
  char phase[16] = "data";
  const int got = std::sscanf(spec.c_str(), "%d:%lf:%15s", &rank, &ms, phase);
  const std::string p(phase);
  MESHTRAIN_CHECK(got >= 2 && ms >= 0 && (p == "data" || p == "compute" || p == "optimizer"),
                  "MESHTRAIN_SLOW_RANK must be <rank>:<ms>[:data|compute|optimizer], got '{}'",
                  spec);
  if (rank != world_rank) return d;
  (p == "data" ? d.data_ms : p == "compute" ? d.compute_ms : d.optimizer_ms) = ms;
  return d;
}

void sleep_ms(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace meshtrain

// Schedules as data: every generated schedule runs to completion when all
// ranks' lists are simulated against each other (transfers matched, one
// rank's batches completing in order), computes every (chunk, micro-batch)
// forward and backward once, in dependency order, and its bubble matches
// (p - 1) / (v * m).
#include <gtest/gtest.h>

#include <set>

#include "meshtrain/parallel/pipeline/schedule.h"
#include "meshtrain/util/error.h"

namespace meshtrain::pipeline {
namespace {

std::vector<PipelineShape> shapes(ScheduleKind kind) {
  std::vector<PipelineShape> out;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 12; ++m) {
      if (kind == ScheduleKind::interleaved && p == 1) continue;
      if (kind != ScheduleKind::interleaved) {
        out.push_back({p, m, 1});
        continue;
      }
      for (int v = 2; v <= 4; ++v) {
        if (m % p == 0) out.push_back({p, m, v});
      }
    }
  }
  return out;
}

TEST(Schedule, EveryGeneratedScheduleIsDeadlockFreeAndComplete) {
  int checked = 0;
  for (ScheduleKind kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved}) {
    for (const PipelineShape& s : shapes(kind)) {
      const Schedule schedule = make_schedule(kind, s);
      const SimResult sim = simulate(schedule, s);
      const std::string where = fmt::format("{} p {} m {} v {}", schedule_kind_name(kind),
                                            s.stages, s.micro_batches, s.virtual_stages);
      ASSERT_FALSE(sim.deadlock) << where << ": " << sim.message;
      for (int r = 0; r < s.stages; ++r) {
        std::set<std::pair<int, int>> forwards, backwards;
        for (const auto& slot : sim.compute[static_cast<size_t>(r)]) {
          const std::pair<int, int> key{slot.action.chunk, slot.action.micro_batch};
          if (slot.action.kind == ActionKind::forward) {
            ASSERT_TRUE(forwards.insert(key).second) << where << " rank " << r;
          } else {
            ASSERT_TRUE(forwards.contains(key)) << where << ": backward before forward";
            ASSERT_TRUE(backwards.insert(key).second) << where << " rank " << r;
          }
        }
        ASSERT_EQ(forwards.size(), static_cast<size_t>(s.micro_batches * s.virtual_stages))
            << where;
        ASSERT_EQ(backwards.size(), forwards.size()) << where;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 240);
}

TEST(Schedule, SimulatorFindsADeadlock) {
  // Two ranks that each wait for the other's activation before sending theirs.
  const PipelineShape s{2, 1, 1};
  Schedule bad(2);
  for (int r = 0; r < 2; ++r) {
    bad[static_cast<size_t>(r)].push_back(
        Action{ActionKind::send_recv, 0, 0, -1, {Transfer{false, false, 0, 0, 1 - r, 7 + r}}});
    bad[static_cast<size_t>(r)].push_back(Action{ActionKind::forward, 0, 0, 0, {}});
    bad[static_cast<size_t>(r)].push_back(
        Action{ActionKind::send_recv, 0, 0, -1, {Transfer{true, false, 0, 0, 1 - r, 8 - r}}});
  }
  const SimResult sim = simulate(bad, s);
  EXPECT_TRUE(sim.deadlock);
  EXPECT_NE(sim.message.find("rank 0 stuck"), std::string::npos) << sim.message;
}

TEST(Schedule, BubbleMatchesTheory) {
  // With backward = 2 forward, the simulated idle / busy is (p - 1) / (v m)
  // for 1F1B and GPipe, and close to it for interleaved.
  for (auto [kind, s, tolerance] :
       {std::tuple{ScheduleKind::gpipe, PipelineShape{4, 8, 1}, 1e-9},
        std::tuple{ScheduleKind::one_f_one_b, PipelineShape{4, 8, 1}, 1e-9},
        std::tuple{ScheduleKind::one_f_one_b, PipelineShape{2, 8, 1}, 1e-9},
        std::tuple{ScheduleKind::interleaved, PipelineShape{4, 8, 2}, 0.05},
        std::tuple{ScheduleKind::interleaved, PipelineShape{2, 8, 2}, 0.05}}) {
    const SimResult sim = simulate(make_schedule(kind, s), s);
    EXPECT_NEAR(sim.bubble(), theoretical_bubble(s), tolerance) << schedule_kind_name(kind);
  }
}

TEST(Schedule, OneFOneBHoldsAtMostPMicroBatchesOnTheFirstStage) {
  const PipelineShape s{4, 8, 1};
  for (auto [kind, expected] : {std::pair{ScheduleKind::one_f_one_b, 4}, {ScheduleKind::gpipe, 8}}) {
    const SimResult sim = simulate(make_schedule(kind, s), s);
    for (int r = 0; r < s.stages; ++r) {
      int held = 0, peak = 0;
      for (const auto& slot : sim.compute[static_cast<size_t>(r)]) {
        held += slot.action.kind == ActionKind::forward ? 1 : -1;
        peak = std::max(peak, held);
      }
      if (r == 0) {
        EXPECT_EQ(peak, expected) << schedule_kind_name(kind);
      }
      if (kind == ScheduleKind::one_f_one_b) {
        EXPECT_EQ(peak, std::min(8, s.stages - r));
      }
    }
  }
}

TEST(Schedule, TimelineShowsEachRanksCompute) {
  const PipelineShape s{2, 2, 1};
  const std::string text = format_timeline(simulate(make_schedule(ScheduleKind::one_f_one_b, s), s), s);
  // rank 0: F0 F1, then waits for B0's gradient; rank 1 starts after F0.
  EXPECT_EQ(text,
            "rank  0 | F0   F1   .    .    B0   B0   .    B1   B1  \n"
            "rank  1 | .    F0   B0   B0   F1   B1   B1   .    .   \n");
}

TEST(Schedule, ShapeErrorsNameTheConstraint) {
  auto message = [](ScheduleKind kind, PipelineShape s) {
    try {
      make_schedule(kind, s);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(ScheduleKind::interleaved, {2, 3, 2}).find("multiple of pp (2)"),
            std::string::npos);
  EXPECT_NE(message(ScheduleKind::one_f_one_b, {2, 4, 2}).find("needs schedule 'interleaved'"),
            std::string::npos);
  EXPECT_NE(message(ScheduleKind::interleaved, {2, 4, 1}).find("virtual_stages >= 2"),
            std::string::npos);
  EXPECT_THROW(parse_schedule_kind("zb"), Error);
}

}  // namespace
}  // namespace meshtrain::pipeline

// The stability guard (train/update_gate.h StabilityGuard) and straggler
// detection (train/stragglers.h): the guard's votes, window, counters,
// rollback requests and state on its own; then whole single-process runs: a
// NaN step is skipped and training continues, no checkpoint to roll back to
// ends the run as diverged, and a rollback continues exactly like a run
// resumed from that checkpoint with the data position advanced.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/data/token_file.h"
#include "meshtrain/train/stragglers.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/update_gate.h"
#include "meshtrain/util/error.h"
#include "support/checkpoint_edit.h"
#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

GuardSettings guard_settings(double loss_z, double grad_z, GuardPolicy policy) {
  GuardSettings g;
  g.max_skips = 3;
  g.window = 8;
  g.min_steps = 4;
  g.loss_z = loss_z;
  g.grad_z = grad_z;
  g.policy = policy;
  g.rollback_skip_batches = 7;
  g.max_rollbacks = 1;
  return g;
}

// A step whose loss and norm wobble around 2 and 1.
StepCheck calm(int64_t step) {
  const double wobble = (step % 3 - 1) * 0.01;
  return {step, 2.0 + wobble, 1.0 - wobble};
}

UpdateGates guard_gates(const GuardSettings& g, bool judge_non_finite = true) {
  UpdateGates gates(nullptr);
  gates.add(std::make_unique<StabilityGuard>(g, judge_non_finite));
  return gates;
}

TEST(StabilityGuard, NonFiniteStepsAreSkippedAndCountedAndEnoughInARowAskForARollback) {
  UpdateGates gates = guard_gates(guard_settings(0, 0, GuardPolicy::skip));
  EXPECT_TRUE(gates.decide(calm(1)).apply);
  GateDecision d = gates.decide({2, NAN, 1.0});
  EXPECT_FALSE(d.apply);
  EXPECT_EQ(d.reason, "non-finite loss or gradient norm");
  EXPECT_FALSE(d.rollback);
  EXPECT_FALSE(gates.decide({3, 2.0, INFINITY}).apply);
  EXPECT_EQ(gates.skipped_steps(), 2);
  // An applied step ends the run of skips: two more are not yet max_skips = 3.
  EXPECT_TRUE(gates.decide(calm(4)).apply);
  EXPECT_FALSE(gates.decide({5, NAN, NAN}).rollback);
  EXPECT_FALSE(gates.decide({6, NAN, NAN}).rollback);
  d = gates.decide({7, NAN, NAN});
  ASSERT_TRUE(d.rollback);
  EXPECT_EQ(d.rollback->skip_batches, 7);
  EXPECT_NE(d.rollback->reason.find("3 consecutive skipped steps"), std::string::npos)
      << d.rollback->reason;
  EXPECT_EQ(gates.skipped_steps(), 5);
  // guard.max_rollbacks = 1: the next one ends the run as diverged.
  for (int64_t s = 8; s <= 9; ++s) EXPECT_FALSE(gates.decide({s, NAN, NAN}).rollback);
  try {
    gates.decide({10, NAN, NAN});
    FAIL() << "a second rollback past guard.max_rollbacks";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::diverged);
    EXPECT_NE(std::string(e.what()).find("training diverged"), std::string::npos) << e.what();
  }
}

TEST(StabilityGuard, UnderFp16TheLossScalerOwnsOverflows) {
  UpdateGates gates = guard_gates(guard_settings(0, 0, GuardPolicy::skip), false);
  EXPECT_TRUE(gates.decide({1, NAN, INFINITY}).apply);  // no other gate here: applied
}

TEST(StabilityGuard, SpikesOverTheWindowAreSkippedAndStayOutOfIt) {
  UpdateGates gates = guard_gates(guard_settings(6, 6, GuardPolicy::skip));
  // Before min_steps applied steps nothing is judged, however large.
  EXPECT_TRUE(gates.decide(calm(1)).apply);
  EXPECT_TRUE(gates.decide({2, 50.0, 1.0}).apply);
  for (int64_t s = 3; s <= 12; ++s) EXPECT_TRUE(gates.decide(calm(s)).apply) << s;  // 50 leaves
  GateDecision d = gates.decide({13, 2.5, 1.0});
  EXPECT_FALSE(d.apply);
  EXPECT_EQ(d.reason, "loss spike");
  EXPECT_FALSE(d.rollback);  // policy skip
  d = gates.decide({14, 2.0, 3.0});
  EXPECT_EQ(d.reason, "gradient-norm spike");
  // The spikes did not enter the window: the same spike is still one.
  EXPECT_FALSE(gates.decide({15, 2.5, 1.0}).apply);
  EXPECT_TRUE(gates.decide(calm(16)).apply);  // and a calm step resets the count
  const nlohmann::json state = gates.state().at("guard");
  EXPECT_EQ(state.at("spikes"), 3);
  EXPECT_EQ(state.at("consecutive_skips"), 0);
  EXPECT_EQ(state.at("losses").size(), 8u);  // guard.window
}

TEST(StabilityGuard, UnderPolicyRollbackASpikeAsksForOneAtOnce) {
  UpdateGates gates = guard_gates(guard_settings(0, 6, GuardPolicy::rollback));
  for (int64_t s = 1; s <= 5; ++s) EXPECT_TRUE(gates.decide(calm(s)).apply);
  const GateDecision d = gates.decide({6, 2.0, 40.0});
  EXPECT_FALSE(d.apply);
  ASSERT_TRUE(d.rollback);
  EXPECT_EQ(d.rollback->reason, "gradient-norm spike at step 6");
  // A non-finite step under policy rollback is skipped (max_skips decides).
  EXPECT_FALSE(gates.decide({7, NAN, 1.0}).rollback);
}

TEST(StabilityGuard, StateRoundTripsAndRejectsBadValues) {
  UpdateGates a = guard_gates(guard_settings(6, 0, GuardPolicy::skip));
  for (int64_t s = 1; s <= 5; ++s) a.decide(calm(s));
  a.decide({6, NAN, 1.0});
  UpdateGates b = guard_gates(guard_settings(6, 0, GuardPolicy::skip));
  b.load_state(a.state(), "step_6");
  EXPECT_EQ(b.state(), a.state());
  // The same window: the same verdicts from here on.
  for (const StepCheck& c : {StepCheck{7, 2.5, 1.0}, calm(8), StepCheck{9, 2.001, 1.0}}) {
    EXPECT_EQ(a.decide(c).apply, b.decide(c).apply) << c.step;
  }
  nlohmann::json bad = a.state();
  bad["guard"]["losses"].push_back(1.0);  // longer than norms
  EXPECT_THROW(b.load_state(bad, "step_6"), Error);
  bad = a.state();
  bad["guard"]["spikes"] = -1;
  EXPECT_THROW(b.load_state(bad, "step_6"), Error);
}

StepBreakdown breakdown(double compute, double data, double wait, double optimizer) {
  return {compute + data + wait + optimizer, compute, data, wait, optimizer};
}

TEST(Stragglers, TheSlowRankIsNamedWithThePhaseThatMakesItSlow) {
  // Rank 2 loads data slowly; the others wait for it in communication.
  std::vector<StepBreakdown> ranks{breakdown(10, 1, 30, 2), breakdown(10, 1, 31, 2),
                                   breakdown(10, 31, 0, 2), breakdown(11, 1, 29, 2)};
  std::vector<Straggler> slow = find_stragglers(ranks, 0.2);
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].rank, 2);
  EXPECT_EQ(slow[0].phase, "data");
  EXPECT_NEAR(slow[0].phase_excess_ms, 30, 1e-9);
  // Rank 1's optimizer instead.
  ranks = {breakdown(10, 1, 20, 2), breakdown(10, 1, 0, 22), breakdown(10, 1, 20, 2)};
  slow = find_stragglers(ranks, 0.2);
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].rank, 1);
  EXPECT_EQ(slow[0].phase, "optimizer");
  // Within the threshold nobody is named; one rank has no median to compare with.
  ranks = {breakdown(10, 1, 1, 2), breakdown(11, 1, 0, 2)};
  EXPECT_TRUE(find_stragglers(ranks, 0.2).empty());
  EXPECT_TRUE(find_stragglers({breakdown(10, 90, 0, 0)}, 0.2).empty());
}

class GuardRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::scratch_dir();
    write_token_file((dir_ / "train.bin").string(), testing::phrase_tokens(3000, 64));
    write_token_file((dir_ / "val.bin").string(), testing::phrase_tokens(600, 64));
  }
  void TearDown() override {
    for (const char* var : {"MESHTRAIN_INJECT_NAN", "MESHTRAIN_INJECT_SPIKE"}) ::unsetenv(var);
  }
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    return testing::tiny_run_config(R"(
[model]
family = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 64
vocab_size = 64
max_seq_len = 32
[train]
steps = 10
batch_size = 4
seq_len = 16
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = 4
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[data]
)",
                                    dir_.string(), out, std::move(extra), "guard.toml");
  }
  std::vector<nlohmann::json> events(const std::string& out, const std::string& kind) const {
    std::ifstream in(dir_ / out / "metrics.jsonl");
    std::vector<nlohmann::json> found;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("event", "") == kind) found.push_back(j);
    }
    return found;
  }
  fs::path dir_;
};

TEST_F(GuardRun, ANanStepIsSkippedAndTrainingContinues) {
  const testing::TrainerRun ref = testing::run_trainer(config("ref", {{"train.steps", "2"}}));
  ::setenv("MESHTRAIN_INJECT_NAN", "3@0", 1);
  const testing::TrainerRun hit = testing::run_trainer(config("hit", {{"train.steps", "3"}}));
  ASSERT_EQ(hit.records.size(), 3u);
  EXPECT_TRUE(hit.records[2].skipped);
  EXPECT_EQ(hit.records[2].skip_reason, "non-finite loss or gradient norm");
  EXPECT_EQ(hit.records[2].skipped_steps, 1);
  EXPECT_EQ(hit.weights, ref.weights);  // the NaN step changed nothing
  const testing::TrainerRun on = testing::run_trainer(config("on", {{"train.steps", "5"}}));
  EXPECT_TRUE(std::isfinite(on.records[4].loss));
  EXPECT_FALSE(on.records[4].skipped);
}

TEST_F(GuardRun, WithoutACheckpointARollbackEndsTheRunAsDiverged) {
  ::setenv("MESHTRAIN_INJECT_NAN", "2-9@0", 1);
  try {
    testing::run_trainer(config("none", {{"train.checkpoint_interval", "-1"},
                                         {"guard.max_skips", "3"}}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::diverged);
    EXPECT_NE(std::string(e.what()).find("step 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no checkpoint"), std::string::npos) << e.what();
  }
}

// The documented state: a rollback at step R to the checkpoint of step C
// continues like a run resumed from that checkpoint whose data position is
// moved to batch R + 1 + guard.rollback_skip_batches.
void expect_rollback_like_advanced_resume(const TrainConfig& rolled,
                                          const testing::TrainerRun& a, int64_t from,
                                          int64_t to, int64_t skip, const fs::path& dir) {
  ASSERT_EQ(a.records.size(), static_cast<size_t>(10 + from - to));
  const StepRecord& r = a.records[static_cast<size_t>(from - 1)];
  EXPECT_TRUE(r.rolled_back);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.rollback_to_step, to);
  EXPECT_EQ(r.rollback_skipped_batches, from - to + skip);
  EXPECT_EQ(a.records[static_cast<size_t>(from)].step, to + 1);
  // B: the checkpoint, its data position moved past the window.
  const fs::path b_dir = dir / "advanced";
  fs::create_directories(b_dir);
  fs::copy(fs::path(rolled.train.out_dir) / step_dir_name(to), b_dir / step_dir_name(to),
           fs::copy_options::recursive);
  // Batch from + skip + 1, within epoch 0.
  testing::set_checkpoint_data_position((b_dir / step_dir_name(to)).string(), 0,
                                        (from + skip) * rolled.train.batch_size);
  TrainConfig b_config = rolled;
  b_config.train.out_dir = b_dir.string();
  const testing::TrainerRun b =
      testing::run_trainer(b_config, nullptr, (b_dir / step_dir_name(to)).string());
  ASSERT_EQ(b.records.size(), static_cast<size_t>(10 - to));
  for (size_t i = 0; i < b.records.size(); ++i) {
    EXPECT_EQ(a.records[static_cast<size_t>(from) + i].loss, b.records[i].loss) << "step " << i;
  }
  EXPECT_EQ(a.weights, b.weights);
}

TEST_F(GuardRun, ASpikeUnderPolicyRollbackReloadsTheCheckpointAndSkipsTheWindow) {
  ::setenv("MESHTRAIN_INJECT_SPIKE", "7@0", 1);
  const TrainConfig c = config("spike", {{"guard.grad_z", "50"},
                                         {"guard.min_steps", "3"},
                                         {"guard.window", "10"},
                                         {"guard.policy", "rollback"},
                                         {"guard.rollback_skip_batches", "2"}});
  const testing::TrainerRun a = testing::run_trainer(c);
  ::unsetenv("MESHTRAIN_INJECT_SPIKE");
  EXPECT_EQ(a.records[6].skip_reason, "gradient-norm spike");
  expect_rollback_like_advanced_resume(c, a, 7, 4, 2, dir_);
  const std::vector<nlohmann::json> rollbacks = events("spike", "rollback");
  ASSERT_EQ(rollbacks.size(), 1u);
  EXPECT_EQ(rollbacks[0]["from_step"], 7);
  EXPECT_EQ(rollbacks[0]["to_step"], 4);
  EXPECT_EQ(rollbacks[0]["skipped_batches"], 5);
  EXPECT_EQ(rollbacks[0]["reason"], "gradient-norm spike at step 7");
}

TEST_F(GuardRun, ASpikeUnderPolicySkipIsSkipped) {
  ::setenv("MESHTRAIN_INJECT_SPIKE", "7@0", 1);
  const testing::TrainerRun a = testing::run_trainer(
      config("skip", {{"guard.grad_z", "50"}, {"guard.min_steps", "3"}, {"train.steps", "8"}}));
  ASSERT_EQ(a.records.size(), 8u);
  for (size_t i = 0; i < a.records.size(); ++i) {
    EXPECT_EQ(a.records[i].skipped, i == 6) << "step " << i + 1;
  }
  EXPECT_EQ(a.records[6].skip_reason, "gradient-norm spike");
}

TEST_F(GuardRun, MaxSkipsInARowRollBack) {
  ::setenv("MESHTRAIN_INJECT_NAN", "6-7@0", 1);
  const TrainConfig c = config("skips", {{"guard.max_skips", "2"}});
  const testing::TrainerRun a = testing::run_trainer(c);
  ::unsetenv("MESHTRAIN_INJECT_NAN");
  EXPECT_TRUE(a.records[5].skipped);
  EXPECT_FALSE(a.records[5].rolled_back);
  expect_rollback_like_advanced_resume(c, a, 7, 4, 0, dir_);
}

}  // namespace
}  // namespace meshtrain

// The stability guard and straggler detection under mpirun (fp32: the guard
// is the only gate). A NaN in ONE rank's gradients (after the gradient sync,
// so no collective carries it to its peers) skips the step on every rank —
// dp, tp 2, pp 2, ZeRO 1 and 3 — and the weights equal the run stopped before it; a
// gradient spike on one rank under policy rollback rolls every rank back and
// the run then equals one resumed from that checkpoint with the data moved
// past the window; no checkpoint ends every rank as diverged (no hang). A rank
// made slow for real (MESHTRAIN_SLOW_RANK) is named with its phase.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "mpi_test.h"
#include "support/checkpoint_edit.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using testing::mpi_env;

class StabilityMesh : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::shared_phrase_corpus(*world_, 61); }
  void TearDown() override {
    for (const char* var : {"MESHTRAIN_INJECT_NAN", "MESHTRAIN_INJECT_SPIKE", "MESHTRAIN_SLOW_RANK"}) {
      ::unsetenv(var);
    }
  }

  TrainConfig config(const std::string& out, ConfigOverrides extra) const {
    return testing::tiny_run_config(R"(
[model]
family = "gpt2"
dim = 32
n_layers = 2
n_heads = 4
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
[train]
batch_size = 8
micro_batch_size = 2
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
[data]
tokenizer = "bytes"
)",
                                    dir_, out, std::move(extra), "stability.toml");
  }

  // This rank's metrics records of `out` with "event" = `kind`.
  std::vector<nlohmann::json> events(const std::string& out, const std::string& kind) const {
    std::ifstream in(dir_ + "/" + out + "/" + metrics_file_name(world_->rank()));
    std::vector<nlohmann::json> found;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("event", "") == kind) found.push_back(j);
    }
    return found;
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(StabilityMesh, NanOnOneRankIsSkippedOnEveryRank) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  const int last = world_->size() - 1;  // the rank whose gradients hold the NaN
  struct Layout {
    int tp, pp;
  };
  for (Layout l : {Layout{1, 1}, Layout{2, 1}, Layout{1, 2}}) {
    const std::string name = fmt::format("tp{}_pp{}", l.tp, l.pp);
    SCOPED_TRACE(name + " of " + std::to_string(world_->size()) + " ranks");
    DeviceMesh mesh(*world_, l.tp, l.pp);
    const ConfigOverrides layout{{"parallel.tp", std::to_string(l.tp)},
                                 {"parallel.pp", std::to_string(l.pp)}};
    ConfigOverrides three = layout, two = layout;
    three.push_back({"train.steps", "3"});
    two.push_back({"train.steps", "2"});  // warmup 5: the same LRs for steps 1, 2
    ::setenv("MESHTRAIN_INJECT_NAN", fmt::format("3@{}", last).c_str(), 1);
    const testing::TrainerRun hit = testing::run_trainer(config("hit_" + name, three), &mesh);
    ::unsetenv("MESHTRAIN_INJECT_NAN");
    const testing::TrainerRun ref = testing::run_trainer(config("ref_" + name, two), &mesh);
    ASSERT_EQ(hit.records.size(), 3u);
    EXPECT_FALSE(hit.records[1].skipped);
    EXPECT_TRUE(hit.records[2].skipped) << "rank " << world_->rank();
    EXPECT_EQ(hit.records[2].skip_reason, "non-finite loss or gradient norm");
    EXPECT_EQ(hit.records[2].skipped_steps, 1);
    // Gathered over the mesh: no rank applied step 3.
    EXPECT_EQ(hit.weights, ref.weights) << "rank " << world_->rank();
  }
}

// ZeRO's gradients are shards: the fault goes into the rank's shards.
TEST_F(StabilityMesh, NanInOneRanksZeroShardsIsSkippedOnEveryRank) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 1);
  for (const char* zero : {"1", "3"}) {
    SCOPED_TRACE(std::string("zero ") + zero);
    ::setenv("MESHTRAIN_INJECT_NAN", fmt::format("3@{}", world_->size() - 1).c_str(), 1);
    const testing::TrainerRun hit = testing::run_trainer(
        config(std::string("zhit") + zero, {{"train.steps", "3"}, {"parallel.zero", zero}}), &mesh);
    ::unsetenv("MESHTRAIN_INJECT_NAN");
    const testing::TrainerRun ref = testing::run_trainer(
        config(std::string("zref") + zero, {{"train.steps", "2"}, {"parallel.zero", zero}}), &mesh);
    ASSERT_EQ(hit.records.size(), 3u);
    EXPECT_TRUE(hit.records[2].skipped) << "rank " << world_->rank();
    EXPECT_EQ(hit.weights, ref.weights) << "rank " << world_->rank();
  }
}

TEST_F(StabilityMesh, TrainingContinuesAfterTheSkip) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 1);
  ::setenv("MESHTRAIN_INJECT_NAN", fmt::format("3@{}", world_->size() - 1).c_str(), 1);
  const testing::TrainerRun hit = testing::run_trainer(config("on", {{"train.steps", "5"}}), &mesh);
  ASSERT_EQ(hit.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(hit.records[i].skipped, i == 2) << "step " << i + 1;
    if (i != 2) {
      EXPECT_TRUE(std::isfinite(hit.records[i].grad_norm)) << "step " << i + 1;
    }
  }
  EXPECT_LT(hit.records[4].loss, hit.records[0].loss);
}

TEST_F(StabilityMesh, SpikeOnOneRankRollsEveryRankBackToTheDocumentedState) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  struct Layout {
    const char* name;
    int pp;
    const char* zero;
  };
  // DDP, a pipeline (each stage reloads its layers), ZeRO 3 (the shards).
  for (Layout l : {Layout{"ddp", 1, "0"}, Layout{"pp2", 2, "0"}, Layout{"zero3", 1, "3"}}) {
    SCOPED_TRACE(l.name);
    DeviceMesh mesh(*world_, 1, l.pp);
    const ConfigOverrides rollback{{"train.steps", "10"},
                                   {"train.checkpoint_interval", "4"},
                                   {"parallel.pp", std::to_string(l.pp)},
                                   {"parallel.zero", l.zero},
                                   {"guard.grad_z", "50"},
                                   {"guard.min_steps", "3"},
                                   {"guard.window", "10"},
                                   {"guard.policy", "rollback"},
                                   {"guard.rollback_skip_batches", "2"}};
    const std::string out = std::string("spike_") + l.name;
    const TrainConfig c = config(out, rollback);
    ::setenv("MESHTRAIN_INJECT_SPIKE", fmt::format("7@{}", world_->size() - 1).c_str(), 1);
    const testing::TrainerRun a = testing::run_trainer(c, &mesh);
    ::unsetenv("MESHTRAIN_INJECT_SPIKE");
    // Steps 1..7 (7 rolled back to 4), then 5..10 again.
    ASSERT_EQ(a.records.size(), 13u);
    EXPECT_TRUE(a.records[6].rolled_back) << "rank " << world_->rank();
    EXPECT_EQ(a.records[6].skip_reason, "gradient-norm spike");
    EXPECT_EQ(a.records[6].rollback_to_step, 4);
    EXPECT_EQ(a.records[6].rollback_skipped_batches, 5);  // batches 5..7, then 8 and 9
    const std::vector<nlohmann::json> rollbacks = events(out, "rollback");
    ASSERT_EQ(rollbacks.size(), 1u);
    EXPECT_EQ(rollbacks[0]["from_step"], 7);
    EXPECT_EQ(rollbacks[0]["to_step"], 4);
    // B: step 4's checkpoint with the data at batch 10, resumed normally.
    const std::string b_out = dir_ + "/advanced_" + l.name;
    const std::string b_step = b_out + "/" + step_dir_name(4);
    if (world_->rank() == 0) {
      fs::create_directories(b_out);
      fs::copy(c.train.out_dir + "/" + step_dir_name(4), b_step, fs::copy_options::recursive);
      testing::set_checkpoint_data_position(b_step, 0, 9 * c.train.batch_size);
    }
    world_->barrier();
    TrainConfig b_config = c;
    b_config.train.out_dir = b_out;
    const testing::TrainerRun b = testing::run_trainer(b_config, &mesh, b_step);
    ASSERT_EQ(b.records.size(), 6u);
    for (size_t i = 0; i < b.records.size(); ++i) {
      EXPECT_EQ(a.records[7 + i].loss, b.records[i].loss) << "step " << 5 + i;
    }
    EXPECT_EQ(a.weights, b.weights) << "rank " << world_->rank();
  }
}

TEST_F(StabilityMesh, WithoutACheckpointEveryRankEndsAsDiverged) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 1);
  ::setenv("MESHTRAIN_INJECT_NAN", fmt::format("2-9@{}", world_->size() - 1).c_str(), 1);
  ErrorKind kind = ErrorKind::config;
  try {
    testing::run_trainer(config("diverged", {{"train.steps", "6"}, {"guard.max_skips", "2"}}),
                         &mesh);
  } catch (const Error& e) {
    kind = e.kind();
    EXPECT_NE(std::string(e.what()).find("no checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kind, ErrorKind::diverged) << "rank " << world_->rank();
}

TEST_F(StabilityMesh, ASlowRankIsNamedWithItsPhase) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 1);
  const int last = world_->size() - 1;
  // Reports after steps 4 and 7 (step 1, warm-up, is left out).
  const ConfigOverrides stragglers{{"train.steps", "7"},
                                   {"train.straggler_interval", "3"},
                                   {"train.straggler_threshold", "0.5"}};
  struct Case {
    const char* phase;
    double ms;
  };
  for (Case k : {Case{"data", 40}, Case{"compute", 80}, Case{"optimizer", 80}}) {
    SCOPED_TRACE(k.phase);
    ::setenv("MESHTRAIN_SLOW_RANK", fmt::format("{}:{}:{}", last, k.ms, k.phase).c_str(), 1);
    const std::string out = std::string("slow_") + k.phase;
    testing::run_trainer(config(out, stragglers), &mesh);
    ::unsetenv("MESHTRAIN_SLOW_RANK");
    const std::vector<nlohmann::json> reports = events(out, "stragglers");
    ASSERT_EQ(reports.size(), 2u);
    for (const nlohmann::json& r : reports) {
      ASSERT_EQ(r["ranks"].size(), static_cast<size_t>(world_->size()));
      // The slowest named first (on the loaded test machine a descheduled
      // rank may be named too).
      ASSERT_GE(r["slow"].size(), 1u) << r.dump();
      EXPECT_EQ(r["slow"][0]["rank"], last) << r.dump();
      EXPECT_EQ(r["slow"][0]["phase"], k.phase) << r.dump();
    }
  }
  // A normal run: nobody at three times the median rank's own work (2 cores
  // shared by 4 ranks and other jobs: 2x happens when a rank is descheduled).
  testing::run_trainer(config("normal", {{"train.steps", "7"},
                                         {"train.straggler_interval", "3"},
                                         {"train.straggler_threshold", "2.0"}}),
                       &mesh);
  for (const nlohmann::json& r : events("normal", "stragglers")) {
    EXPECT_TRUE(r["slow"].empty()) << r.dump();
  }
}

}  // namespace
}  // namespace meshtrain

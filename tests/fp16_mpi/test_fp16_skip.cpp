// fp16 under mpirun. An Inf injected into ONE rank's gradients
// (MESHTRAIN_INJECT_INF, after the gradient sync, so no collective carries it
// to the dp peers) skips that step on every rank of the mesh — dp only, tp 2
// and pp 2 — the skip is in every rank's metrics, and the weights equal those
// of the same run stopped before that step. And ZeRO 1/3 and sequence
// parallelism in fp16 skip and train like the replicated run.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class Fp16Mesh : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::shared_phrase_corpus(*world_, 61); }

  TrainConfig config(const std::string& out, ConfigOverrides extra) const {
    extra.push_back({"train.precision", "fp16"});
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
                                    dir_, out, std::move(extra), "fp16.toml");
  }

  // This rank's metrics records of `out` that are steps.
  std::vector<nlohmann::json> step_lines(const std::string& out) const {
    std::ifstream in(dir_ + "/" + out + "/" + metrics_file_name(world_->rank()));
    std::vector<nlohmann::json> lines;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) lines.push_back(j);
    }
    return lines;
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(Fp16Mesh, InfOnOneRankSkipsTheStepOnEveryRank) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  const int last = world_->size() - 1;  // the rank that overflows
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
    two.push_back({"train.steps", "2"});
    ::setenv("MESHTRAIN_INJECT_INF", fmt::format("3@{}", last).c_str(), 1);
    const testing::TrainerRun hit = testing::run_trainer(config("hit_" + name, three), &mesh);
    ::unsetenv("MESHTRAIN_INJECT_INF");
    const testing::TrainerRun ref = testing::run_trainer(config("ref_" + name, two), &mesh);

    ASSERT_EQ(hit.records.size(), 3u);
    EXPECT_FALSE(hit.records[0].skipped);
    EXPECT_FALSE(hit.records[1].skipped);
    EXPECT_TRUE(hit.records[2].skipped) << "rank " << world_->rank();
    EXPECT_EQ(hit.records[2].skip_reason, "gradient overflow");
    EXPECT_EQ(hit.records[2].skipped_steps, 1);
    // Gathered over the mesh: no rank applied step 3.
    EXPECT_EQ(hit.weights, ref.weights) << "rank " << world_->rank();
    const std::vector<nlohmann::json> lines = step_lines("hit_" + name);
    ASSERT_EQ(lines.size(), 3u);
    EXPECT_EQ(lines[2]["skipped"], true);
    EXPECT_EQ(lines[2]["skipped_steps"], 1);
    EXPECT_EQ(lines[2]["skip_reason"], "gradient overflow");
    EXPECT_EQ(lines[1]["skipped"], false);
    EXPECT_EQ(lines[2]["loss_scale"], 65536.0);
  }
}

// fp16 through ZeRO 1 / 3 (f16 flat parameters: compute shards, f16
// gathers) and tp 2 with sequence parallelism (f16 row gathers): from scale
// 2^24 they skip the same first steps as DDP / tp without it, and their loss
// traces stay within 1e-3 of them (reduction orders differ, then f16 rounding).
TEST_F(Fp16Mesh, ZeroAndSequenceParallelSkipAndTrainLikeTheReplicatedRun) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  auto expect_like = [](const testing::TrainerRun& got, const testing::TrainerRun& ref,
                        const std::string& what) {
    ASSERT_EQ(got.records.size(), ref.records.size()) << what;
    EXPECT_TRUE(ref.records[0].skipped) << what;
    for (size_t i = 0; i < ref.records.size(); ++i) {
      EXPECT_EQ(got.records[i].skipped, ref.records[i].skipped) << what << " step " << i + 1;
      EXPECT_EQ(got.records[i].loss_scale, ref.records[i].loss_scale) << what << " step " << i + 1;
      EXPECT_NEAR(got.records[i].loss, ref.records[i].loss, 1e-3 * ref.records[i].loss)
          << what << " step " << i + 1;
    }
  };
  const ConfigOverrides base{{"train.steps", "6"}, {"train.loss_scale_init", "16777216.0"}};
  {
    DeviceMesh mesh(*world_, 1, 1);
    const testing::TrainerRun ddp = testing::run_trainer(config("ddp", base), &mesh);
    for (const char* zero : {"1", "3"}) {
      ConfigOverrides z = base;
      z.push_back({"parallel.zero", zero});
      expect_like(testing::run_trainer(config(std::string("zero") + zero, z), &mesh), ddp,
                  std::string("zero ") + zero);
    }
  }
  if (world_->size() % 2 == 0) {
    DeviceMesh mesh(*world_, 2, 1);
    ConfigOverrides tp = base;
    tp.push_back({"parallel.tp", "2"});
    const testing::TrainerRun plain = testing::run_trainer(config("tp", tp), &mesh);
    tp.push_back({"parallel.sequence_parallel", "true"});
    expect_like(testing::run_trainer(config("tp_sp", tp), &mesh), plain, "tp 2 sequence parallel");
  }
}

}  // namespace
}  // namespace meshtrain

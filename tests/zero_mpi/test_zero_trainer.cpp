// The Trainer with parallel.zero under mpirun: whole runs (loader, eval,
// clipping, schedule) equal to the single-rank run, checkpoints written by
// rank 0 from the gathered shards and resumed under another stage, disk
// offload through the config.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/scratch.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;
using testing::run_trainer;

class ZeroTrainer : public ::testing::Test {
 protected:
  using Run = testing::TrainerRun;  // (hides ::testing::Test::Run)

  void SetUp() override {
    dir_ = testing::shared_phrase_corpus(*world_, 61);
  }

  // vocab 61 and an odd MLP width: padded flat parameters at dp 2, 3, 4.
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    return testing::tiny_run_config(R"(
[model]
family = "gpt2"
dim = 32
n_layers = 2
n_heads = 4
hidden_dim = 45
vocab_size = 61
max_seq_len = 32
[train]
steps = 10
batch_size = 12
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 5
eval_batches = 1
peak_flops = 1e11
checkpoint_interval = -1
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[data]
tokenizer = "bytes"
)",
                                    dir_, out, std::move(extra), "zero.toml");
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(ZeroTrainer, EveryStageMatchesTheSingleRankRun) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run ref = run_trainer(config("ref.rank" + std::to_string(world_->rank())), nullptr);
  for (const char* stage : {"1", "2", "3"}) {
    for (const char* micro : {"12", "1"}) {
      const Run z = run_trainer(
          config(std::string("zero") + stage + "_" + micro,
                 {{"parallel.zero", stage}, {"train.micro_batch_size", micro}}),
          &mesh);
      ASSERT_EQ(z.records.size(), ref.records.size());
      for (size_t i = 0; i < ref.records.size(); ++i) {
        EXPECT_NEAR(z.records[i].loss, ref.records[i].loss, 1e-5 * ref.records[i].loss)
            << "stage " << stage << " micro " << micro << " step " << i + 1;
        EXPECT_NEAR(z.records[i].grad_norm, ref.records[i].grad_norm,
                    1e-5 * ref.records[i].grad_norm);
        if (world_->size() > 1) {
          EXPECT_GT(z.records[i].comm_bytes, 0u);
        }
      }
      // The key bias's gradient is rounding noise (see zero_run.h): a loose bound.
      float worst = 0;
      for (size_t i = 0; i < ref.weights.size(); ++i) {
        worst = std::max(worst, std::fabs(z.weights[i] - ref.weights[i]));
      }
      EXPECT_LE(worst, 1e-2f) << "stage " << stage;
    }
  }
}

// Every rank writes its own shards; a run of another stage resumes from
// them and continues bit for bit (one micro-batch per
// rank: every stage computes the same bits).
TEST_F(ZeroTrainer, CheckpointFromStage3ResumesUnderStage1BitForBit) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run full = run_trainer(
      config("full", {{"parallel.zero", "3"}, {"train.checkpoint_interval", "5"}}), &mesh);
  world_->barrier();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/full/step_5/manifest.json"));
  const Run rest =
      run_trainer(config("rest", {{"parallel.zero", "1"}}), &mesh, dir_ + "/full/step_5");
  ASSERT_EQ(rest.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rest.records[i].loss, full.records[5 + i].loss) << "step " << 6 + i;
  }
  EXPECT_EQ(std::memcmp(rest.weights.data(), full.weights.data(), full.weights.size() * 4), 0);
}

TEST_F(ZeroTrainer, DiskOffloadFromTheConfigChangesNoBit) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run resident = run_trainer(config("resident", {{"parallel.zero", "2"}}), &mesh);
  const Run disk = run_trainer(config("disk", {{"parallel.zero", "2"},
                                               {"parallel.offload", "disk"},
                                               {"parallel.offload_budget_mb", "1"}}),
                               &mesh);
  for (size_t i = 0; i < resident.records.size(); ++i) {
    EXPECT_EQ(disk.records[i].loss, resident.records[i].loss) << "step " << i + 1;
  }
  EXPECT_EQ(std::memcmp(disk.weights.data(), resident.weights.data(), disk.weights.size() * 4), 0);
}

}  // namespace
}  // namespace meshtrain

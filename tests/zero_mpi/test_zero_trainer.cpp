// The Trainer with parallel.zero under mpirun: whole runs (loader, eval,
// clipping, schedule) equal to the single-rank run, checkpoints written by
// rank 0 from the gathered shards and resumed under another stage, disk
// offload through the config.
#include <fmt/format.h>
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

// ZeRO-3 with the parameter shards on disk (budget 0.15 MiB (two pieces), below the rank's model
// state): the whole run (evaluation every 5 steps included) equals the resident one bit
// for bit, with the records' offload traffic; its checkpoint resumes bit for bit in the
// resident layout, and a resident checkpoint resumes with parameters on disk.
TEST_F(ZeroTrainer, ParamsOnDiskEqualResidentAndCheckpointsCrossLayouts) {
  DeviceMesh mesh(*world_, 1, 1);
  const ConfigOverrides disk{{"parallel.zero", "3"},
                             {"parallel.offload", "disk"},
                             {"parallel.offload_budget_mb", "0.15"},
                             {"train.micro_batch_size", "1"}};
  ConfigOverrides c = disk;
  c.push_back({"train.checkpoint_interval", "5"});
  const Run on_disk = run_trainer(config("p_disk", c), &mesh, "", true);
  const Run resident = run_trainer(config("p_resident", {{"parallel.zero", "3"},
                                                         {"train.micro_batch_size", "1"},
                                                         {"train.checkpoint_interval", "5"}}),
                                   &mesh, "", true);
  ASSERT_EQ(on_disk.records.size(), resident.records.size());
  for (size_t i = 0; i < resident.records.size(); ++i) {
    EXPECT_EQ(on_disk.records[i].loss, resident.records[i].loss) << "step " << i + 1;
    EXPECT_EQ(on_disk.records[i].grad_norm, resident.records[i].grad_norm) << "step " << i + 1;
    EXPECT_TRUE(on_disk.records[i].offloaded);
    EXPECT_GT(on_disk.records[i].offload_read_bytes, 0u);
    EXPECT_GT(on_disk.records[i].offload_written_bytes, 0u);
    EXPECT_FALSE(resident.records[i].offloaded);
  }
  EXPECT_EQ(on_disk.val_loss, resident.val_loss);
  EXPECT_EQ(std::memcmp(on_disk.weights.data(), resident.weights.data(),
                        resident.weights.size() * 4),
            0);
  world_->barrier();
  // Parameters on disk -> resident (stage 3: with accumulation the stages add in
  // different orders; CheckpointFromStage3ResumesUnderStage1BitForBit covers the stages).
  const Run rest = run_trainer(config("p_rest", {{"parallel.zero", "3"},
                                                 {"train.micro_batch_size", "1"}}),
                               &mesh, dir_ + "/p_disk/step_5");
  ASSERT_EQ(rest.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rest.records[i].loss, on_disk.records[5 + i].loss) << "step " << 6 + i;
  }
  EXPECT_EQ(std::memcmp(rest.weights.data(), on_disk.weights.data(), rest.weights.size() * 4), 0);
  // Resident stage 3 -> parameters on disk.
  const Run back = run_trainer(config("p_back", disk), &mesh, dir_ + "/p_resident/step_5");
  ASSERT_EQ(back.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(back.records[i].loss, resident.records[5 + i].loss) << "step " << 6 + i;
  }
  EXPECT_EQ(std::memcmp(back.weights.data(), resident.weights.data(), back.weights.size() * 4), 0);
}

// dp 2 x pp 2, 1F1B and interleaved: every stage's units stay gathered from their first
// use to their last backward, streamed from disk once per step; the same bits as resident.
// And dp 2 x tp 2: each tp rank's slices sharded and streamed alike.
TEST_F(ZeroTrainer, PipelineAndTensorParallelWithParamsOnDiskEqualResident) {
  if (world_->size() != 4) GTEST_SKIP() << "pp 2 x dp 2 and tp 2 x dp 2 need 4 ranks";
  {
    DeviceMesh mesh(*world_, 2, 1);
    ConfigOverrides c{{"parallel.tp", "2"}, {"parallel.zero", "3"}, {"model.hidden_dim", "48"},
                      {"train.micro_batch_size", "2"}};
    const Run resident = run_trainer(config("tp_resident", c), &mesh);
    c.insert(c.end(), {{"parallel.offload", "disk"}, {"parallel.offload_budget_mb", "0.15"}});
    const Run on_disk = run_trainer(config("tp_disk", c), &mesh);
    ASSERT_EQ(on_disk.records.size(), resident.records.size());
    for (size_t i = 0; i < resident.records.size(); ++i) {
      EXPECT_EQ(on_disk.records[i].loss, resident.records[i].loss) << "tp 2, step " << i + 1;
    }
    EXPECT_EQ(std::memcmp(on_disk.weights.data(), resident.weights.data(),
                          resident.weights.size() * 4),
              0);
  }
  DeviceMesh mesh(*world_, 1, 2);
  for (const char* schedule : {"1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    ConfigOverrides c{{"parallel.pp", "2"},
                      {"parallel.zero", "3"},
                      {"parallel.schedule", schedule},
                      {"parallel.virtual_stages", std::string(schedule) == "1f1b" ? "1" : "2"},
                      {"model.n_layers", "4"},
                      // m 3 (> pp) under 1F1B, m 2 interleaved (a multiple of pp).
                      {"train.micro_batch_size", std::string(schedule) == "1f1b" ? "2" : "3"}};
    const Run resident = run_trainer(config(fmt::format("pp_resident_{}", schedule), c), &mesh);
    c.insert(c.end(), {{"parallel.offload", "disk"}, {"parallel.offload_budget_mb", "0.15"}});
    const Run on_disk = run_trainer(config(fmt::format("pp_disk_{}", schedule), c), &mesh);
    ASSERT_EQ(on_disk.records.size(), resident.records.size());
    for (size_t i = 0; i < resident.records.size(); ++i) {
      EXPECT_EQ(on_disk.records[i].loss, resident.records[i].loss) << "step " << i + 1;
      EXPECT_GT(on_disk.records[i].offload_read_bytes, 0u);
    }
    EXPECT_EQ(std::memcmp(on_disk.weights.data(), resident.weights.data(),
                          resident.weights.size() * 4),
              0);
  }
}

}  // namespace
}  // namespace meshtrain

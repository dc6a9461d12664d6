// The Trainer with parallel.zero under mpirun: whole runs (loader, eval,
// clipping, schedule) equal to the single-rank run, checkpoints written by
// rank 0 from the gathered shards and resumed under another stage, disk
// offload through the config.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/scratch.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class ZeroTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::shared_scratch_dir(*world_);
    if (world_->rank() == 0) {
      std::vector<uint16_t> tokens;
      const char* text = "in the beginning was the word, and the word was with god. ";
      for (int i = 0; i < 4000; ++i) {
        tokens.push_back(static_cast<uint16_t>((text[i % std::strlen(text)] - 32 + i / 997) % 61));
      }
      write_token_file(dir_ + "/train.bin", tokens);
      write_token_file(dir_ + "/val.bin", std::vector<uint16_t>(tokens.begin(), tokens.begin() + 800));
    }
    world_->barrier();
  }

  // vocab 61 and an odd MLP width: padded flat parameters at dp 2, 3, 4.
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    std::string toml = R"(
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
)";
    toml += "train = \"" + dir_ + "/train.bin\"\nval = \"" + dir_ + "/val.bin\"\n";
    extra.insert(extra.begin(), {"train.out_dir", dir_ + "/" + out});
    return parse_config(toml, "zero.toml", extra);
  }

  struct Run {
    std::vector<StepRecord> records;
    std::vector<float> weights;
  };
  static Run run(const TrainConfig& c, DeviceMesh* mesh, const std::string& resume = "") {
    TrainerOptions options;
    options.console = false;
    options.mesh = mesh;
    options.resume_dir = resume;
    Trainer trainer(c, options);
    Run r;
    r.records = trainer.run();
    r.weights = trainer.gather_weights();
    return r;
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(ZeroTrainer, EveryStageMatchesTheSingleRankRun) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run ref = run(config("ref.rank" + std::to_string(world_->rank())), nullptr);
  for (const char* stage : {"1", "2", "3"}) {
    for (const char* micro : {"12", "1"}) {
      const Run z = run(config(std::string("zero") + stage + "_" + micro,
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

// Rank 0 writes the gathered state in the flat format; a run of another
// stage resumes from it and continues bit for bit (one micro-batch per
// rank: every stage computes the same bits).
TEST_F(ZeroTrainer, CheckpointFromStage3ResumesUnderStage1BitForBit) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run full = run(config("full", {{"parallel.zero", "3"}, {"train.checkpoint_interval", "5"}}),
                       &mesh);
  world_->barrier();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/full/step_5/exp_avg_sq.safetensors"));
  const Run rest = run(config("rest", {{"parallel.zero", "1"}}), &mesh, dir_ + "/full/step_5");
  ASSERT_EQ(rest.records.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rest.records[i].loss, full.records[5 + i].loss) << "step " << 6 + i;
  }
  EXPECT_EQ(std::memcmp(rest.weights.data(), full.weights.data(), full.weights.size() * 4), 0);
}

TEST_F(ZeroTrainer, DiskOffloadFromTheConfigChangesNoBit) {
  DeviceMesh mesh(*world_, 1, 1);
  const Run resident = run(config("resident", {{"parallel.zero", "2"}}), &mesh);
  const Run disk = run(config("disk", {{"parallel.zero", "2"},
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

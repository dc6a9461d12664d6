// The Trainer with parallel.pp under mpirun: whole runs (loader, clipping,
// LR schedule, evaluation) under every schedule and micro-batch count equal
// the single-rank run, with and without data parallelism; the weights
// gathered from the stages equal the single-rank weights; a checkpoint
// written from the stages resumes on one rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "mpi_test.h"
#include "support/scratch.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class PipelineTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::shared_phrase_corpus(*world_, 61);
  }

  // GPT-2 (tied embeddings: the first and last stages share them) with 9
  // layers: divisible by neither 2 nor 4.
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    std::string toml = R"(
[model]
family = "gpt2"
dim = 32
n_layers = 9
n_heads = 4
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
[train]
steps = 20
batch_size = 12
seq_len = 16
threads = 1
grad_clip = 1.0
eval_interval = 10
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
    return testing::tiny_run_config(toml, dir_, out, std::move(extra), "pp.toml");
  }

  using Run = testing::TrainerRun;
  static Run run(const TrainConfig& c, DeviceMesh* mesh, const std::string& resume = "") {
    return testing::run_trainer(c, mesh, resume, /*evaluate=*/true);
  }

  void expect_same(const Run& got, const Run& ref, const std::string& what) const {
    ASSERT_EQ(got.records.size(), ref.records.size()) << what;
    for (size_t i = 0; i < ref.records.size(); ++i) {
      EXPECT_NEAR(got.records[i].loss, ref.records[i].loss, 1e-5 * ref.records[i].loss)
          << what << " step " << i + 1;
      EXPECT_NEAR(got.records[i].grad_norm, ref.records[i].grad_norm,
                  1e-5 * ref.records[i].grad_norm)
          << what << " step " << i + 1;
    }
    EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss) << what;
    EXPECT_LE(max_abs_difference(got.weights, ref.weights), 1e-4f) << what;
  }

  static float max_abs_difference(const std::vector<float>& got, const std::vector<float>& ref) {
    EXPECT_EQ(got.size(), ref.size());
    float worst = got.size() == ref.size() ? 0.0f : INFINITY;
    for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
      worst = std::max(worst, std::fabs(got[i] - ref[i]));
    }
    return worst;
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(PipelineTrainer, EveryScheduleAndMicroBatchCountMatchesTheSingleRankRun) {
  if (world_->size() == 1) GTEST_SKIP() << "pipelines need 2 or more ranks";
  const Run ref = run(config("ref.rank" + std::to_string(world_->rank())), nullptr);
  for (int pp = 2; pp <= world_->size(); pp *= 2) {
    if (world_->size() % pp != 0) continue;
    DeviceMesh mesh(*world_, 1, pp);
    const int64_t rows = 12 / mesh.layout().dp();  // per dp rank and step
    // Micro-batch counts below, at and above pp.
    for (int64_t m : {int64_t{pp / 2}, int64_t{pp}, int64_t{pp} + pp / 2}) {
      if (rows % m != 0) continue;
      for (const char* schedule : {"gpipe", "1f1b", "interleaved"}) {
        const bool interleaved = std::string(schedule) == "interleaved";
        if (interleaved && m % pp != 0) continue;
        const std::string what = fmt::format("pp {} dp {} m {} {}", pp, mesh.layout().dp(), m,
                                             schedule);
        SCOPED_TRACE(what);
        const Run p = run(config(fmt::format("pp{}_m{}_{}", pp, m, schedule),
                                 {{"parallel.pp", std::to_string(pp)},
                                  {"parallel.schedule", schedule},
                                  {"parallel.virtual_stages", interleaved ? "2" : "1"},
                                  {"train.micro_batch_size", std::to_string(rows / m)}}),
                          &mesh);
        expect_same(p, ref, what);
        EXPECT_NEAR(p.records.back().pp_bubble_theory,
                    static_cast<double>(pp - 1) / static_cast<double>((interleaved ? 2 : 1) * m),
                    1e-12);
        EXPECT_GT(p.records.back().pp_busy_ms, 0.0);
        const int64_t held = p.records.back().pp_in_flight;
        const int rank_pp = mesh.coord().pp;
        if (std::string(schedule) == "gpipe") {
          EXPECT_EQ(held, m);
        }
        if (std::string(schedule) == "1f1b") {
          EXPECT_EQ(held, std::min<int64_t>(m, pp - rank_pp));
        }
      }
    }
  }
}

TEST_F(PipelineTrainer, ExplicitSplitAndUntiedLlamaMatchTheSingleRankRun) {
  if (world_->size() == 1) GTEST_SKIP() << "pipelines need 2 or more ranks";
  const ConfigOverrides llama{{"model.family", "llama"}, {"model.n_kv_heads", "2"}};
  ConfigOverrides ref_cfg = llama;
  const Run ref = run(config("ref_llama.rank" + std::to_string(world_->rank()), ref_cfg), nullptr);
  DeviceMesh mesh(*world_, 1, 2);
  ConfigOverrides c = llama;
  c.insert(c.end(), {{"parallel.pp", "2"}, {"parallel.pp_split", "7,2"}});
  expect_same(run(config("llama_split", c), &mesh), ref, "llama pp 2 split 7,2");
}

// The stages' state is gathered into the single-rank files; one rank resumes
// from them and continues as the pipeline does.
TEST_F(PipelineTrainer, CheckpointFromStagesResumesOnOneRank) {
  if (world_->size() == 1) GTEST_SKIP() << "pipelines need 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 2);
  const Run full = run(config("full", {{"parallel.pp", "2"}, {"train.checkpoint_interval", "10"},
                                       {"train.micro_batch_size", "3"}}),
                       &mesh);
  world_->barrier();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/full/step_10/manifest.json"));
  const Run rest = run(config("rest.rank" + std::to_string(world_->rank()),
                              {{"train.micro_batch_size", "3"}}),
                       nullptr, dir_ + "/full/step_10");
  ASSERT_EQ(rest.records.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_NEAR(rest.records[i].loss, full.records[10 + i].loss, 1e-5 * full.records[10 + i].loss)
        << "step " << 11 + i;
  }
}

// pp 2 x dp 2: on every rank and step the exposed communication (what the
// step waited for its gradient collectives) is part of the communication
// (their time in flight), both measured on one clock; DDP and ZeRO.
TEST_F(PipelineTrainer, ExposedCommunicationIsPartOfCommunication) {
  if (world_->size() != 4) GTEST_SKIP() << "pp 2 x dp 2 needs 4 ranks";
  DeviceMesh mesh(*world_, 1, 2);
  for (const char* zero : {"0", "1", "3"}) {
    SCOPED_TRACE(fmt::format("pp 2 dp 2 zero {}", zero));
    const Run r = run(config(fmt::format("exposed_zero{}", zero),
                             {{"train.steps", "8"}, {"parallel.pp", "2"}, {"parallel.zero", zero},
                              {"train.micro_batch_size", "2"}}),
                      &mesh);
    for (const StepRecord& step : r.records) {
      EXPECT_GT(step.comm_ms, 0.0) << "step " << step.step;
      EXPECT_GE(step.exposed_comm_ms, 0.0) << "step " << step.step;
      EXPECT_LE(step.exposed_comm_ms, step.comm_ms) << "rank " << world_->rank() << " step "
                                                    << step.step;
    }
  }
}

// pp 2 x dp 2 with ZeRO 1, 2 and 3 (gradients reduced once per unit after its
// last backward, the tied embedding summed over the stages first) equals the
// single-rank run; the checkpoint (stages and shards gathered) resumes on one rank.
TEST_F(PipelineTrainer, ZeroStagesOverDataParallelPipelinesMatchTheSingleRankRun) {
  if (world_->size() != 4) GTEST_SKIP() << "pp 2 x dp 2 needs 4 ranks";
  DeviceMesh mesh(*world_, 1, 2);
  const ConfigOverrides steps{{"train.steps", "12"}};
  const Run ref = run(config("zref.rank" + std::to_string(world_->rank()), steps), nullptr);
  // 6 rows per dp rank: m 3 (> pp) under 1F1B, m 2 under GPipe and interleaved (v 2).
  struct Case {
    const char* zero;
    const char* schedule;
    const char* micro_batch_size;
  };
  for (const Case& k : {Case{"1", "1f1b", "2"}, Case{"2", "gpipe", "3"}, Case{"3", "1f1b", "2"},
                        Case{"3", "interleaved", "3"}}) {
    const std::string what = fmt::format("pp 2 dp 2 zero {} {} micro {}", k.zero, k.schedule,
                                         k.micro_batch_size);
    SCOPED_TRACE(what);
    ConfigOverrides c = steps;
    c.insert(c.end(), {{"parallel.pp", "2"},
                       {"parallel.zero", k.zero},
                       {"parallel.schedule", k.schedule},
                       {"parallel.virtual_stages",
                        std::string(k.schedule) == "interleaved" ? "2" : "1"},
                       {"train.micro_batch_size", k.micro_batch_size},
                       {"train.checkpoint_interval", std::string(k.zero) == "1" ? "6" : "-1"}});
    expect_same(run(config(fmt::format("zero{}_{}", k.zero, k.schedule), c), &mesh), ref, what);
  }
  world_->barrier();
  ASSERT_TRUE(std::filesystem::exists(dir_ + "/zero1_1f1b/step_6/manifest.json"));
  ConfigOverrides c = steps;
  c.push_back({"train.micro_batch_size", "2"});
  const Run rest = run(config("zrest.rank" + std::to_string(world_->rank()), c), nullptr,
                       dir_ + "/zero1_1f1b/step_6");
  ASSERT_EQ(rest.records.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(rest.records[i].loss, ref.records[6 + i].loss, 1e-5 * ref.records[6 + i].loss)
        << "step " << 7 + i;
    EXPECT_NEAR(rest.records[i].grad_norm, ref.records[6 + i].grad_norm,
                1e-5 * ref.records[6 + i].grad_norm)
        << "step " << 7 + i;
  }
  // And under the pipeline again (ZeRO 2 this time): each stage takes its
  // parameters from the whole tensors, then its shards.
  c.insert(c.end(), {{"parallel.pp", "2"}, {"parallel.zero", "2"}});
  const Run again = run(config("zagain", c), &mesh, dir_ + "/zero1_1f1b/step_6");
  ASSERT_EQ(again.records.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(again.records[i].loss, ref.records[6 + i].loss, 1e-5 * ref.records[6 + i].loss)
        << "pp resume step " << 7 + i;
  }
  EXPECT_LE(max_abs_difference(again.weights, ref.weights), 1e-4f);
}

TEST_F(PipelineTrainer, LayoutErrorsNameTheSetting) {
  if (world_->size() == 1) GTEST_SKIP() << "pipelines need 2 or more ranks";
  DeviceMesh mesh(*world_, 1, 2);
  auto message = [&](ConfigOverrides c) {
    c.insert(c.begin(), {"parallel.pp", "2"});
    try {
      TrainerOptions options;
      options.console = false;
      options.mesh = &mesh;
      Trainer trainer(config("bad", c), options);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Three micro-batches per step.
  const std::string micro = std::to_string(4 / mesh.layout().dp());
  EXPECT_NE(message({{"parallel.schedule", "interleaved"}, {"parallel.virtual_stages", "2"},
                     {"train.micro_batch_size", micro}})
                .find("a multiple of pp (2)"),
            std::string::npos);
  EXPECT_NE(message({{"parallel.pp_split", "4,4"}}).find("sums to 8 layers"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain

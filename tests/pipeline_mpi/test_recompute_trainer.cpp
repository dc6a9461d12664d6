// Activation checkpointing through whole Trainer runs under mpirun: every
// train.recompute mode (and full on N layers) gives the 20-step loss and
// gradient-norm trace and the final weights of recompute = "none" on the
// same layout, bit for bit: one rank, dp 2 ZeRO-3, tp 2 + sequence parallel,
// pp 2 1F1B, pp 2 interleaved (2 chunks a rank) and (8 ranks) dp 2 x tp 2 x
// pp 2, for Llama with grouped-query attention and GPT-2. Every run's tracker
// peaks per category and rank match its prediction (train/memory_plan.h;
// tests/support/memory_expect.h says how close).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/memory_expect.h"
#include "support/scratch.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

struct Layout {
  const char* name;
  int tp, pp, zero;
  bool sequence_parallel;
  int world;  // ranks it needs (1: every rank runs it alone)
  const char* schedule = "1f1b";
  int virtual_stages = 1;
};

constexpr Layout kLayouts[] = {
    {"single", 1, 1, 0, false, 1},
    {"dp 2 ZeRO-3", 1, 1, 3, false, 2},
    {"tp 2 + SP", 2, 1, 0, true, 2},
    {"pp 2 1F1B", 1, 2, 0, false, 2},
    {"dp 2 x tp 2 x pp 2", 2, 2, 0, true, 8},
    {"pp 2 interleaved", 1, 2, 0, false, 2, "interleaved", 2},  // 2 chunks of 1 layer a rank
};

struct Mode {
  const char* recompute;
  int layers;
};

constexpr Mode kModes[] = {{"selective", 0}, {"full", 0}, {"full", 1}};

class RecomputeTrainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::shared_phrase_corpus(*world_, 61);
  }

  // 4 layers (2 per stage); llama: 4 query heads over 2 kv heads.
  TrainConfig config(const char* family, const std::string& out, ConfigOverrides extra) const {
    const bool llama = std::string(family) == "llama";
    const std::string toml = fmt::format(R"(
[model]
family = "{}"
dim = 32
n_layers = 4
n_heads = 4
n_kv_heads = {}
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
tie_embeddings = {}
[train]
precision = "{}"
steps = 20
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
warmup_steps = 2
[data]
tokenizer = "bytes"
)",
                                         family, llama ? 2 : 4, llama ? "false" : "true",
                                         llama ? "bf16" : "fp32");
    return testing::tiny_run_config(toml, dir_, out, std::move(extra), "recompute.toml");
  }

  void run_layout(const Layout& layout) {
    const bool alone = layout.world == 1;
    if (!alone && world_->size() != layout.world) {
      GTEST_SKIP() << layout.name << " needs " << layout.world << " ranks";
    }
    std::unique_ptr<DeviceMesh> mesh;
    if (!alone) mesh = std::make_unique<DeviceMesh>(*world_, layout.tp, layout.pp);
    const std::string rank = alone ? fmt::format(".rank{}", world_->rank()) : "";
    for (const char* family : {"llama", "gpt2"}) {
      auto overrides = [&](const Mode& m) {
        return ConfigOverrides{{"parallel.tp", std::to_string(layout.tp)},
                               {"parallel.pp", std::to_string(layout.pp)},
                               {"parallel.zero", std::to_string(layout.zero)},
                               {"parallel.sequence_parallel",
                                layout.sequence_parallel ? "true" : "false"},
                               {"parallel.schedule", layout.schedule},
                               {"parallel.virtual_stages", std::to_string(layout.virtual_stages)},
                               {"train.recompute", m.recompute},
                               {"train.recompute_layers", std::to_string(m.layers)}};
      };
      const std::string base = fmt::format("{}_tp{}_pp{}v{}_z{}{}", family, layout.tp, layout.pp,
                                           layout.virtual_stages, layout.zero, rank);
      const testing::TrainerRun ref =
          testing::run_trainer(config(family, base + "_none", overrides({"none", 0})), mesh.get());
      testing::expect_memory_matches(ref.predicted, ref.memory,
                                     fmt::format("{} {} recompute none", layout.name, family));
      for (const Mode& m : kModes) {
        SCOPED_TRACE(fmt::format("{} {} recompute {} layers {}", layout.name, family, m.recompute,
                                 m.layers));
        const testing::TrainerRun got = testing::run_trainer(
            config(family, fmt::format("{}_{}{}", base, m.recompute, m.layers), overrides(m)),
            mesh.get());
        testing::expect_memory_matches(got.predicted, got.memory,
                                       fmt::format("{} {} recompute {} layers {}", layout.name,
                                                   family, m.recompute, m.layers));
        ASSERT_EQ(got.records.size(), 20u);
        ASSERT_EQ(ref.records.size(), 20u);
        for (size_t i = 0; i < ref.records.size(); ++i) {
          EXPECT_EQ(got.records[i].loss, ref.records[i].loss) << "step " << i + 1;
          EXPECT_EQ(got.records[i].grad_norm, ref.records[i].grad_norm) << "step " << i + 1;
        }
        // ZeRO-3 recomputes inside the backward's gather of the unit: no
        // extra data-parallel traffic. Full recomputation repeats the
        // forward's tp collectives; selective repeats none.
        const StepRecord& g = got.records.back();
        const StepRecord& r = ref.records.back();
        EXPECT_EQ(g.comm_bytes, r.comm_bytes);
        if (layout.tp > 1 && std::string(m.recompute) == "full") {
          EXPECT_GT(g.tp_comm_bytes, r.tp_comm_bytes);
        } else {
          EXPECT_EQ(g.tp_comm_bytes, r.tp_comm_bytes);
        }
        if (world_->rank() == 0) {
          fmt::print("[recompute] {} {} {} layers {}: step {} loss {:.6f} (none {:.6f}), dp "
                     "bytes/step {} (none {}), tp bytes/step {} (none {})\n",
                     layout.name, family, m.recompute, m.layers, g.step, g.loss, r.loss,
                     g.comm_bytes, r.comm_bytes, g.tp_comm_bytes, r.tp_comm_bytes);
        }
        ASSERT_EQ(got.weights.size(), ref.weights.size());
        EXPECT_EQ(0, std::memcmp(got.weights.data(), ref.weights.data(),
                                 ref.weights.size() * sizeof(float)));
      }
    }
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(RecomputeTrainer, SingleRankEqualsNoRecompute) { run_layout(kLayouts[0]); }
TEST_F(RecomputeTrainer, ZeroStage3EqualsNoRecompute) { run_layout(kLayouts[1]); }
TEST_F(RecomputeTrainer, TensorSequenceParallelEqualsNoRecompute) { run_layout(kLayouts[2]); }
TEST_F(RecomputeTrainer, Pipeline1F1BEqualsNoRecompute) { run_layout(kLayouts[3]); }
TEST_F(RecomputeTrainer, DataTensorPipelineEqualsNoRecompute) { run_layout(kLayouts[4]); }
TEST_F(RecomputeTrainer, InterleavedPipelineEqualsNoRecompute) { run_layout(kLayouts[5]); }

}  // namespace
}  // namespace meshtrain

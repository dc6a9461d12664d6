// Supervised fine-tuning (packed sft-jsonl rows: record positions through
// every stage, loss masking, normalisation over the step's loss tokens)
// under mpirun: data parallel, pipeline and tensor parallel (with sequence
// parallelism and without), ZeRO-3 (external parameter storage) runs equal
// the single-rank run.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/sft_run.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class SftParallel : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::shared_phrase_corpus(*world_, 61); }

  TrainConfig config(const std::string& out, ConfigOverrides o) const {
    o.insert(o.begin(), {{"train.steps", "3"}, {"train.micro_batch_size", "1"},
                         {"train.threads", "1"}, {"train.eval_interval", "3"},
                         {"train.checkpoint_interval", "-1"}});
    return testing::sft_run_config(dir_ + "/sft_" + out, o);
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(SftParallel, DataPipelineAndTensorParallelRunsEqualTheSingleRankRun) {
  if (world_->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  // Mistral: Llama with a sliding window of 9 tokens, shorter than most records.
  for (const char* family : {"llama", "gpt2", "mistral"}) {
    const std::string name = family;
    ConfigOverrides base = {{"model.family", name == "gpt2" ? "gpt2" : "llama"}};
    if (name == "gpt2") base.push_back({"model.n_kv_heads", "4"});
    if (name == "mistral") base.push_back({"model.sliding_window", "9"});
    const testing::TrainerRun ref = testing::run_trainer(
        config(fmt::format("ref_{}.rank{}", family, world_->rank()), base), nullptr, "", true);
    struct Layout {
      int tp, pp, zero;
      bool sp;
    };
    for (const Layout l : {Layout{1, 1, 0, false}, Layout{1, 1, 3, false}, Layout{1, 2, 0, false},
                           Layout{2, 1, 0, true}, Layout{2, 1, 0, false}}) {
      if (world_->size() % (l.tp * l.pp) != 0) continue;
      const std::string what = fmt::format("{} tp {} (sp {}) pp {} zero {} dp {}", family, l.tp,
                                           l.sp, l.pp, l.zero, world_->size() / (l.tp * l.pp));
      SCOPED_TRACE(what);
      DeviceMesh mesh(*world_, l.tp, l.pp);
      ConfigOverrides o = base;
      o.push_back({"parallel.tp", std::to_string(l.tp)});
      o.push_back({"parallel.pp", std::to_string(l.pp)});
      o.push_back({"parallel.zero", std::to_string(l.zero)});
      o.push_back({"parallel.sequence_parallel", l.sp ? "true" : "false"});
      const testing::TrainerRun got = testing::run_trainer(
          config(fmt::format("{}_tp{}{}_pp{}_z{}", family, l.tp, l.sp ? "sp" : "", l.pp, l.zero), o),
          &mesh, "", true);
      ASSERT_EQ(got.records.size(), ref.records.size());
      for (size_t i = 0; i < ref.records.size(); ++i) {
        EXPECT_EQ(got.records[i].loss_tokens, ref.records[i].loss_tokens);
        EXPECT_NEAR(got.records[i].loss, ref.records[i].loss, 1e-5 * ref.records[i].loss) << i;
        EXPECT_NEAR(got.records[i].grad_norm, ref.records[i].grad_norm,
                    1e-4 * ref.records[i].grad_norm) << i;
      }
      EXPECT_NEAR(got.val_loss, ref.val_loss, 1e-5 * ref.val_loss);
      ASSERT_EQ(got.weights.size(), ref.weights.size());
      float worst = 0;
      for (size_t i = 0; i < ref.weights.size(); ++i)
        worst = std::max(worst, std::fabs(got.weights[i] - ref.weights[i]));
      EXPECT_LE(worst, 1e-4f);
    }
  }
}

}  // namespace
}  // namespace meshtrain

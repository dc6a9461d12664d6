// The memory check before allocating is collective: a run too large for the
// host refuses on every rank with the same line (the ranks of one host summed),
// and none hangs in a collective the others never reach. And the prediction
// holds for runs that also evaluate and checkpoint.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/plan/models.h"
#include "meshtrain/train/distributed.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "mpi_test.h"
#include "support/memory_expect.h"
#include "support/shared_corpus.h"

namespace meshtrain {
namespace {

using testing::mpi_env;

class MemoryCheck : public ::testing::Test {
 protected:
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

TEST_F(MemoryCheck, EveryRankRefusesWithTheSameLine) {
  const std::string dir = testing::shared_phrase_corpus(*world_, 61);
  TrainConfig c = testing::tiny_run_config(std::string(R"(
[model]
family = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
[train]
steps = 1
batch_size = 8
seq_len = 16
)") + testing::kQuietRunTail,
                                           dir, "refused", {}, "memory_check.toml");
  c.model = plan::plan_model("llama2-7b").config;  // 6.7B parameters: ~108 GB of model state
  const int world = world_->size();
  DeviceMesh mesh(*world_, 1, 1);
  TrainerOptions options;
  options.console = false;
  options.mesh = &mesh;
  std::string line;
  try {
    Trainer trainer(c, options);
    ADD_FAILURE() << "a 7B model trained on this machine";
  } catch (const Error& e) {
    line = e.what();
  }
  EXPECT_NE(line.find(fmt::format("the {} ranks on this host", world)), std::string::npos) << line;
  EXPECT_NE(line.find("levers: parallel.zero = 3 would need"), std::string::npos) << line;
  // The same line on every rank: rank 0's, compared everywhere.
  EXPECT_EQ(broadcast_string(*world_, line, 0), line);
}

// Validation every step and the checkpoint at the end: the evaluation's
// forward (ZeRO-3's gathered head, the attention kernel's saved tensors) and
// the checkpoint's buffers stay within the prediction, on every rank.
TEST_F(MemoryCheck, RunsThatEvaluateAndCheckpointMatchThePrediction) {
  if (world_->size() != 2) GTEST_SKIP() << "2 ranks";
  const std::string dir = testing::shared_phrase_corpus(*world_, 61);
  struct Layout {
    const char* name;
    int tp, pp;
    ConfigOverrides overrides;
  };
  const Layout layouts[] = {
      {"dp 2 ZeRO-3", 1, 1, {{"parallel.zero", "3"}}},
      {"tp 2 + SP", 2, 1, {{"parallel.tp", "2"}, {"parallel.sequence_parallel", "true"}}},
      {"pp 2 1F1B", 1, 2, {{"parallel.pp", "2"}}},
      {"dp 2 ZeRO-2 + cpu offload", 1, 1,
       {{"parallel.zero", "2"}, {"parallel.offload", "cpu"}, {"parallel.offload_budget_mb", "0.1"}}},
      {"dp 2 ZeRO-1 + disk offload", 1, 1,
       {{"parallel.zero", "1"}, {"parallel.offload", "disk"}}},
      // The reduce-scatter rate limiter at other K: the grads peak follows it to the byte.
      {"dp 2 ZeRO-2, 1 reduce in flight", 1, 1,
       {{"parallel.zero", "2"}, {"parallel.max_inflight_reduces", "1"}}},
      {"dp 2 ZeRO-3, 5 reduces in flight", 1, 1,
       {{"parallel.zero", "3"}, {"parallel.max_inflight_reduces", "5"}}},
      {"dp 2 ZeRO-1, 3 reduces in flight", 1, 1,
       {{"parallel.zero", "1"}, {"parallel.max_inflight_reduces", "3"}}},
      // DDP's split of the checkpoint writing; the async copy, kept after the
      // first step's save, next to the second step's evaluation.
      {"dp 2 DDP, async checkpoint every step", 1, 1,
       {{"ckpt.async", "true"}, {"train.checkpoint_interval", "1"}}},
      {"dp 2 ZeRO-3 + parameters on disk", 1, 1,
       {{"parallel.zero", "3"}, {"parallel.offload", "disk"}, {"parallel.offload_budget_mb", "0.15"}}},
  };
  int run = 0;
  for (const Layout& layout : layouts) {
    for (const char* family : {"llama", "gpt2"}) {
      ++run;
      ConfigOverrides extra = layout.overrides;
      extra.push_back({"model.family", family});
      extra.push_back({"model.tie_embeddings", std::string(family) == "gpt2" ? "true" : "false"});
      const TrainConfig c = testing::tiny_run_config(R"(
[model]
dim = 32
n_layers = 4
n_heads = 4
n_kv_heads = 4
hidden_dim = 48
vocab_size = 61
max_seq_len = 32
[train]
precision = "bf16"
steps = 2
batch_size = 8
micro_batch_size = 2
seq_len = 16
threads = 1
eval_interval = 1
eval_batches = 1
peak_flops = 1e11
checkpoint_interval = 0
[data]
tokenizer = "bytes"
)",
                                                     dir, fmt::format("eval_{}_{}", run, family),
                                                     extra, "memory_eval.toml");
      DeviceMesh mesh(*world_, layout.tp, layout.pp);
      const testing::TrainerRun r = testing::run_trainer(c, &mesh);
      testing::expect_memory_matches(r.predicted, r.memory,
                                     fmt::format("{} {} evaluating", layout.name, family));
    }
  }
}

}  // namespace
}  // namespace meshtrain

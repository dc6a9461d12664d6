// Distributed checkpoints under mpirun: every layout writes its own shards,
// and every layout (and a single process) loads them — the state gathered
// after the load equals the writer's bit for bit, and training continues
// with the uninterrupted run's losses (bit for bit in the same layout,
// within the layouts' float tolerance otherwise).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "meshtrain/comm/mesh.h"
#include "meshtrain/train/trainer.h"
#include "mpi_test.h"
#include "support/scratch.h"
#include "support/shared_corpus.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

using testing::mpi_env;
using Layouts = std::vector<std::pair<std::string, ConfigOverrides>>;

// The layouts a world of `n` ranks runs (dp = n / (tp * pp)).
Layouts layouts_for(int n) {
  if (n == 2) {
    return {{"dp2", {}},
            {"zero1", {{"parallel.zero", "1"}}},
            {"zero2", {{"parallel.zero", "2"}}},
            {"zero3", {{"parallel.zero", "3"}}},
            {"zero3_disk",
             {{"parallel.zero", "3"}, {"parallel.offload", "disk"},
              {"parallel.offload_budget_mb", "1"}}},
            {"tp2", {{"parallel.tp", "2"}}},
            {"tp2_sp", {{"parallel.tp", "2"}, {"parallel.sequence_parallel", "true"}}},
            {"pp2", {{"parallel.pp", "2"}}},
            {"pp2_interleaved",
             {{"parallel.pp", "2"}, {"parallel.schedule", "interleaved"},
              {"parallel.virtual_stages", "2"}}}};
  }
  if (n == 8) {
    return {{"dp2tp2pp2", {{"parallel.tp", "2"}, {"parallel.pp", "2"}}},
            {"dp2tp2pp2_zero1", {{"parallel.tp", "2"}, {"parallel.pp", "2"}, {"parallel.zero", "1"}}},
            {"dp8_zero2", {{"parallel.zero", "2"}}},
            {"tp2pp4", {{"parallel.tp", "2"}, {"parallel.pp", "4"}}}};
  }
  return {};
}

class Reshard : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = testing::shared_phrase_corpus(*world_, 61);
  }

  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    std::string toml = fmt::format(R"(
[model]
family = "{}"
dim = 32
n_layers = 4
n_heads = 4
n_kv_heads = {}
hidden_dim = 64
vocab_size = 61
max_seq_len = 32
tie_embeddings = true
[train]
steps = 6
batch_size = 8
micro_batch_size = 2
seq_len = 16
threads = 1
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = 3
precision = "fp32"
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[ckpt]
buffer_mb = 1
[data]
tokenizer = "bytes"
)",
                                   GetParam(), std::string(GetParam()) == "llama" ? 2 : 4);
    return testing::tiny_run_config(toml, dir_, out, std::move(extra), "reshard.toml");
  }

  struct State {
    std::vector<float> kinds[layout::kStateKinds];
  };
  static State gather(Trainer& trainer) {
    State s;
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      s.kinds[k] = trainer.gather_state(static_cast<layout::StateKind>(k));
    }
    return s;
  }
  static void expect_bitwise(const State& got, const State& want, const std::string& what) {
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      ASSERT_EQ(got.kinds[k].size(), want.kinds[k].size()) << what;
      EXPECT_EQ(std::memcmp(got.kinds[k].data(), want.kinds[k].data(), want.kinds[k].size() * 4), 0)
          << what << ": " << layout::state_kind_name(static_cast<layout::StateKind>(k));
    }
  }

  // A trainer of layout `extra` (mesh: the world's; null: one process) resumed from `from`.
  std::unique_ptr<Trainer> resumed(const std::string& out, const ConfigOverrides& extra,
                                   DeviceMesh* mesh, const std::string& from) {
    TrainerOptions options;
    options.console = false;
    options.mesh = mesh;
    options.resume_dir = from;
    return std::make_unique<Trainer>(config(out, extra), options);
  }

  std::string dir_;
  MemoryTracker tracker_;
  std::unique_ptr<MpiCommunicator> world_ = mpi_env().world(tracker_);
};

int layout_size(const ConfigOverrides& o, const char* key) {
  for (const auto& [k, v] : o) {
    if (k == key) return std::stoi(v);
  }
  return 1;
}

TEST_P(Reshard, EveryLayoutLoadsEveryOther) {
  const Layouts layouts = layouts_for(world_->size());
  if (layouts.empty()) GTEST_SKIP() << "no layouts for " << world_->size() << " ranks";
  const std::string me = "rank" + std::to_string(world_->rank());
  for (size_t s = 0; s < layouts.size(); ++s) {
    const auto& [source, source_o] = layouts[s];
    DeviceMesh mesh(*world_, layout_size(source_o, "parallel.tp"), layout_size(source_o, "parallel.pp"));
    TrainerOptions options;
    options.console = false;
    options.mesh = &mesh;
    State written;
    std::vector<StepRecord> full;
    {
      Trainer trainer(config(source, source_o), options);
      full = trainer.run();
      written = gather(trainer);
    }
    const std::string step3 = dir_ + "/" + source + "/step_3", step6 = dir_ + "/" + source + "/step_6";
    ASSERT_TRUE(std::filesystem::exists(step6 + "/manifest.json")) << source;

    // Into one process (on every rank, each its own run).
    {
      auto single = resumed("single_" + source + "." + me, {}, nullptr, step6);
      expect_bitwise(gather(*single), written, source + " -> single");
    }
    for (size_t t = 0; t < layouts.size(); ++t) {
      const auto& [target, target_o] = layouts[t];
      DeviceMesh target_mesh(*world_, layout_size(target_o, "parallel.tp"),
                             layout_size(target_o, "parallel.pp"));
      auto loaded = resumed(source + "_to_" + target, target_o, &target_mesh, step6);
      expect_bitwise(gather(*loaded), written, source + " -> " + target);
    }
    // Continuation from step 3: the same layout bit for bit, the next one and
    // one process within tolerance.
    const size_t next = (s + 1) % layouts.size();
    for (const auto& [target, target_o, mesh_ptr] :
         std::vector<std::tuple<std::string, ConfigOverrides, bool>>{
             {source, source_o, true}, {layouts[next].first, layouts[next].second, true},
             {"single", {}, false}}) {
      DeviceMesh target_mesh(*world_, layout_size(target_o, "parallel.tp"),
                             layout_size(target_o, "parallel.pp"));
      const std::string out = "cont_" + source + "_" + target + (mesh_ptr ? "" : "." + me);
      auto rest = resumed(out, target_o, mesh_ptr ? &target_mesh : nullptr, step3);
      const std::vector<StepRecord> records = rest->run();
      ASSERT_EQ(records.size(), 3u) << source << " -> " << target;
      for (size_t i = 0; i < 3; ++i) {
        const double want = full[3 + i].loss;
        if (target == source) {
          EXPECT_EQ(records[i].loss, want) << source << " step " << 4 + i;
        } else {
          EXPECT_NEAR(records[i].loss, want, 1e-5 * want) << source << " -> " << target;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, Reshard, ::testing::Values("gpt2", "llama"));

}  // namespace
}  // namespace meshtrain

// The memory plan (train/memory_plan.h) for CUDA runs, on the emulated device
// (tests/cuda_emu/emu.h): the CPU memory-plan tests' runs with train.device = "cuda"
// (the registry's "cuda" is the emulated backend in this executable), its
// tracker peaks per category against the prediction the run makes from the
// cuda kind's workspaces (backend/cuda/kind.cpp), as the CPU runs are checked
// (tests/train/test_memory_plan.cpp).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <functional>
#include <string>
#include <vector>

#include "emu.h"
#define cuda cuda_emu
#include "meshtrain/backend/cuda/cuda_backend.h"
#undef cuda
#include "meshtrain/parallel/zero/offload.h"
#include "meshtrain/backend/registry.h"
#include "meshtrain/train/config.h"
#include "meshtrain/train/trainer.h"
#include "support/memory_expect.h"
#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

TEST(CudaEmu, TrainerPeaksMatchTheMemoryPlan) {
  ASSERT_EQ(backend_kind("cuda").unavailable(), "");  // the emulated device
  const std::string dir = testing::scratch_dir();
  testing::write_phrase_corpus(dir, 64);
  struct Run {
    std::string name, family;
    ConfigOverrides extra;
  };
  std::vector<Run> runs;
  for (const char* family : {"llama", "gpt2"}) {
    for (const char* mode : {"none", "selective", "full"}) {
      runs.push_back({fmt::format("{}_{}", family, mode), family, {{"train.recompute", mode}}});
    }
  }
  runs.push_back({"qlora_bf16", "llama", {{"lora.rank", "4"}, {"lora.quantize_base", "nf4"}}});
  // A capacity factor makes the experts' rows, so their memory, exact.
  runs.push_back({"moe_capacity", "llama",
                  {{"moe.experts", "4"}, {"moe.top_k", "2"}, {"moe.hidden_dim", "24"},
                   {"moe.capacity_factor", "1.25"}, {"train.precision", "fp32"}}});
  for (Run& run : runs) {
    SCOPED_TRACE(run.name);
    TrainerOptions options;
    options.console = false;
    run.extra.push_back({"train.device", "cuda"});
    run.extra.push_back({"train.out_dir", dir + "/" + run.name});
    Trainer trainer(testing::memory_plan_config(dir, run.family, run.extra), options);
    trainer.run();
    testing::expect_memory_matches(trainer.memory_plan().at(0), trainer.tracker().snapshot(),
                                   run.name);
  }
}

// What waits on the host between copies is page-locked on a GPU
// (Backend::staging_allocator): ZeRO's offload copies (the cpu tier's, the
// disk tier's staging per transfer), a checkpoint's async staging copy, kept
// for the next save, and the buffer a resume reads the rank files through.
// The emulated runtime counts cudaHostAlloc blocks.
TEST(CudaEmu, OffloadAndCheckpointStagingArePinned) {
  using zero::OffloadOptions, zero::OffloadStore, zero::OffloadTier;
  const std::string dir = testing::scratch_dir();
  ASSERT_EQ(emu::pinned_blocks.load(), 0);
  for (OffloadTier tier : {OffloadTier::cpu, OffloadTier::disk}) {
    SCOPED_TRACE(zero::offload_tier_name(tier));
    MemoryTracker tracker;
    cuda_emu::CudaBackend device(tracker);
    const int64_t made = emu::pinned_made.load();
    {
      OffloadOptions options;
      options.tier = tier;
      options.directory = dir;
      options.device = &device;
      OffloadStore store("pinned", {{"a", 3000, DType::f32}, {"b", 1000, DType::bf16}}, options,
                         tracker);
      // Through the slower tier and back: a chunk's values survive it.
      std::vector<float> values(3000);
      for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
      device.copy_from_host(values.data(), store.acquire(0));
      store.release(0, true);
      store.begin_pass({1, 0});
      store.acquire(1);  // dropped at once
      store.release(1, false);
      std::vector<float> back(values.size());
      device.copy_to_host(store.acquire(0), back.data());
      store.release(0, false);
      store.end_pass();
      EXPECT_EQ(back, values);
      EXPECT_GT(store.stats().reads, 0u);
      EXPECT_GT(emu::pinned_made.load(), made);
    }
    EXPECT_EQ(emu::pinned_blocks.load(), 0);  // every block given back
  }
  testing::write_phrase_corpus(dir, 64);
  // A one-rank Llama on the emulated GPU, writing to dir/name; `check` sees it after its run.
  auto train = [&](const std::string& name, ConfigOverrides extra, const std::string& resume,
                   const std::function<void(Trainer&)>& check) {
    TrainerOptions options;
    options.console = false;
    options.resume_dir = resume;
    options.allow_config_change = !resume.empty();
    extra.push_back({"train.device", "cuda"});
    extra.push_back({"train.out_dir", dir + "/" + name});
    Trainer trainer(testing::memory_plan_config(dir, "llama", extra), options);
    trainer.run();
    check(trainer);
  };
  train("async", {{"ckpt.async", "true"}, {"train.checkpoint_interval", "1"}}, "",
        [](Trainer& trainer) {
          EXPECT_GT(emu::pinned_blocks.load(), 0);  // the staging copy, kept for the next save
          testing::expect_memory_matches(trainer.memory_plan().at(0),
                                         trainer.tracker().snapshot(), "async");
        });
  EXPECT_EQ(emu::pinned_blocks.load(), 0);
  // Resuming reads the rank files through a page-locked buffer too (no save in this run).
  const int64_t made = emu::pinned_made.load();
  train("resumed", {{"train.steps", "3"}, {"train.checkpoint_interval", "-1"}},
        dir + "/async/step_2", [](Trainer&) {});
  EXPECT_GT(emu::pinned_made.load(), made);
  EXPECT_EQ(emu::pinned_blocks.load(), 0);
}

}  // namespace
}  // namespace meshtrain

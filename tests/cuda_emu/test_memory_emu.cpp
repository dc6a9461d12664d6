// The memory plan (train/memory_plan.h) for CUDA runs, on the emulated device
// (tests/cuda_emu/emu.h): the CPU memory-plan tests' runs with train.device = "cuda"
// (the registry's "cuda" is the emulated backend in this executable), its
// tracker peaks per category against the prediction the run makes from the
// cuda kind's workspaces (backend/cuda/kind.cpp), as the CPU runs are checked
// (tests/train/test_memory_plan.cpp).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

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

}  // namespace
}  // namespace meshtrain

// Models that transformers itself wrote (tests/reference/hf_models.py): every
// config form and RoPE type, GQA, tied and untied, GPT-2, bf16/f16 and sharded
// weights. Imported by meshtrain, their logits must equal transformers' own
// (fp32, 1e-5). Reads the committed fixtures, or MESHTRAIN_HF_FIXTURES (the
// hf-venv ctest points it at freshly written ones).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/ckpt/safetensors.h"
#include "support/hf_logits.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

std::string fixtures_dir() {
  const char* env = std::getenv("MESHTRAIN_HF_FIXTURES");
  return env != nullptr && *env != '\0' ? env
                                        : std::string(MESHTRAIN_SOURCE_DIR) + "/tests/reference/fixtures";
}

std::vector<fs::path> model_dirs() {
  std::vector<fs::path> dirs;
  if (!fs::is_directory(fixtures_dir())) return dirs;
  for (const auto& e : fs::directory_iterator(fixtures_dir())) {
    if (e.is_directory() && e.path().filename().string().starts_with("hf_tiny_")) {
      dirs.push_back(e.path());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

TEST(HfTransformers, ImportedModelsGiveTransformersLogits) {
  const std::vector<fs::path> dirs = model_dirs();
  ASSERT_GE(dirs.size(), 8u) << "no hf_tiny_* models in " << fixtures_dir();
  for (const fs::path& dir : dirs) {
    SCOPED_TRACE(dir.string());
    MemoryTracker tracker;
    cpu::CpuBackend ctx(2, tracker);
    std::unique_ptr<Model> model = import_hf(dir.string(), Precision::fp32, ctx);
    EXPECT_LE(testing::hf_logits_error(*model, dir.string()), 1e-5);
  }
}

TEST(HfTransformers, Llama3ScalingIsReadAndChangesTheModel) {
  const fs::path dir = fs::path(fixtures_dir()) / "hf_tiny_llama_llama3_scaling";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "no " << dir;
  const ModelConfig c = read_hf_config((dir / "config.json").string());
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.rope_scaling.type, RopeType::llama3);
  EXPECT_EQ(c.rope_scaling.factor, 8.0f);
  EXPECT_EQ(c.rope_scaling.original_max_seq, 16);
  ModelConfig plain = c;
  plain.rope_scaling = {};
  EXPECT_NE(c.rope_frequencies(), plain.rope_frequencies());
}

}  // namespace
}  // namespace meshtrain

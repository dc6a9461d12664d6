// A LoRA run from a base without adapters (train.init_from a Hugging Face
// directory or a plain run's checkpoint): the base comes from there, the
// adapters keep their initial values (lora_B = 0), so the first step's loss is
// the base model's (the same run without LoRA), bit for bit in fp32.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

class LoraInitFrom : public ::testing::Test {
 protected:
  fs::path dir_ = testing::scratch_dir();

  TrainConfig config(const std::string& out, const std::string& init_from, bool lora) {
    const std::string toml = R"(
[train]
steps = 2
batch_size = 2
seq_len = 16
threads = 2
eval_interval = 0
peak_flops = 1e11
init_from = ")" + init_from + R"("
[data]
)";
    ConfigOverrides extra;
    if (lora) extra = {{"lora.rank", "4"}, {"lora.targets", "q_proj"}};
    return testing::tiny_run_config(toml, dir_.string(), out, extra, out + ".toml");
  }
};

TEST_F(LoraInitFrom, AdaptersStartAtZeroOverTheImportedBase) {
  testing::write_phrase_corpus(dir_.string(), 64);
  const std::string hf = std::string(MESHTRAIN_SOURCE_DIR) +
                         "/tests/reference/fixtures/hf_tiny_llama_theta1e4_gqa_untied";
  // A plain run's sharded checkpoint as the other kind of base.
  const auto plain = testing::run_trainer(config("plain", hf, false));
  const std::string step = (dir_ / "plain/step_2").string();
  for (const auto& [name, base] : {std::pair{"hf", hf}, {"step", step}}) {
    SCOPED_TRACE(base);
    const auto full = testing::run_trainer(config(std::string("full_") + name, base, false));
    const auto lora = testing::run_trainer(config(std::string("lora_") + name, base, true));
    ASSERT_EQ(lora.records.size(), 2u);
    EXPECT_EQ(lora.records[0].loss, full.records[0].loss);  // step 0: the base model
    EXPECT_NE(lora.records[1].loss, full.records[1].loss);  // then different updates
  }
}

}  // namespace
}  // namespace meshtrain

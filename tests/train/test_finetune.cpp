// The fine-tuning path: train.init_from (a Hugging Face directory or a
// non-LoRA training checkpoint) into a LoRA run. The base comes from the
// directory, the adapters keep their init (lora_B zero: step 0 is the
// directory's model), the base stays bit-identical through training, SFT
// records train and resume bit for bit, and a LoRA checkpoint as init_from is
// refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/ckpt/hf.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "support/hf_logits.h"
#include "support/scratch.h"
#include "support/sft_run.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

const std::string kHf =
    std::string(MESHTRAIN_SOURCE_DIR) + "/tests/reference/fixtures/hf_tiny_llama_theta1e4_gqa_untied";
constexpr const char* kLora = "[lora]\nrank = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\", \"down_proj\"]\n";

class Finetune : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::scratch_dir(); }

  // LoRA on the HF fixture's model (train.init_from, no [model]), on a phrase corpus.
  TrainConfig hf_lora_config(const std::string& out, ConfigOverrides o) const {
    testing::write_phrase_corpus(dir_.string(), 64);
    const std::string toml = std::string(kLora) + R"(
[train]
steps = 6
batch_size = 4
seq_len = 16
threads = 2
eval_interval = 0
peak_flops = 1e11
checkpoint_interval = -1
init_from = ")" + kHf + R"("
[optim]
lr = 1e-2
warmup_steps = 0
[data]
)";
    return testing::tiny_run_config(toml, dir_.string(), out, std::move(o), out + ".toml");
  }
  fs::path dir_;
};

// Every base parameter of `trainer`'s gathered weights equals `want`'s
// (the same registry, adapters skipped); at the start every lora_B is zero.
void expect_base_is(Trainer& trainer, const std::vector<float>& weights,
                    const std::vector<float>& want, const ModelConfig& want_model, bool start = true) {
  std::vector<ParamSpec> want_specs = build_param_specs(want_model);
  int64_t at = 0, at_want = 0;
  size_t w = 0;
  for (const ParamSpec& spec : build_param_specs(trainer.config().model)) {
    if (spec.lora_adapter) {
      if (start && spec.name.find("lora_B") != std::string::npos) {
        for (int64_t i = 0; i < spec.numel(); ++i) ASSERT_EQ(weights[at + i], 0.0f) << spec.name;
      }
    } else {
      while (want_specs[w].name != spec.name) at_want += want_specs[w++].numel();
      EXPECT_EQ(0, std::memcmp(weights.data() + at, want.data() + at_want, spec.numel() * sizeof(float)))
          << spec.name;
    }
    at += spec.numel();
  }
}

// From the HF fixture into LoRA: the base is HF's, the logits at step 0 are
// transformers' (fp32, 1e-5), the loss falls and the base does not move.
TEST_F(Finetune, InitFromHuggingFaceIntoLoraStartsAtItsLogits) {
  TrainConfig c = hf_lora_config("hf_lora", {});
  TrainerOptions options;
  options.console = false;
  Trainer trainer(c, options);
  ASSERT_TRUE(trainer.config().model.lora.enabled());
  MemoryTracker tracker;
  cpu::CpuBackend ctx(2, tracker);
  const std::unique_ptr<Model> hf = import_hf(kHf, Precision::fp32, ctx);
  const std::vector<float> start = trainer.gather_weights();
  const std::vector<float> hf_weights(hf->flat_master().data<float>(),
                                      hf->flat_master().data<float>() + hf->num_params());
  expect_base_is(trainer, start, hf_weights, hf->config());

  // The LoRA model with those weights gives transformers' logits.
  Model lora(trainer.config().model, Precision::fp32, ctx);
  std::copy(start.begin(), start.end(), lora.flat_master().data<float>());
  EXPECT_LE(testing::hf_logits_error(lora, kHf), 1e-5);

  const auto records = trainer.run();
  ASSERT_EQ(records.size(), 6u);
  EXPECT_EQ(records.front().step, 1);
  EXPECT_LT(records.back().loss, records.front().loss);
  expect_base_is(trainer, trainer.gather_weights(), hf_weights, hf->config(), false);
}

// bf16: the frozen matmul weights exist only as their bf16 copies, written
// through Model::write_values; read back they are HF's values rounded to bf16.
TEST_F(Finetune, InitFromHuggingFaceIntoBf16LoraRoundsTheFrozenCopies) {
  TrainConfig c = hf_lora_config("hf_bf16", {{"train.steps", "1"}, {"train.precision", "bf16"}});
  TrainerOptions options;
  options.console = false;
  Trainer trainer(c, options);
  MemoryTracker tracker;
  cpu::CpuBackend ctx(2, tracker);
  const std::unique_ptr<Model> hf = import_hf(kHf, Precision::fp32, ctx);
  const std::vector<float> start = trainer.gather_weights();
  int64_t at = 0;
  for (const ParamSpec& spec : build_param_specs(trainer.config().model)) {
    if (!spec.lora_adapter) {
      const float* v = hf->param(spec.name).master.data<float>();
      for (int64_t i = 0; i < spec.numel(); ++i) {
        // bf16 keeps 8 significant bits: within half a unit of the last place.
        const float tolerance = spec.matmul_weight ? std::abs(v[i]) / 256 : 0.0f;
        ASSERT_LE(std::abs(start[at + i] - v[i]), tolerance) << spec.name << " " << i;
      }
    }
    at += spec.numel();
  }
  trainer.run();
  const std::vector<float> end = trainer.gather_weights();
  at = 0;
  for (const ParamSpec& spec : build_param_specs(trainer.config().model)) {
    if (!spec.lora_adapter) {
      EXPECT_EQ(0, std::memcmp(start.data() + at, end.data() + at, spec.numel() * sizeof(float))) << spec.name;
    }
    at += spec.numel();
  }
}

// SFT records with packing, from a non-LoRA SFT run's checkpoint into LoRA:
// the base is that checkpoint's, the loss falls, the base is bit-identical
// after training, a resume continues bit for bit and meshtrain eval of the
// checkpoint reproduces the run's validation loss.
TEST_F(Finetune, SftLoraFromATrainingCheckpoint) {
  auto sft = [&](const std::string& out, ConfigOverrides o) {
    o.insert(o.begin(), {{"train.eval_interval", "0"}, {"train.checkpoint_interval", "2"}});
    return testing::sft_run_config((dir_ / out).string(), o);
  };
  const auto source = testing::run_trainer(sft("source", {{"train.steps", "2"}}));
  const std::string step = (dir_ / "source/step_2").string();
  const ConfigOverrides lora = {{"train.init_from", step}, {"train.steps", "4"}, {"optim.lr", "3e-2"},
                                {"lora.rank", "4"}, {"lora.alpha", "8"}, {"optim.warmup_steps", "0"}};
  TrainConfig c = sft("lora", lora);
  ASSERT_TRUE(c.data.sft_pack);
  TrainerOptions options;
  options.console = false;
  Trainer trainer(c, options);
  const ModelConfig base_model = testing::sft_run_config("x", {}).model;
  expect_base_is(trainer, trainer.gather_weights(), source.weights, base_model);
  const auto records = trainer.run();
  ASSERT_EQ(records.size(), 4u);
  EXPECT_LT(records.back().loss, records.front().loss);
  const std::vector<float> end = trainer.gather_weights();
  expect_base_is(trainer, end, source.weights, base_model, false);

  const auto resumed = testing::run_trainer(sft("lora_resumed", lora), nullptr, (dir_ / "lora/step_2").string(), true);
  ASSERT_EQ(resumed.records.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(resumed.records[i].loss, records[2 + i].loss);
  EXPECT_EQ(0, std::memcmp(resumed.weights.data(), end.data(), end.size() * sizeof(float)));

  EvalOptions eval;
  eval.data = {testing::sft_fixtures_dir() + "/sft_tiny_val.jsonl"};
  eval.threads = 2;
  const EvalResult r = evaluate_checkpoint((dir_ / "lora_resumed/step_4").string(), eval, nullptr);
  EXPECT_NEAR(r.loss, resumed.val_loss, 1e-6 * resumed.val_loss);

  // A LoRA run's checkpoint as init_from: refused, naming the key and the way out.
  try {
    sft("again", {{"train.init_from", (dir_ / "lora/step_4").string()}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is a LoRA run's checkpoint (its lora.rank = 4)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace meshtrain

// The training loop: bit-identical repeat runs, bit-exact save/resume (fp32,
// bf16, both families), gradient accumulation, falling loss, metrics, and
// generation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/ckpt/safetensors.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/util/error.h"
#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::scratch_dir();
    const std::vector<uint16_t> train = testing::phrase_tokens(3000, 64, 0);
    const std::vector<uint16_t> val(train.begin() + 7, train.begin() + 607);
    write_token_file((dir_ / "train.bin").string(), train);
    write_token_file((dir_ / "val.bin").string(), val);
  }
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    return testing::tiny_run_config(R"(
[model]
family = "llama"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 64
vocab_size = 64
max_seq_len = 32
tie_embeddings = false
[train]
steps = 8
batch_size = 4
micro_batch_size = 2
seq_len = 16
threads = 2
grad_clip = 1.0
eval_interval = 4
eval_batches = 2
peak_flops = 1e11
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
[data]
)",
                                    dir_.string(), out, std::move(extra), "test.toml");
  }

  static std::vector<StepRecord> run(const TrainConfig& c, const std::string& resume = "") {
    return testing::run_trainer(c, nullptr, resume).records;
  }

  static std::vector<char> bytes(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }

  fs::path dir_;
};

void expect_same_trace(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].step, b[i].step);
    // Bit-identical, not merely close.
    EXPECT_EQ(std::memcmp(&a[i].loss, &b[i].loss, sizeof(double)), 0)
        << "step " << a[i].step << ": " << a[i].loss << " vs " << b[i].loss;
    EXPECT_EQ(std::memcmp(&a[i].grad_norm, &b[i].grad_norm, sizeof(double)), 0)
        << "step " << a[i].step;
    EXPECT_EQ(a[i].lr, b[i].lr);
  }
}

TEST_F(TrainerTest, TwoRunsAreBitIdentical) {
  auto a = run(config("a"));
  auto b = run(config("b"));
  ASSERT_EQ(a.size(), 8u);
  expect_same_trace(a, b);
  EXPECT_EQ(bytes(dir_ / "a/step_8/rank_0.safetensors"), bytes(dir_ / "b/step_8/rank_0.safetensors"));
}

struct ResumeCase {
  const char* family;
  const char* precision;
};

class ResumeTest : public TrainerTest, public ::testing::WithParamInterface<ResumeCase> {};

TEST_P(ResumeTest, ResumeEqualsUninterruptedRunBitForBit) {
  ConfigOverrides o = {{"model.family", GetParam().family},
                       {"train.precision", GetParam().precision},
                       {"train.checkpoint_interval", "3"}};
  if (std::string(GetParam().family) == "gpt2") {
    o.push_back({"model.hidden_dim", "128"});
    o.push_back({"model.n_kv_heads", "4"});
    o.push_back({"model.tie_embeddings", "true"});
  }
  auto full = run(config("full", o));
  ASSERT_TRUE(fs::exists(dir_ / "full/step_3/manifest.json"));
  ASSERT_TRUE(fs::exists(dir_ / "full/step_6"));

  auto resumed = run(config("resumed", o), (dir_ / "full/step_3").string());
  ASSERT_EQ(resumed.size(), 5u);
  EXPECT_EQ(resumed.front().step, 4);
  expect_same_trace(std::vector<StepRecord>(full.begin() + 3, full.end()), resumed);
  EXPECT_EQ(bytes(dir_ / "full/step_8/rank_0.safetensors"),
            bytes(dir_ / "resumed/step_8/rank_0.safetensors"));
  TrainState a = read_train_state((dir_ / "full/step_8").string());
  TrainState b = read_train_state((dir_ / "resumed/step_8").string());
  EXPECT_EQ(a.step, 8);
  EXPECT_EQ(a.optimizer_step, b.optimizer_step);
  EXPECT_EQ(a.sampler, b.sampler);
}

INSTANTIATE_TEST_SUITE_P(Trainer, ResumeTest,
                         ::testing::Values(ResumeCase{"llama", "fp32"}, ResumeCase{"llama", "bf16"},
                                           ResumeCase{"gpt2", "fp32"}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.family) + "_" + param_info.param.precision;
                         });

TEST_F(TrainerTest, GradientAccumulationMatchesOneBigBatch) {
  auto one = run(config("one", {{"train.micro_batch_size", "4"}, {"train.steps", "2"}}));
  auto four = run(config("four", {{"train.micro_batch_size", "1"}, {"train.steps", "2"}}));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(one[i].loss, four[i].loss, 1e-5 * one[i].loss);
    EXPECT_NEAR(one[i].grad_norm, four[i].grad_norm, 1e-4 * one[i].grad_norm);
  }
}

TEST_F(TrainerTest, LossFallsAndMetricsAreWritten) {
  auto records = run(config("fall", {{"train.steps", "40"}, {"train.eval_interval", "20"}}));
  EXPECT_LT(records.back().loss, records.front().loss - 1.0)
      << records.front().loss << " -> " << records.back().loss;
  std::ifstream in(dir_ / "fall/metrics.jsonl");
  std::string line;
  int steps = 0, evals = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) {
      ++evals;
      continue;
    }
    if (j.contains("memory") || j.contains("checkpoint")) continue;  // memory reports, checkpoints
    ++steps;
    for (const char* key :
         {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms", "data_ms"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
  }
  EXPECT_EQ(steps, 40);
  EXPECT_EQ(evals, 2);
}

TEST_F(TrainerTest, CheckpointHoldsTheGlobalDataPositionAndTokenizer) {
  // 600 tokens: 37 samples of 16 + 1, 4 per step: 9 steps per epoch (1 sample skipped).
  std::vector<uint16_t> small(600);
  for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<uint16_t>((i * 7) % 64);
  std::string small_path = (dir_ / "small.bin").string();
  write_token_file(small_path, small);
  ConfigOverrides o = {{"data.train", small_path}, {"train.steps", "12"},
                       {"train.eval_interval", "0"}, {"data.tokenizer", "bytes"}};
  ConfigOverrides full_o = o;
  full_o.push_back({"train.checkpoint_interval", "4"});
  auto full = run(config("full", full_o));
  TrainConfig saved;
  TrainState at8 = read_train_state((dir_ / "full/step_8").string(), &saved);
  EXPECT_EQ(at8.sampler, (SamplerPosition{0, 32}));
  EXPECT_EQ(saved.data.tokenizer, "bytes");
  EXPECT_EQ(read_train_state((dir_ / "full/step_12").string()).sampler, (SamplerPosition{1, 12}));
  // Resumed across the epoch boundary with another micro-batch split: the
  // same samples, so the same losses up to summation order.
  ConfigOverrides resumed_o = o;
  resumed_o.push_back({"train.micro_batch_size", "1"});
  // Another micro-batch split changes the summation order: refused unless allowed.
  try {
    run(config("refused", resumed_o), (dir_ / "full/step_8").string());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.micro_batch_size: 2 -> 1"), std::string::npos)
        << e.what();
  }
  auto resumed = testing::run_trainer(config("resumed", resumed_o), nullptr,
                                      (dir_ / "full/step_8").string(), false, true)
                     .records;
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_NEAR(resumed[i].loss, full[8 + i].loss, 1e-5 * full[8 + i].loss) << i;
  }
  EXPECT_EQ(read_train_state((dir_ / "resumed/step_12").string()).sampler, (SamplerPosition{1, 12}));
}

TEST_F(TrainerTest, BatchMustSplitOverDataParallelRanks) {
  TrainerOptions options;
  options.console = false;
  options.dp_size = 3;
  try {
    Trainer trainer(config("dp3"), options);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "data: train.batch_size (4) must be divisible by the data-parallel size dp = 3");
  }
}

TEST_F(TrainerTest, ResumeRejectsADifferentModelOrBrokenState) {
  run(config("a", {{"train.steps", "1"}}));
  std::string step = (dir_ / "a/step_1").string();
  try {
    run(config("b", {{"model.dim", "64"}}), step);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs"), std::string::npos) << e.what();
  }
  std::ofstream(dir_ / "a/step_1/manifest.json") << "{\"format\": \"meshtrain-checkpoint\"";
  try {
    run(config("c"), step);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
  }
}

TEST_F(TrainerTest, GenerationIsDeterministic) {
  run(config("gen", {{"train.steps", "2"}}));
  MemoryTracker tracker;
  cpu::CpuBackend ctx(2, tracker);
  auto model = load_model_dir((dir_ / "gen/step_2").string(), Precision::fp32, ctx);
  SampleOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 10;
  auto g1 = generate(*model, {1, 2, 3}, greedy);
  auto g2 = generate(*model, {1, 2, 3}, greedy);
  EXPECT_EQ(g1.size(), 10u);
  EXPECT_EQ(g1, g2);
  SampleOptions top1 = greedy;
  top1.temperature = 0.7f;
  top1.top_k = 1;
  EXPECT_EQ(generate(*model, {1, 2, 3}, top1), g1);  // top-1 is greedy
  // A stop id ends generation after its first appearance, included.
  SampleOptions stopping = greedy;
  stopping.stop_id = g1[4];
  const auto first = static_cast<size_t>(std::find(g1.begin(), g1.end(), g1[4]) - g1.begin());
  EXPECT_EQ(generate(*model, {1, 2, 3}, stopping),
            std::vector<int32_t>(g1.begin(), g1.begin() + static_cast<std::ptrdiff_t>(first) + 1));
  SampleOptions sampled;
  sampled.temperature = 1.0f;
  sampled.seed = 5;
  sampled.max_new_tokens = 29;  // the whole context, max_seq_len 32
  auto s1 = generate(*model, {1, 2, 3}, sampled);
  EXPECT_EQ(s1.size(), 29u);
  EXPECT_EQ(s1, generate(*model, {1, 2, 3}, sampled));
  sampled.seed = 6;
  EXPECT_NE(s1, generate(*model, {1, 2, 3}, sampled));
  EXPECT_THROW(generate(*model, {64}, greedy), Error);  // outside the vocabulary
  sampled.max_new_tokens = 30;  // one past the context
  try {
    generate(*model, {1, 2, 3}, sampled);
    ADD_FAILURE() << "generation past the context was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_seq_len 32"), std::string::npos) << e.what();
  }
}

TEST_F(TrainerTest, EvalOfAStepDirEqualsTheLoggedValLoss) {
  run(config("ev", {{"train.checkpoint_interval", "4"}}));
  std::map<int64_t, double> logged;
  std::ifstream metrics(dir_ / "ev/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) logged[j["step"].get<int64_t>()] = j["val_loss"].get<double>();
  }
  ASSERT_EQ(logged.size(), 2u);  // steps 4 and 8
  EvalOptions options;
  options.data = {(dir_ / "val.bin").string()};
  for (const auto& [step, val_loss] : logged) {
    const EvalResult r =
        evaluate_checkpoint((dir_ / "ev" / step_dir_name(step)).string(), options, nullptr);
    EXPECT_NEAR(r.loss, val_loss, 1e-6) << "step " << step;
    EXPECT_EQ(r.tokens, 2 * 4 * 16);  // eval_batches x batch_size x seq_len
    EXPECT_NEAR(r.perplexity, std::exp(r.loss), 1e-9);
  }
  // Other windows than the run's: a different (still valid) loss.
  options.batches = 1;
  options.seq_len = 32;
  const EvalResult other = evaluate_checkpoint((dir_ / "ev/step_8").string(), options, nullptr);
  EXPECT_EQ(other.tokens, 4 * 32);
  EXPECT_TRUE(std::isfinite(other.loss));
}

TEST(PickToken, GreedyTopKAndTemperature) {
  std::vector<float> logits = {0.0f, 3.0f, 1.0f, 3.0f, -2.0f};
  SampleOptions o;
  o.temperature = 0;
  EXPECT_EQ(pick_token(logits.data(), 5, o, 0), 1);  // first of the tied maxima
  o.temperature = 1.0f;
  o.top_k = 3;
  std::vector<int> counts(5, 0);
  for (uint64_t d = 0; d < 2000; ++d) ++counts[static_cast<size_t>(pick_token(logits.data(), 5, o, d))];
  EXPECT_EQ(counts[0] + counts[4], 0);  // outside the top 3
  EXPECT_GT(counts[2], 0);
  EXPECT_NEAR(double(counts[1]) / counts[3], 1.0, 0.2);
  EXPECT_NEAR(double(counts[2]) / 2000, std::exp(1.0) / (2 * std::exp(3.0) + std::exp(1.0)), 0.03);
  EXPECT_EQ(parse_token_ids("1, 2,3"), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_THROW(parse_token_ids("1,,2"), Error);
  EXPECT_THROW(parse_token_ids("a"), Error);
}

// No silent surprises: a fresh run refuses an out_dir holding another run;
// --overwrite deletes it; a resume names settings that break exact
// continuation; --resume auto takes `latest`, or the newest older checkpoint
// that verifies.
TEST_F(TrainerTest, FreshRunRefusesAnOutDirHoldingAnotherRun) {
  run(config("used", {{"train.steps", "2"}}));
  try {
    run(config("used", {{"train.steps", "2"}}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds another run"), std::string::npos) << e.what();
  }
  ASSERT_TRUE(fs::exists(dir_ / "used/step_2"));
  TrainerOptions options;
  options.console = false;
  options.overwrite = true;
  Trainer again(config("used", {{"train.steps", "1"}}), options);
  EXPECT_FALSE(fs::exists(dir_ / "used/step_2"));  // the old run's checkpoint is gone
  again.run();
  EXPECT_TRUE(fs::exists(dir_ / "used/step_1/manifest.json"));
}

TEST_F(TrainerTest, ResumeNamesEveryChangeThatBreaksExactContinuation) {
  run(config("a", {{"train.steps", "2"}}));
  const std::string step = (dir_ / "a/step_2").string();
  try {
    run(config("b", {{"train.seed", "7"}, {"optim.lr", "1e-3"}, {"train.steps", "4"}}), step);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("train.seed: 1337 -> 7"), std::string::npos) << what;
    EXPECT_NE(what.find("optim.lr"), std::string::npos) << what;
    EXPECT_EQ(what.find("train.steps"), std::string::npos) << what;  // may change
  }
  // More steps, another layout or checkpoint policy: accepted.
  EXPECT_EQ(run(config("c", {{"train.steps", "3"}, {"ckpt.keep_last", "1"}}), step).size(), 1u);
}

TEST_F(TrainerTest, ResumeAutoTakesLatestOrTheNewestThatVerifies) {
  auto full = run(config("auto", {{"train.checkpoint_interval", "2"}, {"train.steps", "6"}}));
  ASSERT_EQ(testing::read_file((dir_ / "auto/latest").string()), "step_6\n");
  TrainerOptions options;
  options.console = false;
  options.resume_dir = "auto";
  {
    Trainer t(config("auto", {{"train.steps", "6"}}), options);
    EXPECT_EQ(t.resumed_from(), (dir_ / "auto/step_6").string());
  }
  // Corrupt the newest checkpoint's data: auto falls back to step 4.
  const fs::path file = dir_ / "auto/step_6/rank_0.safetensors";
  std::string bytes = testing::read_file(file.string());
  bytes[bytes.size() / 2] ^= 0x10;
  testing::write_file(file.string(), bytes);
  Trainer t(config("auto", {{"train.steps", "6"}}), options);
  EXPECT_EQ(t.resumed_from(), (dir_ / "auto/step_4").string());
  EXPECT_EQ(t.step(), 4);
  const std::vector<StepRecord> rest = t.run();
  ASSERT_EQ(rest.size(), 2u);
  EXPECT_EQ(rest[0].loss, full[4].loss);
  EXPECT_EQ(rest[1].loss, full[5].loss);
}

// Every checkpoint corrupt (found while loading, after the state was partly
// overwritten): a fresh start, bit for bit the fresh run, the old files gone.
TEST_F(TrainerTest, ResumeAutoWithEveryCheckpointCorruptStartsFresh) {
  auto full = run(config("bad", {{"train.checkpoint_interval", "2"}, {"train.steps", "4"}}));
  for (const char* step : {"step_2", "step_4"}) {
    const fs::path file = dir_ / "bad" / step / "rank_0.safetensors";
    std::string bytes = testing::read_file(file.string());
    bytes[bytes.size() / 2] ^= 0x10;
    testing::write_file(file.string(), bytes);
  }
  TrainerOptions options;
  options.console = false;
  options.resume_dir = "auto";
  Trainer t(config("bad", {{"train.steps", "4"}}), options);
  EXPECT_EQ(t.resumed_from(), "");
  EXPECT_EQ(t.step(), 0);
  EXPECT_FALSE(fs::exists(dir_ / "bad/step_4"));
  const std::vector<StepRecord> again = t.run();
  ASSERT_EQ(again.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(again[i].loss, full[i].loss) << i;
}

TEST_F(TrainerTest, LoadsTheWholeTensorFormatOfEarlierVersions) {
  // A step directory of the earlier format, converted back from a sharded one
  // is not possible; write it from a run's gathered state instead.
  auto full = run(config("new", {{"train.checkpoint_interval", "4"}}));
  const fs::path legacy = dir_ / "legacy_step_4";
  fs::create_directories(legacy);
  {
    TrainerOptions options;
    options.console = false;
    options.resume_dir = (dir_ / "new/step_4").string();
    Trainer t(config("probe", {}), options);
    const char* files[] = {"model.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"};
    for (size_t k = 0; k < layout::kStateKinds; ++k) {
      const std::vector<float> state = t.gather_state(static_cast<layout::StateKind>(k));
      SafetensorsWriter writer;
      for (const Parameter& p : t.model().params()) {
        writer.add(p.spec.name, StDType::F32, p.spec.shape, state.data() + p.offset);
      }
      writer.write((legacy / files[k]).string());
    }
    std::ofstream(legacy / "train_state.json")
        << train_state_json(TrainState{4, 4, t.sampler_position(), 1337, nullptr}, t.config()).dump();
  }
  auto rest = run(config("from_legacy"), legacy.string());
  ASSERT_EQ(rest.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(rest[i].loss, full[4 + i].loss) << i;
}

}  // namespace
}  // namespace meshtrain

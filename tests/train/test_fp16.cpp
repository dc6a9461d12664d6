// fp16 with dynamic loss scaling: the loss scaler's rules, the update gates'
// decision and checkpointed state, and whole runs on real data (token ids
// sampled from stories260K, a model trained on TinyStories): a run started at
// loss scale 2^24 skips its first steps, backs the scale off and then tracks
// bf16; an injected Inf skips exactly that step; resume restores the scale.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <system_error>
#include <filesystem>
#include <string>
#include <vector>

#include "meshtrain/backend/registry.h"
#include "meshtrain/ckpt/llama2c.h"
#include "meshtrain/data/token_file.h"
#include "meshtrain/train/checkpoint.h"
#include "meshtrain/train/generate.h"
#include "meshtrain/train/trainer.h"
#include "meshtrain/train/update_gate.h"
#include "meshtrain/util/error.h"
#include "support/scratch.h"
#include "support/trainer_run.h"

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

LossScaleSettings settings(double init, int64_t interval, double min) {
  LossScaleSettings s;
  s.init = init;
  s.growth_interval = interval;
  s.min = min;
  return s;
}

StepCheck clean(int64_t step) { return {step, 2.0, 0.5}; }
StepCheck overflow(int64_t step) { return {step, 2.0, INFINITY}; }

// One gate decision the way the trainer takes it (single process).
GateDecision step_with(UpdateGates& gates, const StepCheck& c) { return gates.decide(c); }

TEST(LossScaler, GrowsAfterIntervalBacksOffOnOverflowAndStopsAtMin) {
  UpdateGates gates(nullptr);
  gates.add(std::make_unique<LossScaler>(settings(8.0, 3, 2.0)));
  EXPECT_EQ(gates.loss_scale(), 8.0);
  for (int64_t s = 1; s <= 2; ++s) EXPECT_TRUE(step_with(gates, clean(s)).apply);
  EXPECT_EQ(gates.loss_scale(), 8.0);
  EXPECT_TRUE(step_with(gates, clean(3)).apply);
  EXPECT_EQ(gates.loss_scale(), 16.0);  // 3 clean steps: x2

  const GateDecision skip = step_with(gates, overflow(4));
  EXPECT_FALSE(skip.apply);
  EXPECT_EQ(skip.reason, "gradient overflow");
  EXPECT_EQ(gates.loss_scale(), 8.0);  // x0.5
  EXPECT_FALSE(step_with(gates, {5, NAN, 0.1}).apply);  // a non-finite loss too
  EXPECT_EQ(gates.loss_scale(), 4.0);
  // The clean-step count restarted at the overflow.
  EXPECT_TRUE(step_with(gates, clean(6)).apply);
  EXPECT_TRUE(step_with(gates, clean(7)).apply);
  EXPECT_EQ(gates.loss_scale(), 4.0);
  EXPECT_FALSE(step_with(gates, overflow(8)).apply);
  EXPECT_EQ(gates.loss_scale(), 2.0);  // the minimum
  EXPECT_EQ(gates.skipped_steps(), 3);
  // Overflowing at the minimum cannot recover: the run ends, naming the step.
  try {
    step_with(gates, overflow(9));
    FAIL() << "no error at the minimum scale";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 9"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("training diverged"), std::string::npos) << e.what();
  }
}

TEST(LossScaler, BackoffNeverGoesBelowTheMinimum) {
  UpdateGates gates(nullptr);
  gates.add(std::make_unique<LossScaler>(settings(3.0, 10, 2.0)));
  EXPECT_FALSE(step_with(gates, overflow(1)).apply);
  EXPECT_EQ(gates.loss_scale(), 2.0);  // 1.5 clamped
}

TEST(UpdateGates, WithoutGatesEveryStepAppliesAndNothingIsScaled) {
  UpdateGates gates(nullptr);
  EXPECT_TRUE(gates.empty());
  EXPECT_EQ(gates.loss_scale(), 1.0);
  // A non-finite norm is not theirs to judge: the trainer's divergence check is.
  EXPECT_TRUE(step_with(gates, overflow(1)).apply);
  EXPECT_EQ(gates.skipped_steps(), 0);
}

TEST(UpdateGates, StateRoundTripsAndRejectsBadValues) {
  UpdateGates a(nullptr);
  a.add(std::make_unique<LossScaler>(settings(1024.0, 4, 1.0)));
  step_with(a, overflow(1));
  step_with(a, clean(2));
  const nlohmann::json state = a.state();
  EXPECT_EQ(state["skipped_steps"], 1);
  EXPECT_EQ(state["loss_scale"]["scale"], 512.0);
  EXPECT_EQ(state["loss_scale"]["good_steps"], 1);
  EXPECT_EQ(state["loss_scale"]["overflows"], 1);

  UpdateGates b(nullptr);
  b.add(std::make_unique<LossScaler>(settings(1024.0, 4, 1.0)));
  b.load_state(state, "ckpt");
  EXPECT_EQ(b.state(), state);
  // Three more clean steps complete the interval of 4: both double.
  for (int64_t s = 3; s <= 5; ++s) {
    step_with(a, clean(s));
    step_with(b, clean(s));
  }
  EXPECT_EQ(b.loss_scale(), 1024.0);
  EXPECT_EQ(a.state(), b.state());

  nlohmann::json bad = state;
  bad["loss_scale"]["scale"] = 0.5;  // below the minimum
  EXPECT_THROW(b.load_state(bad, "ckpt"), Error);
  bad = state;
  bad["loss_scale"].erase("good_steps");
  EXPECT_THROW(b.load_state(bad, "ckpt"), Error);
  // A run without the gate (another precision) ignores its entry.
  UpdateGates none(nullptr);
  none.load_state(state, "ckpt");
  EXPECT_EQ(none.skipped_steps(), 1);
}

const char* kConfig = R"(
[model]
family = "llama"
dim = 48
n_layers = 2
n_heads = 4
n_kv_heads = 2
hidden_dim = 128
vocab_size = 512
max_seq_len = 64
tie_embeddings = false
[train]
steps = 40
batch_size = 8
seq_len = 32
threads = 1
grad_clip = 1.0
eval_interval = 0
eval_batches = 2
checkpoint_interval = -1
peak_flops = 1e11
[optim]
lr = 3e-3
min_lr = 3e-4
warmup_steps = 5
[data]
)";

// Token ids sampled (temperature 1) from stories260K: real TinyStories-like
// text in its 512-id vocabulary, 24 stories decoded as one batch. Written once
// into the build tree (atomically) and reused by later test processes.
const std::string& stories_corpus() {
  static const std::string dir = [] {
    const fs::path d = fs::path(MESHTRAIN_BINARY_DIR) / "test_scratch" / "fp16_stories_corpus";
    constexpr int64_t kStories = 24, kLength = 380;
    if (fs::exists(d / "val.bin")) return d.string();
    // Built aside and renamed into place: ctest runs these tests in parallel processes.
    const fs::path mine = d.string() + "." + std::to_string(::getpid());
    fs::create_directories(mine);
    MemoryTracker tracker;
    // Tiny steps: one thread spends nothing on barriers.
    const std::unique_ptr<Backend> backend = make_backend(kHostBackend, 1, tracker);
    const std::string model_path = std::string(MESHTRAIN_SOURCE_DIR) + "/tests/models/stories260K.bin";
    auto model = import_llama2c(model_path, Precision::fp32, *backend);
    const int64_t vocab = model->config().vocab_size;
    KVCache cache = model->make_kv_cache(kStories, kLength);
    std::vector<int32_t> current(kStories, 1);  // BOS
    std::vector<std::vector<uint16_t>> stories(kStories, std::vector<uint16_t>{1});
    std::vector<float> logits(static_cast<size_t>(kStories * vocab));
    SampleOptions options;
    options.seed = 260;
    for (int64_t t = 1; t < kLength; ++t) {
      model->decode(current.data(), kStories, 1, cache, logits.data());
      for (int64_t b = 0; b < kStories; ++b) {
        current[b] = pick_token(logits.data() + b * vocab, vocab, options,
                                static_cast<uint64_t>(t * kStories + b));
        stories[b].push_back(static_cast<uint16_t>(current[b]));
      }
    }
    std::vector<uint16_t> tokens;
    for (const auto& story : stories) tokens.insert(tokens.end(), story.begin(), story.end());
    write_token_file((mine / "train.bin").string(), tokens);
    write_token_file((mine / "val.bin").string(),
                     std::vector<uint16_t>(tokens.end() - 1200, tokens.end()));
    std::error_code taken;  // another process got there first: its files are the same
    fs::rename(mine, d, taken);
    if (taken) fs::remove_all(mine);
    return d.string();
  }();
  return dir;
}

class Fp16Run : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::scratch_dir(); }
  TrainConfig config(const std::string& out, ConfigOverrides extra = {}) const {
    std::string toml = std::string(kConfig) + "train = \"" + stories_corpus() + "/train.bin\"\n" +
                       "val = \"" + stories_corpus() + "/val.bin\"\n";
    extra.insert(extra.begin(), {"train.out_dir", dir_ + "/" + out});
    return parse_config(toml, "fp16.toml", extra);
  }
  std::string dir_;
};

double mean_loss(const std::vector<StepRecord>& r, size_t from, size_t to) {
  double sum = 0;
  for (size_t i = from; i < to; ++i) sum += r[i].loss;
  return sum / static_cast<double>(to - from);
}

// Documented in docs/distributed.md#mixed-precision: after the scale has
// fallen, fp16's loss tracks bf16's within 2% (mean of the last 10 steps of 40)
// and its validation loss within 2%.
constexpr double kFp16VsBf16Tolerance = 0.02;

TEST_F(Fp16Run, ScaleStartingAt2To24FallsThenTheLossTracksBf16) {
  const testing::TrainerRun half = testing::run_trainer(
      config("fp16", {{"train.precision", "fp16"}, {"train.loss_scale_init", "16777216.0"}}),
      nullptr, "", true);
  const testing::TrainerRun brain =
      testing::run_trainer(config("bf16", {{"train.precision", "bf16"}}), nullptr, "", true);
  const std::vector<StepRecord>& r = half.records;
  ASSERT_EQ(r.size(), 40u);
  // 2^24 / 256 tokens makes the loss gradient 65536 > f16's 65504: step 1
  // overflows, and so do the next ones until the scale has fallen enough.
  EXPECT_EQ(r[0].loss_scale, 16777216.0);
  EXPECT_TRUE(r[0].skipped);
  EXPECT_EQ(r[0].skip_reason, "gradient overflow");
  size_t skipped = 0, leading = 0;
  while (leading < r.size() && r[leading].skipped) ++leading;
  EXPECT_GE(leading, 1u);
  for (size_t i = 0; i < r.size(); ++i) {
    SCOPED_TRACE(i);
    skipped += r[i].skipped ? 1 : 0;
    EXPECT_EQ(r[i].skipped_steps, static_cast<int64_t>(skipped));
    EXPECT_EQ(std::isfinite(r[i].grad_norm), !r[i].skipped);
    // Each skip halves the scale; nothing grows it (growth needs 2000 clean steps).
    if (i + 1 < r.size()) {
      EXPECT_EQ(r[i + 1].loss_scale, r[i].loss_scale * (r[i].skipped ? 0.5 : 1.0));
    }
  }
  // As the gradients grow in training an occasional later overflow halves it again.
  EXPECT_LE(skipped, 10u);
  EXPECT_LT(r.back().loss_scale, 16777216.0);
  const double fp16_tail = mean_loss(r, 30, 40), bf16_tail = mean_loss(brain.records, 30, 40);
  std::printf("fp16 from 2^24: %zu steps skipped (%zu leading), final scale %g; loss (mean of "
              "steps 31-40) fp16 %.4f bf16 %.4f; val fp16 %.4f bf16 %.4f\n",
              skipped, leading, r.back().loss_scale, fp16_tail, bf16_tail, half.val_loss,
              brain.val_loss);
  EXPECT_LT(fp16_tail, r[leading].loss - 0.4);  // it learned
  EXPECT_NEAR(fp16_tail, bf16_tail, kFp16VsBf16Tolerance * bf16_tail);
  EXPECT_NEAR(half.val_loss, brain.val_loss, kFp16VsBf16Tolerance * brain.val_loss);
}

// The scale never reaches the optimizer: after two steps at 2^16 the
// gradient norms and AdamW's first moments (linear in the gradient, unlike the
// update itself) match fp32's, as they would not with the gradients scaled.
TEST_F(Fp16Run, GradientsReachTheNormAndTheOptimizerUnscaled) {
  const ConfigOverrides two = {{"train.steps", "2"}};
  ConfigOverrides half = two;
  half.push_back({"train.precision", "fp16"});
  TrainerOptions options;
  options.console = false;
  Trainer full(config("fp32", two), options), scaled(config("fp16", half), options);
  const std::vector<StepRecord> f = full.run();
  const std::vector<StepRecord> r = scaled.run();
  ASSERT_FALSE(r[0].skipped || r[1].skipped);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(r[i].grad_norm, f[i].grad_norm, 1e-2 * f[i].grad_norm);
  EXPECT_EQ(r[1].loss_scale, 65536.0);
  const std::vector<float> want = full.gather_state(layout::StateKind::exp_avg);
  const std::vector<float> got = scaled.gather_state(layout::StateKind::exp_avg);
  ASSERT_EQ(got.size(), want.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-2);
}

TEST_F(Fp16Run, InjectedInfSkipsThatStepOnly) {
  // An fp16 run whose step 3 gets an Inf gradient ends (after 3 steps) with
  // the weights of the same run stopped after 2; the loss scale halved once.
  const ConfigOverrides fp16 = {{"train.precision", "fp16"}};
  ConfigOverrides three = fp16, two = fp16;
  three.push_back({"train.steps", "3"});
  two.push_back({"train.steps", "2"});
  ::setenv("MESHTRAIN_INJECT_INF", "3@0", 1);
  const testing::TrainerRun hit = testing::run_trainer(config("hit", three));
  ::unsetenv("MESHTRAIN_INJECT_INF");
  const testing::TrainerRun ref = testing::run_trainer(config("ref", two));
  ASSERT_EQ(hit.records.size(), 3u);
  EXPECT_FALSE(hit.records[1].skipped);
  EXPECT_TRUE(hit.records[2].skipped);
  EXPECT_EQ(hit.records[2].skipped_steps, 1);
  EXPECT_EQ(hit.records[2].loss_scale, 65536.0);  // the scale the step ran with
  EXPECT_EQ(hit.weights, ref.weights);
}

TEST_F(Fp16Run, ResumeRestoresTheScaleAndContinuesTheTraceExactly) {
  // From 2^24 with a growth interval of 3: skips, backoffs and growths on
  // both sides of the checkpoint at step 6.
  const ConfigOverrides extra = {{"train.precision", "fp16"},
                                 {"train.loss_scale_init", "16777216.0"},
                                 {"train.loss_scale_growth_interval", "3"},
                                 {"train.steps", "14"},
                                 {"train.checkpoint_interval", "6"}};
  const testing::TrainerRun full = testing::run_trainer(config("full", extra));
  {
    // The same run stopped after 6 steps and saved there.
    TrainerOptions options;
    options.console = false;
    Trainer first(config("resumed", extra), options);
    for (int i = 0; i < 6; ++i) first.train_step();
    first.save_checkpoint();
    first.wait_for_checkpoint();
  }
  const std::string ckpt = dir_ + "/resumed/step_6";
  const TrainState state = read_train_state(ckpt);
  ASSERT_TRUE(state.update_gates.contains("loss_scale")) << state.update_gates.dump();
  EXPECT_EQ(state.update_gates["loss_scale"]["scale"].get<double>(), full.records[6].loss_scale);
  EXPECT_EQ(state.update_gates["skipped_steps"].get<int64_t>(), full.records[5].skipped_steps);
  // --resume auto finds it.
  const testing::TrainerRun rest = testing::run_trainer(config("resumed", extra), nullptr, "auto");
  ASSERT_EQ(rest.records.size(), 8u);
  bool grew = false;
  for (size_t i = 0; i < rest.records.size(); ++i) {
    const StepRecord& a = full.records[i + 6];
    const StepRecord& b = rest.records[i];
    SCOPED_TRACE(a.step);
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.loss_scale, b.loss_scale);
    EXPECT_EQ(a.skipped, b.skipped);
    EXPECT_EQ(a.skipped_steps, b.skipped_steps);
    if (std::isfinite(a.grad_norm)) {
      EXPECT_EQ(a.grad_norm, b.grad_norm);
    }
    grew = grew || (i > 0 && b.loss_scale > rest.records[i - 1].loss_scale);
  }
  EXPECT_TRUE(grew) << "the window after the checkpoint should include a growth";
  EXPECT_EQ(full.weights, rest.weights);
}

TEST(Fp16Config, LossScaleKeysBelongToFp16) {
  const std::string base =
      "[model]\npreset = \"llama-tiny\"\n[data]\ntrain = \"x.bin\"\n[train]\nseq_len = 64\n";
  const TrainConfig c = parse_config(base + "precision = \"fp16\"\nloss_scale_init = 1024.0\n"
                                            "loss_scale_growth_interval = 50\nloss_scale_min = 4.0\n",
                                     "a.toml");
  EXPECT_EQ(c.train.precision, Precision::fp16);
  EXPECT_EQ(c.train.loss_scale.init, 1024.0);
  EXPECT_EQ(c.train.loss_scale.growth_interval, 50);
  EXPECT_EQ(c.train.loss_scale.min, 4.0);
  const TrainConfig back = config_from_json(config_to_json(c));
  EXPECT_EQ(back.train.loss_scale.init, 1024.0);
  EXPECT_EQ(back.train.loss_scale.growth_interval, 50);
  // Elsewhere a loss-scale setting would do nothing: refused by name.
  try {
    parse_config(base + "precision = \"bf16\"\nloss_scale_init = 1024.0\n", "b.toml");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.loss_scale_init"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_config(base + "precision = \"fp16\"\nloss_scale_init = 0.5\n", "c.toml"), Error);
  EXPECT_THROW(parse_config(base + "precision = \"fp16\"\nloss_scale_growth_interval = 0\n", "d.toml"),
               Error);
  // The defaults round-trip through a bf16 config (a saved checkpoint's).
  const TrainConfig b = parse_config(base + "precision = \"bf16\"\n", "e.toml");
  EXPECT_NO_THROW(config_from_json(config_to_json(b)));
}

}  // namespace
}  // namespace meshtrain

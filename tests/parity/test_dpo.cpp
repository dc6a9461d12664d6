// DPO / IPO: one whole step of the engine's preference path (an SftDataset of
// preference rows, the DataLoader, PreferenceObjective, the local StepRunner
// and data parallelism, as the trainer wires them) against the float64
// PyTorch reference (tests/reference/generate_fixtures.py dpo_case): the mean
// pair loss, the rewards and the gradients of LoRA's adapters (reference: the
// base, adapters off per step or precomputed) for sigmoid, label-smoothed
// sigmoid and IPO; and full fine-tuning's first step (the precomputed
// reference is the policy itself: loss log 2) with every weight's gradient.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <utility>

#include "fixtures.h"
#include "meshtrain/data/sft.h"
#include "meshtrain/train/data_parallel.h"
#include "meshtrain/train/evaluate.h"
#include "meshtrain/train/preference_objective.h"
#include "meshtrain/train/step_runner.h"

namespace meshtrain::parity {
namespace {

// Loss and gradients as test_lora.cpp (gradients: ||a - b|| / ||b||). Rewards
// (β times a difference of two summed log-probabilities, each a sum of fp32
// token losses) are compared in absolute terms, relative to β times the mean
// |log-probability| of the responses: their size before the subtraction.
constexpr double kTol = 1e-5;
constexpr double kRewardTol = 1e-5;

std::vector<double> read_f64(const SafetensorsReader& file, const std::string& name) {
  const StTensorInfo& info = file.info(name);
  EXPECT_EQ(info.dtype, StDType::F64) << name;
  std::vector<double> out(static_cast<size_t>(info.numel()));
  file.read_data(info.begin, out.data(), out.size() * sizeof(double));
  return out;
}

double scalar(const SafetensorsReader& file, const std::string& name) {
  return read_f64(file, name).at(0);
}

// max |a - b| / max |b|.
double max_rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(a.at(i) - b[i]));
    ref = std::max(ref, std::abs(b[i]));
  }
  return diff / ref;
}

// A variant's [dpo] settings as the fixture's metadata holds them (JSON).
DpoSettings dpo_settings(const nlohmann::json& j) {
  DpoSettings s;
  s.beta = j.at("beta");
  s.loss = j.at("loss") == "ipo" ? DpoLoss::ipo : DpoLoss::sigmoid;
  s.label_smoothing = j.at("label_smoothing");
  return s;
}

// <case>.dpo.safetensors: its preference rows, and the dataset the engine
// builds from their pairs.
struct PreferenceRows {
  SafetensorsReader dpo;
  int64_t rows = 0, seq = 0, pairs = 0;
  int32_t pad = 0;
  std::vector<int32_t> tokens, targets, positions, responses;
  std::unique_ptr<SftDataset> data;

  explicit PreferenceRows(const std::string& name)
      : dpo(fixture_path(name + ".dpo.safetensors")) {
    const auto& shape = dpo.info("tokens").shape;
    rows = shape[0], seq = shape[1];
    pairs = std::stoll(dpo.metadata("pairs"));
    pad = std::stoi(dpo.metadata("pad"));
    tokens = to_i32(dpo.read_ints("tokens"));
    targets = to_i32(dpo.read_ints("targets"));
    positions = to_i32(dpo.read_ints("positions"));
    responses = to_i32(dpo.read_ints("responses"));
    SftOptions options;
    options.seq_len = seq;
    options.shuffle = false;  // the rows in file order, packed as the fixture packed them
    data = std::make_unique<SftDataset>(pairs_of_rows(), pad, options);
  }

  // The pairs the rows were packed from: each segment (positions restart at
  // 0) holding loss tokens is a record (its inputs, then its last target; a
  // token is in the loss where its target is), consecutive records a pair
  // (chosen, rejected); padding segments hold none.
  SftGroups pairs_of_rows() const {
    SftGroups out;
    out.count_groups = true;
    out.noun = "preference pairs";
    std::vector<SftRecord> pair;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t at = row * seq;
      for (int64_t begin = 0, end = 1; begin < seq; begin = end++) {
        while (end < seq && positions[static_cast<size_t>(at + end)] != 0) ++end;
        SftRecord record{{}, {0}};
        for (int64_t t = at + begin; t < at + end; ++t) {
          record.tokens.push_back(tokens[static_cast<size_t>(t)]);
          record.in_loss.push_back(targets[static_cast<size_t>(t)] >= 0 ? 1 : 0);
        }
        if (std::ranges::count(record.in_loss, 1) == 0) continue;  // padding
        record.tokens.push_back(targets[static_cast<size_t>(at + end - 1)]);
        pair.push_back(std::move(record));
        if (pair.size() == 2) out.groups.push_back(std::exchange(pair, {}));
      }
    }
    EXPECT_TRUE(pair.empty()) << "a chosen response without its rejected one";
    return out;
  }
};

// A TrainConfig for one step over all the rows (one micro-batch), as the
// trainer builds it for data.format = "preference-jsonl".
TrainConfig step_config(const ModelConfig& model, const PreferenceRows& rows,
                        const DpoSettings& dpo, bool precompute, const std::string& out_dir) {
  TrainConfig config;
  config.model = model;
  config.data.format = "preference-jsonl";
  config.train.precision = Precision::fp32;
  config.train.seq_len = rows.seq;
  config.train.batch_size = rows.rows;
  config.train.micro_batch_size = rows.rows;
  config.train.out_dir = out_dir;
  config.dpo.loss = dpo;
  config.dpo.precompute_reference = precompute;
  return config;
}

struct StepResult {
  double loss = 0;  // the mean over the step's pairs
  int64_t pairs = 0;
  StepRecord record;
};

// One training step's passes (no update) through the engine's objective,
// runner and data parallelism; the gradients of the mean loss in the model.
StepResult run_step(const TrainConfig& config, Model& model, const SampleSource& data) {
  const TrainSettings& t = config.train;
  LoaderOptions options = rank_loader_options(t.batch_size, t.micro_batch_size, 0, 1);
  options.seed = t.seed;
  DataLoader loader(data, options);
  std::unique_ptr<StepObjective> objective =
      make_step_objective(config, model, data, nullptr, options, nullptr);
  EXPECT_NE(dynamic_cast<PreferenceObjective*>(objective.get()), nullptr);
  std::unique_ptr<StepRunner> runner =
      make_step_runner(config, model, nullptr, loader.micro_batches_per_step(),
                       options.micro_batch, objective.get());
  std::unique_ptr<DataParallel> dp = make_data_parallel(config, model, nullptr, 0);
  objective->start(*runner, false);
  StepResult out;
  out.pairs = loader.step_loss_tokens();
  out.record.step = 1;
  dp->begin_step();
  const double sum =
      runner->run(loader, *dp, 1.0f / static_cast<float>(out.pairs), out.record);
  dp->finish_gradient_sync();
  out.loss = sum / static_cast<double>(out.pairs);
  return out;
}

// Every gradient the model holds against prefix + "grad/<name>"; returns the worst error.
double check_gradients(const Model& model, const SafetensorsReader& dpo, const std::string& prefix,
                       MemoryTracker& tracker) {
  double worst = 0;
  int64_t checked = 0;
  for (const Parameter& p : model.params()) {
    if (!p.spec.trainable) {
      EXPECT_FALSE(p.grad.defined()) << p.spec.name << ": a frozen parameter has a gradient";
      continue;
    }
    Tensor g = dpo.read_tensor(prefix + "grad/" + p.spec.name, DType::f32,
                               MemCategory::workspace, tracker);
    EXPECT_EQ(g.shape(), p.spec.shape) << p.spec.name;
    const double err = rel_error(p.grad.data<float>(), g.data<float>(), g.numel());
    EXPECT_LE(err, kTol) << prefix << "gradient of " << p.spec.name;
    worst = std::max(worst, err);
    ++checked;
  }
  EXPECT_GT(checked, 0);
  return worst;
}

// The precomputed table in out_dir against the fixture's reference log-probabilities.
double check_reference_table(const std::string& out_dir, const PreferenceRows& rows) {
  const std::string path = (std::filesystem::path(out_dir) / kReferenceLogpsFile).string();
  EXPECT_TRUE(std::filesystem::exists(path)) << path;
  ReferenceLogps table = ReferenceLogps::load(SafetensorsReader(path), "", *rows.data);
  const std::vector<double> want = read_f64(rows.dpo, "reference_logps");
  EXPECT_EQ(table.values().size(), want.size());
  const double err = max_rel_error(table.values(), want);
  EXPECT_LE(err, kTol) << "precomputed reference log-probabilities";
  return err;
}

double mean_abs(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += std::abs(x);
  return sum / static_cast<double>(v.size());
}

class Dpo : public ::testing::TestWithParam<const char*> {};

// The rows come back from their pairs as the engine packs them (SftDataset,
// pairs as loss tokens), and PreferenceObjective reads the fixture's
// responses out of them.
TEST_P(Dpo, RowsAreTheEnginesPackingOfTheirPairs) {
  const PreferenceRows rows(GetParam());
  const SftDataset& data = *rows.data;
  ASSERT_EQ(data.num_samples(), rows.rows);
  ASSERT_TRUE(data.has_positions());
  EXPECT_EQ(data.num_records(), rows.pairs);
  std::vector<int32_t> inputs(static_cast<size_t>(rows.seq)), targets(inputs.size()),
      positions(inputs.size()), response(inputs.size());
  int64_t pairs = 0, padded = 0, two_pairs = 0;
  for (int64_t row = 0; row < rows.rows; ++row) {
    SCOPED_TRACE(row);
    const auto row_of = [&](const std::vector<int32_t>& v) { return v.begin() + row * rows.seq; };
    data.read_sample(row, inputs.data(), targets.data());
    data.read_positions(row, positions.data());
    EXPECT_TRUE(std::equal(inputs.begin(), inputs.end(), row_of(rows.tokens)));
    EXPECT_TRUE(std::equal(targets.begin(), targets.end(), row_of(rows.targets)));
    EXPECT_TRUE(std::equal(positions.begin(), positions.end(), row_of(rows.positions)));
    const int64_t row_pairs =
        row_responses(targets.data(), positions.data(), rows.seq, response.data());
    EXPECT_TRUE(std::equal(response.begin(), response.end(), row_of(rows.responses)));
    EXPECT_EQ(data.loss_tokens(row), row_pairs);
    pairs += row_pairs;
    two_pairs += row_pairs == 2 ? 1 : 0;
    padded += inputs.back() == rows.pad && targets.back() < 0 ? 1 : 0;
  }
  EXPECT_EQ(pairs, rows.pairs);
  EXPECT_GT(two_pairs, 0) << "no row packs two pairs";
  EXPECT_GT(padded, 0) << "no row is padded";
}

// LoRA: policy = base + adapters, reference = the base (adapters off in each
// step, or a table precomputed with them off); each variant's mean loss,
// rewards and adapter gradients.
TEST_P(Dpo, LoraStepMatchesFloat64Reference) {
  const std::string name = GetParam();
  const PreferenceRows rows(name);
  SafetensorsReader lora(fixture_path(name + ".lora.safetensors"));
  MemoryTracker tracker;
  cpu::CpuBackend ctx(0, tracker);
  const ModelConfig model_config = lora_config(name, lora);
  Model model(model_config, Precision::fp32, ctx);
  load_base_and_adapters(model, name, lora);
  const nlohmann::json variants = nlohmann::json::parse(rows.dpo.metadata("variants"));
  const std::string scratch = scratch_dir();
  const std::vector<double> policy = read_f64(rows.dpo, "policy_logps");
  for (const auto& [variant, settings] : variants.items()) {
    for (const bool precompute : {false, true}) {
      SCOPED_TRACE(variant + (precompute ? " (precomputed reference)" : ""));
      const std::string out_dir = scratch + "/" + variant + (precompute ? "_table" : "");
      std::filesystem::create_directories(out_dir);
      const DpoSettings dpo = dpo_settings(settings);
      const TrainConfig config = step_config(model_config, rows, dpo, precompute, out_dir);
      const StepResult step = run_step(config, model, *rows.data);
      EXPECT_EQ(step.pairs, rows.pairs);
      const double want = scalar(rows.dpo, variant + "/loss");
      const double loss_err = std::abs(step.loss - want) / want;
      EXPECT_LE(loss_err, kTol) << "loss " << step.loss << ", reference " << want;
      EXPECT_GT(std::abs(want - std::log(2.0)), 1e-3) << "the adapters make policy = reference";
      const StepRecord& r = step.record;
      EXPECT_TRUE(r.preference);
      const double reward_scale = dpo.beta * mean_abs(policy);
      double reward_err = 0;
      for (const auto& [key, got] : {std::pair{"chosen", r.reward_chosen},
                                     std::pair{"rejected", r.reward_rejected},
                                     std::pair{"margin", r.reward_margin}}) {
        const double err =
            std::abs(got - scalar(rows.dpo, variant + "/reward_" + key)) / reward_scale;
        EXPECT_LE(err, kRewardTol) << "reward " << key;
        reward_err = std::max(reward_err, err);
      }
      EXPECT_DOUBLE_EQ(r.reward_accuracy, scalar(rows.dpo, variant + "/reward_accuracy"));
      const double grad_err = check_gradients(model, rows.dpo, variant + "/", tracker);
      double table_err = 0;
      if (precompute) table_err = check_reference_table(out_dir, rows);
      std::printf("%s dpo %s%s: loss rel err %.2e, rewards %.2e, worst adapter gradient %.2e%s\n",
                  name.c_str(), variant.c_str(), precompute ? " (precomputed)" : "", loss_err,
                  reward_err, grad_err,
                  precompute ? fmt::format(", table {:.2e}", table_err).c_str() : "");
    }
  }
}

// Full fine-tuning's first step: every weight trainable, the reference
// precomputed from the same weights (written to train.out_dir), so z = 0 for
// every pair: loss log 2, rewards 0, and each
// gradient β/2 · (∇ log πθ(r) − ∇ log πθ(c)) averaged over the pairs.
TEST_P(Dpo, FullFineTuningFirstStepMatchesFloat64Reference) {
  const std::string name = GetParam();
  const PreferenceRows rows(name);
  FixtureModel f(name, Precision::fp32);
  Model& model = *f.model;
  ASSERT_FALSE(model.config().lora.enabled());
  const std::string out_dir = scratch_dir();
  const TrainConfig config =
      step_config(model.config(), rows,
                  dpo_settings(nlohmann::json::parse(rows.dpo.metadata("full"))), true, out_dir);
  const StepResult step = run_step(config, model, *rows.data);
  EXPECT_EQ(step.pairs, rows.pairs);
  const double want = scalar(rows.dpo, "full/loss");
  EXPECT_NEAR(want, std::log(2.0), 1e-12);
  const double loss_err = std::abs(step.loss - want) / want;
  EXPECT_LE(loss_err, kTol);
  const StepRecord& r = step.record;
  EXPECT_TRUE(r.preference);
  const double reward_scale =
      config.dpo.loss.beta * mean_abs(read_f64(rows.dpo, "reference_logps"));
  EXPECT_LE(std::abs(r.reward_chosen) / reward_scale, kRewardTol);
  EXPECT_LE(std::abs(r.reward_rejected) / reward_scale, kRewardTol);
  const double grad_err = check_gradients(model, rows.dpo, "full/", f.tracker);
  const double table_err = check_reference_table(out_dir, rows);
  std::printf("%s dpo full: loss %.9f (rel err %.2e), rewards %.1e / %.1e, worst gradient %.2e, "
              "table %.2e\n",
              name.c_str(), step.loss, loss_err, r.reward_chosen, r.reward_rejected, grad_err,
              table_err);
}

INSTANTIATE_TEST_SUITE_P(Cases, Dpo, ::testing::Values("llama_gqa", "gpt2"));

}  // namespace
}  // namespace meshtrain::parity

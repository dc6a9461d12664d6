// LoRA on the reference models: the adapters' gradients (with and without
// dropout) against the float64 PyTorch reference
// (tests/reference/generate_fixtures.py lora_case), the base
// frozen (no gradient, no optimizer state, never written), step 0 equal to the
// base model, and what a frozen bf16 base holds.
#include <gtest/gtest.h>

#include <sstream>

#include "fixtures.h"
#include "meshtrain/backend/cpu/cpu_backend.h"
#include "meshtrain/optim/adamw.h"
#include "meshtrain/util/error.h"

namespace meshtrain::parity {
namespace {

constexpr double kTol = 1e-5;

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

// The case's config with the fixture's [lora] settings.
ModelConfig lora_config(const std::string& name, const SafetensorsReader& lora) {
  const std::string path = fixture_path(name + ".weights.safetensors");
  ModelConfig config = parse_hf_config(SafetensorsReader(path).metadata("config"), path);
  config.lora.rank = std::stoll(lora.metadata("rank"));
  config.lora.alpha = std::stof(lora.metadata("alpha"));
  config.lora.targets = split_commas(lora.metadata("targets"));
  return config;
}

// Base weights from the case's weights file, adapters from its lora file.
void load_base_and_adapters(Model& model, const std::string& name,
                            const SafetensorsReader& lora) {
  SafetensorsReader base(fixture_path(name + ".weights.safetensors"));
  for (Parameter& p : model.params()) {
    (p.spec.lora_adapter ? lora : base).read(p.spec.name, p.master);
  }
  model.sync_compute_weights();
}

class Lora : public ::testing::TestWithParam<const char*> {};

// One case's fp32 LoRA model (dropout p) on the reference's tokens.
struct LoraCase {
  std::string name;
  SafetensorsReader lora, ref;
  MemoryTracker tracker;
  cpu::CpuBackend ctx{0, tracker};
  std::unique_ptr<Model> model;
  int64_t batch = 0, seq = 0, n = 0;
  std::vector<int32_t> tokens, targets;

  LoraCase(const std::string& case_name, float dropout)
      : name(case_name),
        lora(fixture_path(case_name + ".lora.safetensors")),
        ref(fixture_path(case_name + ".reference.safetensors")) {
    ModelConfig config = lora_config(name, lora);
    config.lora.dropout = dropout;
    model = std::make_unique<Model>(config, Precision::fp32, ctx);
    load_base_and_adapters(*model, name, lora);
    const auto& shape = ref.info("tokens").shape;
    batch = shape[0], seq = shape[1], n = batch * seq;
    tokens = to_i32(ref.read_ints("tokens"));
    targets = to_i32(ref.read_ints("targets"));
  }
  double mean_loss_and_grads() {
    model->zero_grads();
    return model->forward_backward(tokens.data(), targets.data(), batch, seq,
                                   1.0f / static_cast<float>(n)) /
           static_cast<double>(n);
  }
  float stored(const std::string& key) {
    return lora.read_tensor(key, DType::f32, MemCategory::workspace, tracker).data<float>()[0];
  }
  // Every adapter's gradient against prefix + "grad/<name>"; returns the worst error.
  double check_adapter_grads(const std::string& prefix) {
    double worst = 0;
    for (const Parameter& p : model->params()) {
      if (!p.spec.trainable) continue;
      Tensor g = lora.read_tensor(prefix + "grad/" + p.spec.name, DType::f32,
                                  MemCategory::workspace, tracker);
      EXPECT_EQ(g.shape(), p.spec.shape) << p.spec.name;
      const double err = rel_error(p.grad.data<float>(), g.data<float>(), g.numel());
      EXPECT_LE(err, kTol) << prefix << "gradient of " << p.spec.name;
      worst = std::max(worst, err);
    }
    return worst;
  }
};

TEST_P(Lora, AdapterGradientsMatchFloat64ReferenceAndTheBaseGetsNone) {
  LoraCase c(GetParam(), 0.0f);
  const double loss = c.mean_loss_and_grads();
  const float base_loss =
      c.ref.read_tensor("loss", DType::f32, MemCategory::workspace, c.tracker).data<float>()[0];
  EXPECT_LE(std::abs(loss - c.stored("loss")) / c.stored("loss"), kTol);
  // The adapters matter: the loss differs from the base model's.
  EXPECT_GT(std::abs(loss - base_loss), 1e-3);
  const double worst = c.check_adapter_grads("");
  int64_t adapters = 0, trainable = 0;
  for (const Parameter& p : c.model->params()) {
    EXPECT_EQ(p.spec.trainable, p.spec.lora_adapter) << p.spec.name;
    if (!p.spec.trainable) {
      EXPECT_FALSE(p.grad.defined()) << p.spec.name << ": a frozen parameter has no gradient";
      continue;
    }
    ++adapters;
    trainable += p.spec.numel();
  }
  // Each adapter: values, gradient, gradient with dropout; + the losses and the samples.
  EXPECT_EQ(3 * adapters + 3, static_cast<int64_t>(c.lora.tensors().size()));
  EXPECT_EQ(c.model->num_trainable(), trainable);
  std::printf("%s lora: %lld adapter tensors, worst gradient rel err %.2e\n", c.name.c_str(),
              static_cast<long long>(adapters), worst);
}

// With adapter dropout: the reference applies meshtrain's counter-based mask
// (reference_model.lora_dropout, a port of util/rng.h) to each adapter's input.
TEST_P(Lora, DropoutGradientsMatchFloat64Reference) {
  const std::string name = GetParam();
  SafetensorsReader meta(fixture_path(name + ".lora.safetensors"));
  LoraCase c(name, std::stof(meta.metadata("dropout")));
  Model& model = *c.model;
  EXPECT_THROW(model.forward_backward(c.tokens.data(), c.targets.data(), c.batch, c.seq, 1.0f),
               Error)
      << "dropout without the rows' samples";
  model.set_lora_dropout(std::stoull(meta.metadata("dropout_seed")),
                         std::stoll(meta.metadata("dropout_step")),
                         c.lora.read_ints("dropout/samples"));
  const double loss = c.mean_loss_and_grads();
  EXPECT_LE(std::abs(loss - c.stored("dropout/loss")) / c.stored("dropout/loss"), kTol);
  EXPECT_GT(std::abs(loss - c.stored("loss")), 1e-4) << "the mask changes the loss";
  const double worst = c.check_adapter_grads("dropout/");
  // Evaluation never drops: the loss is the no-dropout one.
  const double eval =
      model.forward_loss(c.tokens.data(), c.targets.data(), c.batch, c.seq) / c.n;
  EXPECT_LE(std::abs(eval - c.stored("loss")) / c.stored("loss"), kTol);
  std::printf("%s lora dropout: worst gradient rel err %.2e\n", name.c_str(), worst);
}

TEST_P(Lora, StepZeroIsTheBaseModelAndTrainingNeverWritesTheBase) {
  const std::string name = GetParam();
  SafetensorsReader lora(fixture_path(name + ".lora.safetensors"));
  SafetensorsReader ref(fixture_path(name + ".reference.safetensors"));
  const auto& shape = ref.info("tokens").shape;
  const int64_t batch = shape[0], seq = shape[1], n = batch * seq;
  const auto tokens = to_i32(ref.read_ints("tokens"));
  const auto targets = to_i32(ref.read_ints("targets"));
  ModelConfig config = lora_config(name, lora);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(precision_name(precision)));
    MemoryTracker tracker;
    cpu::CpuBackend ctx(0, tracker);
    ModelConfig base_config = config;
    base_config.lora = {};
    Model base(base_config, precision, ctx);
    Model tuned(config, precision, ctx);
    base.init_weights(7);
    tuned.init_weights(7);  // same base values (keyed by name), B = 0
    // A frozen tied bf16 embedding is held as bf16 only, so the lookup reads
    // it rounded: the base model, rounded alike, is then the same model.
    Parameter& embedding = base.params()[0];
    if (precision != Precision::fp32 && embedding.compute.defined()) {
      embedding.master.copy_from(embedding.compute);
    }
    EXPECT_EQ(base.forward_loss(tokens.data(), targets.data(), batch, seq),
              tuned.forward_loss(tokens.data(), targets.data(), batch, seq));

    std::vector<float> before(static_cast<size_t>(tuned.num_params()));
    tuned.read_values(0, tuned.num_params(), before.data());
    AdamW opt(tuned, AdamWConfig{});
    for (int step = 0; step < 3; ++step) {
      tuned.zero_grads();
      tuned.forward_backward(tokens.data(), targets.data(), batch, seq, 1.0f / n);
      opt.step(1e-2f);
    }
    std::vector<float> after(before.size());
    tuned.read_values(0, tuned.num_params(), after.data());
    int64_t changed_adapters = 0;
    for (const Parameter& p : tuned.params()) {
      const auto first = before.begin() + p.offset, last = first + p.spec.numel();
      const bool same = std::equal(first, last, after.begin() + p.offset);
      if (!p.spec.trainable) {
        EXPECT_TRUE(same) << p.spec.name << " is frozen but changed";
      } else {
        changed_adapters += same ? 0 : 1;
      }
      // Mixed precision: a frozen matmul weight is its compute copy only.
      const bool compute_only = precision != Precision::fp32 && !p.spec.trainable &&
                                p.spec.matmul_weight;
      EXPECT_EQ(p.master.defined(), !compute_only) << p.spec.name;
    }
    EXPECT_GT(changed_adapters, 0);
    EXPECT_NE(tuned.forward_loss(tokens.data(), targets.data(), batch, seq),
              base.forward_loss(tokens.data(), targets.data(), batch, seq));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Lora, ::testing::Values("llama_gqa", "gpt2"));

}  // namespace
}  // namespace meshtrain::parity
